"""Reference lightning-indexer selection and sparse attention with sink (DSV4-REFERENCE §3.6-3.9).

A query at position t attends to the raw KV of positions t-W+1..t plus compressed entries: all
complete ones (HCA) or the indexer's top-k among them (CSA); one softmax with the per-head sink
in the denominator. Keys are values (single shared KV head). Scores and softmax run in fp64
and round to fp32, so a query's result does not depend on how many other queries share its
chunk (see backends/cpu/ops/basic.py).
"""
from __future__ import annotations

import torch

from lib import parallel
from lib.batch import Batch


# Entries per block of `index_scores`: a block's [n, Hi, block] fp64 tile fits L2 (4 MiB here),
# but never under 64 entries, where BLAS takes a slower small-matrix path (measured: 32 is 2x slower).
INDEX_TILE_ELEMENTS = 1 << 19
INDEX_MIN_BLOCK = 64


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, *,
                 ratio: int, weight_scale: float) -> torch.Tensor:
    """Indexer scores of one sequence's queries [n, E] (fp64); entries not yet complete are -inf.

    score(t, w) = sum_j weight_scale * weights[t, j] * ReLU(q[t, j] . keys[w]), visible iff
    w < (t + 1) / ratio.
    """
    ws = (weights.double() * weight_scale).unsqueeze(1)                     # [n, 1, Hi]
    q, keys = q.double(), keys.double()
    scores = torch.empty(q.shape[0], keys.shape[0], dtype=torch.float64)    # [n, E]
    # The [n, Hi, E] ReLU'd products are the one tensor that grows with context (E = L / ratio).
    # Made whole, it streams through memory three times (product, ReLU, head contraction) and
    # made prefill superlinear; made one block of entries at a time it stays in cache (2.5-3x
    # faster at 8K-32K tokens, same values: each score is the same length-Di dot and length-Hi sum).
    block = max(INDEX_MIN_BLOCK, INDEX_TILE_ELEMENTS // max(1, q.shape[0] * q.shape[1]))
    for lo in range(0, keys.shape[0], block):
        relu = torch.einsum("thd,ed->the", q, keys[lo:lo + block]).relu_()      # [n, Hi, block]
        scores[:, lo:lo + block] = torch.bmm(ws, relu).squeeze(1)
    visible = torch.arange(keys.shape[0])[None, :] < ((positions + 1) // ratio)[:, None]
    return scores.masked_fill_(~visible, float("-inf"))


def index_select(q: torch.Tensor, weights: torch.Tensor, batch: Batch, keys: list[torch.Tensor], *,
                 topk: int, ratio: int, weight_scale: float, group=None) -> torch.Tensor:
    """Top-k compressed entries per query (§3.8) -> [T, topk] sequence-local entry ids, -1 = none.

    q [T, Hi, Di] indexer queries (RoPE applied); weights [T, Hi] head weights (W_iw h), scaled
    by `weight_scale` = Di^-1/2 * Hi^-1/2; keys[s] [E_s, Di] the sequence's indexer entries.
    """
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int64)
    for seg in batch.segments():
        k = keys[seg.index]
        if k.shape[0] == 0:
            continue
        # this rank's heads only under TP: the masked (-inf) entries stay -inf in the sum
        scores = parallel.all_reduce(index_scores(q[seg.lo:seg.hi], weights[seg.lo:seg.hi], k,
                                                  batch.positions[seg.lo:seg.hi], ratio=ratio,
                                                  weight_scale=weight_scale), group)
        picked = scores.topk(min(topk, k.shape[0]), dim=-1).indices               # [n, k']
        valid = torch.isfinite(torch.gather(scores, 1, picked))
        out[seg.lo:seg.hi, : picked.shape[1]] = torch.where(valid, picked, -1)
    return out


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, batch: Batch, windows: list[torch.Tensor],
                     entries: list[torch.Tensor] | None, selection: torch.Tensor | None,
                     sink: torch.Tensor, *, window: int, ratio: int):
    """Attention over window + compressed entries; returns (o [T, H, D], new windows).

    q [T, H, D] and kv [T, D] with RoPE applied; windows[s] [<=W, D] raw KV of the positions just
    before this step; entries[s] [E_s, D] (None for sliding layers); selection [T, k] from
    `index_select` (CSA) or None (HCA: every complete entry).
    """
    d = q.shape[-1]
    out = torch.empty(q.shape, dtype=torch.float32)
    new_windows = []
    for seg in batch.segments():
        old = windows[seg.index].float()
        keys = torch.cat((old, kv[seg.lo:seg.hi].float()))                       # [nw + n, D]
        key_pos = torch.arange(seg.start - old.shape[0], seg.start + seg.hi - seg.lo)
        pos = batch.positions[seg.lo:seg.hi]
        mask = (key_pos[None, :] <= pos[:, None]) & (key_pos[None, :] > pos[:, None] - window)
        if entries is not None and selection is None:                           # HCA: every complete entry
            comp = entries[seg.index].float()
            visible = torch.arange(comp.shape[0])[None, :] < ((pos + 1) // ratio)[:, None]
            keys = torch.cat((keys, comp))
            mask = torch.cat((mask, visible), dim=1)
        qs, keys = q[seg.lo:seg.hi].double(), keys.double()
        logits = torch.where(mask[:, None, :], torch.einsum("thd,kd->thk", qs, keys) / d ** 0.5, float("-inf"))
        if selection is None:
            o = _softmax_with_sink(logits, sink.double()) @ keys
        else:
            # CSA: score each query's k selected entries only, gathered per query. Scoring every
            # entry and masking all but k would grow a chunk's work with the context (E = L / 4).
            picked, chosen = _selected(entries[seg.index], selection[seg.lo:seg.hi], pos, ratio)
            sel_logits = torch.einsum("thd,tkd->thk", qs, picked) / d ** 0.5    # [n, H, k]
            sel_logits = torch.where(chosen[:, None, :], sel_logits, float("-inf"))
            p = _softmax_with_sink(torch.cat((logits, sel_logits), dim=-1), sink.double())
            o = p[..., : keys.shape[0]] @ keys + torch.einsum("thk,tkd->thd", p[..., keys.shape[0]:], picked)
        out[seg.lo:seg.hi] = o.float()
        new_windows.append(torch.cat((old, kv[seg.lo:seg.hi].float()))[-window:])
    return out, new_windows


def _selected(comp: torch.Tensor, selection: torch.Tensor, pos: torch.Tensor, ratio: int):
    """Each query's selected entries [n, k, D] (fp64) and which of them count [n, k]: a real
    selection (not -1) of an entry already complete at the query's position."""
    if comp.shape[0] == 0:
        none = torch.zeros_like(selection, dtype=torch.bool)
        return torch.zeros(*selection.shape, comp.shape[-1], dtype=torch.float64), none
    ids = selection.clamp(min=0)
    return comp.double()[ids], (selection >= 0) & (ids < ((pos + 1) // ratio)[:, None])


def _softmax_with_sink(logits: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """exp(l) / (sum exp(l) + exp(sink_h)): the sink only enlarges the denominator (§3.6 step 5)."""
    sink = sink[None, :, None]                                                   # [1, H, 1]
    top = torch.maximum(logits.amax(-1, keepdim=True), sink)
    e = torch.exp(logits - top)
    return e / (e.sum(-1, keepdim=True) + torch.exp(sink - top))
