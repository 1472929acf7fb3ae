"""`dsv4gen conformance --context N`: a device backend against the cpu reference past a long prefill.

The short run (lib/porting/conformance.py) never leaves the first few compressed entries. What a
long context adds only shows here: CSA's indexer choosing among thousands of entries, HCA
attending more than one block of them, entries at large positions, block tables of many blocks.
The reference prefills N positions in chunks and decodes a few greedy steps; the device prefills
the same chunks (a staggered cache, its own block geometry) and is teacher-forced over those
steps, all under the guard. The reference records the last prefill chunk and the decode steps
only (every chunk's records would hold gigabytes): each attention and MoE sub-layer is replayed on
the device within the profile's budgets, and the selection each replayed CSA layer made is
compared with the reference's entry by entry (a query whose selection differs at a near-tie is
judged there, not also as an attention outlier). The logits of every position of the last chunk
and of each decode step must agree on top-1 wherever the reference's margin exceeds the logit
budget, and the state the device holds at the end (every entry of every layer) must be the
reference's within the state budget of lib/porting/conformance_paged.py.

It means something only with Flash's window 128 and compress ratios 4 / 128 (the `tiny-long`
preset, lib/weights/tiny_checkpoint.py): one check says whether the config has them, two how
many entries CSA chose among and HCA attended at the last step (at least N/4 and N/128).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from codegen.lower import Rewrite
from lib.console.stages import Stages
from lib.guard.capability import CapabilityGuard, rules_from_profile
from lib.porting.conformance import (Check, Report, device_sublayers, fused_widths, guard_check, logit_checks,
                                     prompt_ids, sublayer_checks)
from lib.porting.conformance_ops import SELECTION_MISMATCH
from lib.porting.conformance_paged import new_store, recording_step, state_check
from lib.porting.rendering import rendered
from lib.records.addressing import PagedSites
from lib.records.batch import make_batch
from lib.runtime.loaded_model import Model, generated, load_model
from lib.runtime.paged_step import paged_step
from lib.weights.params import LoadOptions
from lib.weights.checkpoint import Checkpoint
from spec.profile import load_profile

FLASH_WINDOW, FLASH_RATIOS = 128, (4, 128)
# Share of the decisive positions whose top-1 must agree. Past a long prefill the indexer's
# near-tie choices differ for a quarter to four fifths of the queries (250-599 of 1040 at 1536
# positions, 840-1675 of 2064 at 16384, measured over the device backends), each moving its
# attention a little; over hundreds of decisive positions a few flip at margins above the logit
# budget (measured: ascend310p 414/416 at 1536 and 810/811 at 16384, ascend910 280/281 and
# 511/515). A real bug moves many (C02: 393/416 at 1536 on ascend310p).
TOP1_SHARE = 0.98


class ContextReference(NamedTuple):
    ids: list[int]                 # the N prefilled positions
    chunk: int                     # prefill chunk size
    tokens: list[int]              # the greedy tokens decoded after them, fed one per step
    logits: list[torch.Tensor]     # [1, V] of every position of the last chunk, then of each decode step
    sublayer_calls: list           # recorded attention / MoE calls of the last chunk and the decode steps
    selections: list               # [T, k] entry ids each CSA layer selected in the same steps, in call order
    state: dict                    # its live rows at the end (PagedCache.live_rows)


def context_reference(model_path, context: int, steps: int = 8, chunk: int = 1024) -> ContextReference:
    """The cpu reference's run: `context` positions prefilled in chunks, then `steps` greedy tokens."""
    if context < 1 or steps < 1 or chunk < 1:
        raise ValueError(f"--context, --steps and the prefill chunk must be positive (got {context}, {steps}, {chunk})")
    recording = Rewrite(record_ops=("index_select",), record_dispatch=True)
    with rendered("cpu", recording, "reference") as code:
        ref = load_model(model_path, "cpu", code=code)
        ids, recorded = prompt_ids(context, ref.cfg.vocab_size), code.model.RECORDED
        store, seqs = new_store(ref, [context + steps], staggered=False)
        starts = list(range(0, context, chunk))
        for pos in starts:
            batch = make_batch([ids[pos:pos + chunk]], [pos])
            logits = recording_step(ref, store, batch, seqs, recorded, keep=pos == starts[-1])
        rows, tokens = [row[None] for row in logits], []
        for k in range(steps):
            tokens.append(int(torch.argmax(rows[-1][-1])))
            rows.append(recording_step(ref, store, make_batch([[tokens[-1]]], [context + k], last_only=True), seqs,
                                       recorded))
        recorded, state = list(recorded), store.live_rows(seqs[0])
    calls = [(table, kind, args, out) for table, kind, args, _, out in recorded if table != "op"]
    selections = [out for table, _, _, _, out in recorded if table == "op"]
    return ContextReference(ids, chunk, tokens, rows, calls, selections, state)


