"""MTP drafting (DSV4-REFERENCE §5.1): the one-layer drafter of the Flash preview and of V4-Pro,
chained the way vLLM's `deepseek_mtp` method chains it for several speculative tokens.

The layer at position p reads the target's final streams X_p and the next token t_{p+1} and
predicts t_{p+2}; its sliding attention keeps its own window ring (drafter stage 0's pool in the
paged cache). A request's committed positions get their ring rows the next time it drafts, in the
same pass as its first draft: positions [first, L - 1] with their target states and next tokens
(the anchor t_L for L - 1, which the target sampled, so that row is final too), the first draft
read from the last row. Each chained step then feeds the draft just chosen at the next position,
with the layer's own output streams as its X; those ring rows are speculative, sit past every
committed one, and are overwritten when their positions are committed.

The numerics are the backend's generated `mtp_draft` program; this module only sequences it.
What it must not know: scheduling, requests.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from lib.engine.drafting import Choose, DraftBlock
from lib.records.batch import Batch, positions_of
from lib.runtime.loaded_model import Model


class MTPContext(NamedTuple):
    """What one request's draft needs of its target: positions [first, first + n) = [first, L - 1]."""
    first: int
    states: torch.Tensor        # [n, hc_mult, d] the target's final streams X_p of those positions
    next_tokens: list[int]      # [n] t_{p+1}: committed tokens, the anchor last


def context(unwritten: list[tuple[int, torch.Tensor]], tokens: list[int]) -> MTPContext:
    """A request's context from the target states the engine kept of its positions committed since it last
    drafted ((first position, states [n, hc_mult, d]) chunks, contiguous and ending at L - 1) and its tokens
    (committed ones and the anchor: len(tokens) == L + 1)."""
    first = unwritten[0][0]
    states = torch.cat([h for _, h in unwritten])
    return MTPContext(first, states, list(tokens[first + 1: first + 1 + states.shape[0]]))


def propose(model: Model, store, seq_ids: list, contexts: list[MTPContext], steps: int, choose: Choose) -> DraftBlock:
    """`steps` chained drafts after each request's anchor (drafts for positions L + 1 .. L + steps)."""
    mod, params, cfg = model.module, model.params, model.cfg
    lens = tuple(len(c.next_tokens) for c in contexts)
    starts = tuple(c.first for c in contexts)
    tokens = torch.tensor([t for c in contexts for t in c.next_tokens], dtype=torch.int64)
    last = torch.tensor(lens, dtype=torch.int64).cumsum(0) - 1
    batch = store.window_address(seq_ids, Batch(tokens, positions_of(lens, starts), lens, starts, last))
    ids, probs, confidence = [], [], []
    with torch.inference_mode():
        logits, x = mod.mtp_draft(params, torch.cat([c.states for c in contexts]), batch, store.rings, cfg, model.rope)
        x = x.index_select(0, last.to(x.device))
        for k in range(steps):
            chosen, p = choose(logits.float(), k)
            ids.append(chosen)
            probs.append(p)
            confidence.append(_confidence(logits.float(), chosen))
            if k + 1 == steps:
                break
            at = tuple(s + n + k for s, n in zip(starts, lens))       # position L + k: the draft just chosen
            ones = (1,) * len(contexts)
            batch = store.window_address(seq_ids, Batch(chosen.to(torch.int64), torch.tensor(at), ones, at))
            logits, x = mod.mtp_draft(params, x, batch, store.rings, cfg, model.rope)
    stacked = None if probs[0] is None else torch.stack(probs, dim=1)
    return DraftBlock(torch.stack(ids, dim=1), stacked, torch.stack(confidence, dim=1))


def _confidence(logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The layer's own confidence in each draft, as a logit: log p / (1 - p) of the chosen token under its
    softmax (the MTP layer has no confidence head; the engine's draft policy reads sigma of it)."""
    logp = torch.log_softmax(logits, dim=-1).gather(1, chosen.view(-1, 1).to(logits.device))[:, 0]
    return (logp - torch.log1p(-logp.exp().clamp(max=1 - 1e-6))).cpu()
