"""Conformance checks of what DeepSeek-V4.1 adds: its block wiring and its host-side Engram hashing.

The block wiring: a block's attention input collapsed with the previous sub-layer's pre.

V4.1 collapses a sub-layer's residual streams with the pre of the sub-layer before it (the attention's with the
last FFN's, V41-REFERENCE §3.1); V4 with its own. A port that wires it V4's way (fault V03) changes almost nothing
a sub-layer or logit check can see on a random checkpoint: its four streams stay nearly equal, so the collapse
changes mostly in scale, and the RMSNorm after it removes the scale. The collapse itself does change, by the
ratio of the two pres' sums (10-20% on the tiny V4.1 checkpoint, against the device's 0.2% rounding). So each
recorded block call is replayed on the device with its generated block rendered to record its collapses, and
the block's first collapse is compared with sum_i pi_i X_i of the block's own inputs (the reference op).

The Engram hash ids: computed on the host from token ids (lib/runtime/engram_ids.py), they pick the table rows
each layer adds; a wrong prime or multiplier (fault V02) reads other rows, whose effect on the logits of a random
checkpoint is a few flipped near-ties. The ids themselves are exact integers, so the device runtime's ids of the
run's tokens must equal the reference hashing's.
"""
from __future__ import annotations

from pathlib import Path

import torch

from backends.cpu.ops.hc import hc_collapse
from codegen.lower import Rewrite
from lib.porting.conformance_paged import copy_pools
from lib.porting.rendering import rendered
from lib.quant.reference_formats import resolve
from lib.runtime.engram_ids import Tail, engram_hashing, step_ids
from lib.runtime.loaded_model import load_model
from lib.weights.checkpoint import Checkpoint
from spec.profile import load_profile

BLOCK_TABLE = "BLOCK_V41"


def block_calls(recorded) -> list:
    """The recorded V4.1 block calls (table, kind, args, out) of a reference run, but an Engram layer's (it adds its
    rows to the streams before the collapse, so the collapse is not of the block's input streams)."""
    return [c for c in recorded if c[0] == BLOCK_TABLE and not c[2][-3].engram]


def collapse_check(calls, model_path, backend: str, options, rewrite: Rewrite | None, budget: float):
    """One check: the median per-token error of each replayed block's first collapse against sum_i pi_i X_i."""
    from lib.porting.conformance import OUTLIER_FACTOR, OUTLIER_SHARE, Check, _to, _token_errors   # imports this
    from lib.porting.conformance_ops import op_call

    recording = (rewrite or Rewrite())._replace(record_ops=("hc_collapse",))
    errors = []
    with rendered(backend, recording, "blocks") as code:
        dev = load_model(model_path, backend, options=options, code=code)
        angles_of = resolve(op_call(load_profile(backend), "rope_angles"))
        for _, kind, args, _ in calls:       # (lp, x, pi, selection, candidates, batch, cache, layer, cfg, rope)
            layer = args[-3]
            inputs = [_to(a, dev.state_dtype) for a in args[1:-3]]
            inputs[5] = copy_pools(inputs[5], dev.state, layer.attention, dev.state_dtype)
            del code.model.RECORDED[:]
            getattr(code.model, BLOCK_TABLE)[kind](dev.params.layers[layer.index], *inputs, layer, dev.cfg,
                                                 angles_of(inputs[4], tables=dev.rope))
            first = next(out for table, op, _, _, out in code.model.RECORDED if op == "hc_collapse")
            errors.append(_token_errors(first, hc_collapse(args[1], args[2])))
    e = torch.cat(errors)
    median, share = e.median().item(), (e > OUTLIER_FACTOR * budget).float().mean().item()
    return Check(f"block input collapse with the previous sub-layer's pre ({e.numel()} tokens)",
                 f"{median:.4f} / {share:.1%}", f"<= {budget} / <= {OUTLIER_SHARE:.0%}",
                 median <= budget and share <= OUTLIER_SHARE)


def engram_ids_check(dev, model_path, tokens: list[int]):
    """One check (None without Engram layers): the device runtime's Engram hash ids of `tokens` against the ids of
    the reference hashing (the config's primes and multipliers)."""
    from lib.porting.conformance import Check

    if dev.engram is None:
        return None
    reference = engram_hashing(Checkpoint(model_path).config, Path(model_path))
    got, want = (step_ids(h, Tail(0, ()), 0, tokens, 0)[0] for h in (dev.engram, reference))
    differ = int((got != want).any(axis=(1, 2)).sum()) if got.shape == want.shape else len(tokens)
    return Check(f"Engram hash ids of the run's {len(tokens)} tokens (host)",
                 "identical" if differ == 0 else f"{differ} tokens differ", "identical", differ == 0)
