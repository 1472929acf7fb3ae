"""Reference lightning-indexer selection and sparse attention with sink (DSV4-REFERENCE §3.6-3.9).

A query at position t attends to the raw KV of positions t-W+1..t plus compressed entries: all
complete ones (HCA) or the indexer's top-k among them (CSA, gathered: only the selected rows are
read); one softmax with the per-head sink in the denominator. Keys are values (single shared KV
head). Every query gets its own keys in one canonical layout (its W window slots, then its
entries in id order), read from this step's rows or the pools, so its result does not depend on
how many other queries share its batch or chunk. Scores and softmax run in fp64 and round to
fp32 (see backends/cpu/ops/basic.py).
"""
from __future__ import annotations

import torch

from backends.cpu.ops.basic import gather_rows, wide

from backends.cpu.ops import indexer
from lib.distributed import process_group as parallel
from lib.records.batch import Batch

# HCA entries attended per block (a running softmax across blocks): a [T, block, D] gather and
# [T, H, block] logits per step whatever the context length. Every block of a step has one width,
# entries past the sequence's masked: HCA_BLOCK once the batch's longest sequence has that many
# entries, else the power of two that holds them (indexer.block_width), so the shapes are the same
# at 4K as at 256K and the peak memory of a step too (a first block that grew up to 256 entries,
# 32K positions, grew the peak with it), while a short context does not attend 256 masked entries.
HCA_BLOCK = 256
# Query rows attended at a time: a 512-token chunk's [T, W + k, D] fp64 keys were 48 MiB in one
# tensor, and tensors that large kept finding no free hole in the heap the chunk before left, so
# the heap grew over a long prefill; 64 rows hold 6 MiB.
QUERY_TILE = 64


def index_select(q: torch.Tensor, weights: torch.Tensor, batch: Batch, keys: torch.Tensor, *,
                 topk: int, ratio: int, weight_scale: float, group=None) -> torch.Tensor:
    """Top-k compressed entries per query (§3.8) -> [T, topk] sequence-local entry ids, -1 = none.

    q [T, Hi, Di] indexer queries (RoPE applied); weights [T, Hi] head weights (W_iw h), scaled
    by `weight_scale` = Di^-1/2 * Hi^-1/2; keys: the indexer's entry pool."""
    # Under TP every rank gathers all heads and scores them in one process's order, so TP selects
    # exactly what one process selects (partial head sums all-reduced would round differently).
    q, weights = parallel.gather_heads(q, weights, group)
    return indexer.select(q, weights, batch, keys, topk=topk, ratio=ratio, weight_scale=weight_scale)


def window_keys(sources: torch.Tensor, batch: Batch, ring: int, window: int,
                rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
    """The window slots of query rows `rows`: keys [t, W, D] (slot k holds position t-W+1+k) and
    which exist [t, W]; `sources`: the ring pool flat and this step's rows after it (Addressing.sources)."""
    addr = batch.state
    pos = batch.positions[rows, None] - window + 1 + torch.arange(window)              # [t, W]
    src = addr.sources(addr.row_seq[rows, None].expand_as(pos), pos, ring)
    return gather_rows(sources, src), pos >= 0


def _entries(addr, entries: torch.Tensor, ratio: int, ids: torch.Tensor, rows: slice) -> torch.Tensor:
    """Entries ids [n] for query rows `rows`: [n, D] shared when the batch is one sequence (a shape
    fact), else [t, n, D] through each query's block table."""
    seq = addr.row_seq[rows]
    t, n = seq.shape[0], ids.shape[0]
    if addr.seq_slot.shape[0] == 1:
        return gather_rows(entries, addr.entry_rows(ratio, torch.zeros_like(ids), ids))
    rows_of = addr.entry_rows(ratio, seq[:, None].expand(t, n).reshape(-1), ids.repeat(t))
    return gather_rows(entries, rows_of).view(t, n, -1)


def store_window(kv: torch.Tensor, batch: Batch, pool: torch.Tensor) -> torch.Tensor:
    """This step's KV rows into the sequences' window rings (after every read of them)."""
    rows = batch.state.ring_writes(batch.positions, pool.shape[1])
    pool.view(-1, pool.shape[-1]).index_copy_(0, rows, kv.to(pool.dtype))
    return pool


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, batch: Batch, windows: torch.Tensor,
                     entries: torch.Tensor | None, selection: torch.Tensor | None,
                     sink: torch.Tensor, *, window: int, ratio: int):
    """Attention over window + compressed entries; returns (o [T, H, D], the window pool).

    q [T, H, D] and kv [T, D] with RoPE applied; windows: the window ring pool; entries: the
    compressor's entry pool (None for sliding layers); selection [T, k] from `index_select`
    (CSA) or None (HCA: every complete entry, a block at a time with a running softmax, so a
    prefill chunk holds [T, H, block] logits whatever the context length). Queries are attended
    QUERY_TILE rows at a time: each row's result is its own (see the module docstring), and a
    chunk's fp64 keys and logits stay a few MiB instead of [T, W + k, D]."""
    sources = torch.cat((windows.view(-1, windows.shape[-1]).to(kv.dtype), kv))
    tiles = [_attend(q, sources, batch, windows.shape[1], entries, selection, sink, slice(lo, lo + QUERY_TILE),
                     window=window, ratio=ratio) for lo in range(0, q.shape[0], QUERY_TILE)]
    return (tiles[0] if len(tiles) == 1 else torch.cat(tiles)), store_window(kv, batch, windows)


