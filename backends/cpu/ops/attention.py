"""Reference lightning-indexer selection and sparse attention with sink (DSV4-REFERENCE §3.6-3.9).

A query at position t attends to the raw KV of positions t-W+1..t plus compressed entries: all
complete ones (HCA) or the indexer's top-k among them (CSA); one softmax with the per-head sink
in the denominator. Keys are values (single shared KV head). Scores and softmax run in fp64
and round to fp32, so a query's result does not depend on how many other queries share its
chunk (see backends/cpu/ops/basic.py).
"""
from __future__ import annotations

import torch

from backends.cpu.ops import indexer
from backends.cpu.ops.indexer import index_scores
from lib.distributed import process_group as parallel
from lib.records.batch import Batch


def index_select(q: torch.Tensor, weights: torch.Tensor, batch: Batch, keys: list[torch.Tensor], *,
                 topk: int, ratio: int, weight_scale: float, group=None) -> torch.Tensor:
    """Top-k compressed entries per query (§3.8) -> [T, topk] sequence-local entry ids, -1 = none.

    q [T, Hi, Di] indexer queries (RoPE applied); weights [T, Hi] head weights (W_iw h), scaled
    by `weight_scale` = Di^-1/2 * Hi^-1/2; keys[s] [E_s, Di] the sequence's indexer entries.
    """
    # Under TP every rank gathers all heads and scores them in one process's order, so TP selects
    # exactly what one process selects (partial head sums all-reduced would round differently).
    q, weights = parallel.gather_heads(q, weights, group)
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int64)
    for seg in batch.segments():
        k = keys[seg.index]
        if k.shape[0] == 0:
            continue
        args = (q[seg.lo:seg.hi], weights[seg.lo:seg.hi], k, batch.positions[seg.lo:seg.hi])
        if indexer.worth_screening(seg.hi - seg.lo, k.shape[0], topk):       # by shape only: decode never
            picked, valid = indexer.screened_topk(*args, topk=topk, ratio=ratio, weight_scale=weight_scale)
        else:
            picked, valid = indexer.top_entries(index_scores(*args, ratio=ratio, weight_scale=weight_scale),
                                                min(topk, k.shape[0]))                # [n, k']
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