def run(backend: str, model_path, context: int, steps: int = 8, chunk: int = 1024, ep_sim: int = 2,
        inject: str | None = None, expert_mode: str | None = None, reference: ContextReference | None = None,
        stop_on_failure: bool = False, stages: Stages | None = None) -> Report:
    """Long-context checks of `backend` (`reference` may be reused across backends), with the fused
    kernels' width limits relaxed for the emulation as in the short run (lib/porting/conformance.py
    run): the tiny-long preset meets every other limit of ascend910's fused attention, which the
    device's decode steps then run. With `stop_on_failure` the report ends when the replays fail,
    before the device's own long run."""
    with fused_widths(inject):
        return _run(backend, model_path, context, steps, chunk, ep_sim, inject, expert_mode, reference,
                    stop_on_failure, stages)


def _run(backend: str, model_path, context: int, steps: int, chunk: int, ep_sim: int, inject: str | None,
         expert_mode: str | None, reference: ContextReference | None, stop_on_failure: bool,
         stages: Stages | None) -> Report:
    from lib.porting.faults import injection

    profile = load_profile(backend)
    budgets = profile.conformance
    stages = stages or Stages.quiet()
    if stages.enabled and stages.total is None:
        stages.total = 3 + (reference is None)
    if reference is None:
        with stages(f"cpu reference ({context}-position prefill in chunks of {chunk} + {steps} greedy steps)"):
            reference = context_reference(model_path, context, steps, chunk)
    context, steps = len(reference.ids), len(reference.tokens)
    guard = CapabilityGuard(rules_from_profile(profile), mode="count")
    with injection(inject, backend, Checkpoint(model_path).config.model_type) as fault:
        options = fault.options(LoadOptions(expert_mode=expert_mode, ep_size=ep_sim, ep_simulate=ep_sim > 1))
        # the replays run a rendering of the device's code (with the injected bug, if any) that records
        # its own index_select calls: the selections its sub-layers actually made
        wrong = fault.injection.rewrite(backend) if fault.injection and fault.injection.rewrite else Rewrite()
        with rendered(backend, wrong._replace(record_ops=("index_select",)), "replay") as replay:
            with stages(f"loading the {backend} model" + (f" (experts {expert_mode})" if expert_mode else "")):
                dev = load_model(model_path, backend, options=options, code=replay)
            with stages(f"replays of the last chunk and the decode steps ({len(reference.sublayer_calls)} "
                        "sub-layer calls)"), guard:
                results = device_sublayers(reference.sublayer_calls, dev)
            picks = [out for table, _, _, _, out in replay.model.RECORDED if table == "op"]
        dev = dev._replace(module=(fault.code or generated(backend)).model)      # the long run records nothing
        dev = dev._replace(forward=dev.module.forward)
        wanted = reference.selections
        checks = [Check("fused kernels run (widths relaxed for the emulation)", ", ".join(sorted(dev.cfg.fused)) or "none",
                        "reported", True)]
        checks += sublayer_checks(results, budgets, _flipped(picks, wanted)) + [selection_check(picks, wanted, profile)]
        if stop_on_failure and not all(c.passed for c in checks):
            return Report(backend, tuple(checks + [guard_check(guard)]))
        with stages(f"device prefill of {context} positions + {steps} teacher-forced steps (staggered cache, "
                    "under the guard)"), guard:
            rows, store, error = _device_run(dev, reference, fault.paged)
        checks += [guard_check(guard)] + logit_checks(reference.logits, rows, budgets["logits"].budget, error,
                                                     what="positions", agree_share=TOP1_SHARE)
        checks.append(state_check(reference.state, None if store is None else store.live_rows(0), error, Check))
        checks += scale_checks(dev, store, context)
    return Report(backend, tuple(checks))