def _attend(q: torch.Tensor, sources: torch.Tensor, batch: Batch, ring: int, entries: torch.Tensor | None,
            selection: torch.Tensor | None, sink: torch.Tensor, rows: slice, *, window: int, ratio: int) -> torch.Tensor:
    """`sparse_attention` of query rows `rows` -> o [t, H, D] fp32 (the pools are only read)."""
    addr, d = batch.state, q.shape[-1]
    keys, mask = window_keys(sources, batch, ring, window, rows)
    keys = keys.to(wide.dtype)
    limit = (batch.positions[rows] + 1) // ratio if ratio else None
    if entries is not None and selection is not None:                   # CSA: the selected rows only
        chosen = selection[rows]
        picked = addr.entry_rows(ratio, addr.row_seq[rows, None].expand_as(chosen).reshape(-1), chosen.reshape(-1))
        picked_keys = gather_rows(entries, picked).view(*chosen.shape, -1).to(wide.dtype)
        keys = torch.cat((keys, picked_keys), dim=1)                                                # [t, W + k, D]
        mask = torch.cat((mask, (chosen >= 0) & (chosen < limit[:, None])), dim=1)
    qd, scale = q[rows].to(wide.dtype), d ** -0.5
    logits = torch.where(mask[:, None, :], torch.einsum("thd,tkd->thk", qd, keys) * scale, float("-inf"))
    sink = sink.to(wide.dtype)[None, :, None]                                          # [1, H, 1]
    top = torch.maximum(logits.amax(-1, keepdim=True), sink)                    # [t, H, 1]
    e = torch.exp(logits - top)
    total, acc = e.sum(-1, keepdim=True), torch.einsum("thk,tkd->thd", e, keys)
    if entries is not None and selection is None:                       # HCA: every complete entry
        width = indexer.block_width(addr.max_entries[ratio], HCA_BLOCK)
        for lo in range(0, addr.max_entries[ratio], width):
            ids = torch.arange(lo, lo + width, dtype=torch.int64)                    # every block this wide, masked
            block = _entries(addr, entries, ratio, ids, rows).to(wide.dtype)                  # [n, D] or [t, n, D]
            spec = ("thd,kd->thk", "thk,kd->thd") if block.dim() == 2 else ("thd,tkd->thk", "thk,tkd->thd")
            lg = torch.where((ids[None, :] < limit[:, None])[:, None, :],
                             torch.einsum(spec[0], qd, block) * scale, float("-inf"))
            new_top = torch.maximum(top, lg.amax(-1, keepdim=True))
            shrink, e = torch.exp(top - new_top), torch.exp(lg - new_top)
            total = total * shrink + e.sum(-1, keepdim=True)
            acc = acc * shrink + torch.einsum(spec[1], e, block)
            top = new_top
    return (acc / (total + torch.exp(sink - top))).float()


def _softmax_with_sink(logits: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """exp(l) / (sum exp(l) + exp(sink_h)): the sink only enlarges the denominator (§3.6 step 5)."""
    sink = sink[None, :, None]                                                   # [1, H, 1]
    top = torch.maximum(logits.amax(-1, keepdim=True), sink)
    e = torch.exp(logits - top)
    return e / (e.sum(-1, keepdim=True) + torch.exp(sink - top))
