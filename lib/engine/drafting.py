"""DSpark drafting (DSV4-REFERENCE §5.2): context rings, the draft block, Markov and confidence heads.

The numerics of every stage are the backend's generated programs (`draft_context`, `ring_entry`,
`draft` in backends/<name>/_generated/model.py); this module only sequences them. The Markov
stage is host-driven by nature (each position's token is chosen before the next position's bias
exists), so it runs here, in fp32, through a caller-supplied `choose` that applies the request's
sampling rules: the drafter proposes from exactly the distribution verification is told about.

What this module must not know: scheduling, requests. The rings are the paged cache's
(lib/runtime/paged_cache.py): propose reads them through a draft batch's addressing.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from lib.records.batch import Batch, positions_of
from lib.runtime.loaded_model import Model

# choose(logits [S, V] fp32, k) -> (ids [S] int64, probs [S, V] fp32 or None at temperature 0)
Choose = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]]


class DraftBlock(NamedTuple):
    tokens: torch.Tensor             # [S, gamma] int64 drafts x_1..x_gamma for positions L+1..L+gamma
    probs: torch.Tensor | None       # [S, gamma, V] the distribution each draft was drawn from (None: greedy)
    confidence: torch.Tensor         # [S, gamma] raw confidence logits c_k (sigma(c_k) = survival estimate)


METHODS = ("auto", "dspark", "mtp", "none")
ALIASES = {"deepseek_mtp": "mtp"}            # vLLM's name of the method


def speculative_method(model: Model, mode: str) -> str | None:
    """The drafter a speculative mode runs on this checkpoint ("dspark", "mtp" or None), or a clear refusal."""
    mode = ALIASES.get(mode, mode)
    if mode not in METHODS:
        raise ValueError(f"speculative mode '{mode}' is not one of {', '.join(METHODS)} (or deepseek_mtp)")
    kind = model.drafter_kind
    if mode == "none" or (mode == "auto" and kind == "none"):
        return None
    if kind == "none":
        raise ValueError(f"{model.root}: the checkpoint has no drafter (compress_ratios lists only the "
                         f"{model.cfg.num_hidden_layers} backbone layers); use --speculative none")
    if mode != "auto" and mode != kind:
        have = "a DSpark drafter (mtp.0..2)" if kind == "dspark" else "a one-layer MTP drafter (mtp.0)"
        raise ValueError(f"{model.root}: --speculative {mode}, but the checkpoint carries {have}; "
                         f"use --speculative {kind} or none")
    return kind


def drafts_per_round(model: Model, method: str | None, requested: int | None) -> int:
    """Drafts proposed per round: DSpark's block size (or fewer), an MTP layer's chain length (default 1)."""
    if method is None:
        return 0
    if requested is not None and requested < 1:
        raise ValueError(f"--num-speculative-tokens must be at least 1, got {requested}")
    if method == "mtp":
        return requested or 1
    block = block_size(model)
    if requested is not None and requested > block:
        raise ValueError(f"--num-speculative-tokens {requested}: the DSpark drafter proposes a block of {block}")
    return requested or block


# the Markov head's (W1, W2) by model generation: V4.1's checkpoint names them embed and head (V41-REFERENCE §5)
MARKOV_KEYS = {"deepseek_v4": ("markov_w1", "markov_w2"), "deepseek_v41": ("embed", "head")}


def _generation(model: Model) -> str:
    """The suffix of a model generation's own drafter programs (spec/graph.yaml: ring_entry_v41, draft_v41)."""
    return "_v41" if model.cfg.model_type == "deepseek_v41" else ""


def block_size(model: Model) -> int:
    return model.cfg.dspark_block_size


def _positions_batch(positions: torch.Tensor) -> Batch:
    """A one-sequence batch record that only carries positions (the ring-entry RoPE reads them)."""
    n = positions.shape[0]
    return Batch(torch.zeros(n, dtype=torch.int64), positions, (n,), (0,))


def context_rows(model: Model, hidden: torch.Tensor, positions: torch.Tensor) -> list[torch.Tensor]:
    """Ring rows kappa_s(main_x(p), p) for committed positions: one [n, head_dim] per stage.

    hidden [n, k*d] main_hidden of those positions (the target forward's taps), positions [n]."""
    mod, params, cfg = model.module, model.params, model.cfg
    ring_entry = getattr(mod, "ring_entry" + _generation(model))
    with torch.inference_mode():
        main_x = mod.draft_context(params, hidden, cfg, model.rope)
        batch = _positions_batch(positions)
        return [ring_entry(lp, main_x, batch, layer, cfg, model.rope).to(model.state_dtype)
                for layer, lp in zip(model.stages, params.drafter)]


def propose(model: Model, anchors: list[int], store, seq_ids: list, choose: Choose) -> DraftBlock:
    """Draft gamma tokens after each sequence's anchor.

    anchors[s]: the token sampled for position L_s (the sequence's committed length in `store`),
    not yet seen by the target; `store`: the paged cache whose drafter rings hold each stage's rows
    of committed positions [L - W, L)."""
    cfg, gamma = model.cfg, block_size(model)
    noise = cfg.dspark_noise_token_id          # from the config, never 0 (B15)
    starts = [store.length(s) for s in seq_ids]
    tokens = torch.tensor([t for a in anchors for t in [a] + [noise] * (gamma - 1)], dtype=torch.int64)
    batch = store.ring_address(seq_ids, Batch(tokens, positions_of((gamma,) * len(anchors), starts),
                                              (gamma,) * len(anchors), tuple(starts)))
    with torch.inference_mode():
        base, y = getattr(model.module, "draft" + _generation(model))(model.params, batch, store.rings, cfg, model.rope)
    return _markov(model, base.float().unflatten(0, (len(anchors), gamma)),
                   y.float().unflatten(0, (len(anchors), gamma)), torch.tensor(anchors), choose)


def _markov(model: Model, base: torch.Tensor, y: torch.Tensor, anchors: torch.Tensor, choose: Choose) -> DraftBlock:
    """Sequential Markov head, left to right from x_0 = anchor (§5.2):
    e_k = W1[x_{k-1}], l_k = U_k + W2 e_k, x_k ~ choose(l_k), c_k = w_c . [y_k ; e_k].

    base [S, gamma, V] logits U, y [S, gamma, d] pre-norm reduced states."""
    last = model.params.drafter[-1]
    w1, w2 = (last[f"markov_head.{k}.weight"].float() for k in MARKOV_KEYS[model.cfg.model_type])     # [V, r] each
    wc = last["confidence_head.proj.weight"].float()[0]         # [d + r]
    prev, ids, probs, conf = anchors, [], [], []
    for k in range(base.shape[1]):
        e = w1.index_select(0, prev)                             # [S, r]
        logits = base[:, k] + e @ w2.t()                         # [S, V]
        prev, p = choose(logits, k)
        ids.append(prev)
        probs.append(p)
        conf.append(torch.cat((y[:, k], e), dim=-1) @ wc)
    stacked = None if probs[0] is None else torch.stack(probs, dim=1)
    return DraftBlock(torch.stack(ids, dim=1), stacked, torch.stack(conf, dim=1))