def _device_run(dev: Model, reference: ContextReference, sites: PagedSites):
    """(logit rows like the reference's, the cache, None) or (None, None, error): a slot mapping
    gone wrong can index outside its pool, a finding of the report."""
    ids, chunk, tokens = reference.ids, reference.chunk, reference.tokens
    try:
        store, seqs = new_store(dev, [len(ids) + len(tokens)], sites=sites)
        for pos in range(0, len(ids), chunk):
            (logits,) = paged_step(dev, make_batch([ids[pos:pos + chunk]], [pos]), store, seqs)
        rows = [row[None] for row in logits]
        for k, token in enumerate(tokens):
            rows.append(paged_step(dev, make_batch([[token]], [len(ids) + k], last_only=True), store, seqs)[0])
    except (IndexError, RuntimeError) as err:
        return None, None, f"{type(err).__name__}: {err}"
    return rows, store, None


def _flipped(picks: list[torch.Tensor], wanted: list[torch.Tensor]) -> list[torch.Tensor]:
    """[T] per indexer call: the device's selection is not the reference's set. The k-th index_select
    call belongs to the k-th CSA attention call (each selects once; both are recorded in order)."""
    return [(got.long().sort(-1).values != want.long().sort(-1).values).any(-1) for got, want in zip(picks, wanted)]


def selection_check(picks: list[torch.Tensor], wanted: list[torch.Tensor], profile) -> Check:
    """The share of the reference's selected entries that the device's sub-layers did not select. At
    a long context a query's top-k boundary always has near-ties, so whole rows are not compared (as
    the short run's op check does); a wrong selection misses most entries."""
    dtype = getattr(torch, profile.compute_dtype)
    chosen = missed = 0
    for got, want in zip(picks, wanted):
        for g, w in zip(got.long().tolist(), want.long().tolist()):
            ref = {i for i in w if i >= 0}
            chosen += len(ref)
            missed += len(ref - set(g))
    share = missed / chosen if chosen else 1.0
    ok = chosen > 0 and len(picks) == len(wanted) and share <= SELECTION_MISMATCH[dtype]
    return Check(f"indexer: selected entries the device missed ({chosen} selected)", f"{share:.2%}",
                 f"<= {SELECTION_MISMATCH[dtype]:.0%}", ok)


def scale_checks(dev: Model, store, context: int) -> list[Check]:
    """Whether the run was long where it matters: Flash's window and ratios, and the entries the
    last step's CSA chose among and HCA attended (the committed length's entries)."""
    cfg = dev.cfg
    ratios = tuple(sorted({layer.ratio for layer in dev.layers if layer.ratio}))
    flash = cfg.sliding_window == FLASH_WINDOW and ratios == FLASH_RATIOS
    checks = [Check("config: sliding window / compress ratios", f"{cfg.sliding_window} / {', '.join(map(str, ratios))}",
                    f"{FLASH_WINDOW} / {', '.join(map(str, FLASH_RATIOS))} (Flash)", flash)]
    live = store.live_rows(0) if store is not None else {}
    for kind, item, label, ratio in (("csa", "index.entries", "CSA: entries the indexer chose among", 4),
                                     ("hca", "comp.entries", "HCA: entries attended", 128)):
        counts = [live[f"layer{layer.index}.{item}"].shape[0] for layer in dev.layers
                  if layer.attention == kind and f"layer{layer.index}.{item}" in live]
        n = min(counts, default=0)
        checks.append(Check(f"{label} at the last step", str(n), f">= {context // ratio} (N/{ratio})",
                            bool(counts) and n >= context // ratio))
    return checks
