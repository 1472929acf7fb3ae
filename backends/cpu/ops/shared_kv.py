"""Reference of DeepSeek-V4.1's compressed KV shared across layers, over paged state (V41-REFERENCE §3.4-3.7).

Only the KV-source layers compress: from each pooled group (ratio 2: the pair softmax-gated per channel, no
`ape`; ratio 1: the token's own projection) `latent_compress` writes the main entry and the index key into the
source's pools, which the layers after it read as their own `cache.comp` / `cache.index` (the runtime hands a
reusing layer its source's pools: lib/runtime/paged_cache.py). An index source scores the latest source's keys
and passes its selection (and the candidate source its candidate blocks) on to the layers after it, through
the generated forward's loop. Prefill in any chunking equals one long prefill: a ratio-2 group split by a
chunk pools its first row from the source's ring, as V4's compressors do (backends/cpu/ops/compressor.py).
"""
from __future__ import annotations

import torch

from backends.cpu.ops import indexer
from backends.cpu.ops.basic import wide
from backends.cpu.ops.candidates import kept_entries
from backends.cpu.ops.compressor import store_rows, window_rows
from backends.cpu.ops.latent_entries import latent_entries
from lib.distributed import process_group as parallel
from lib.records.batch import Batch
from lib.records.decode_state import CompressorPools


def latent_compress(h: torch.Tensor, batch: Batch, pools: CompressorPools, keys: CompressorPools, wkv: torch.Tensor,
                    wgate: torch.Tensor | None, norm: torch.Tensor, wk: torch.Tensor, k_norm: torch.Tensor, *,
                    ratio: int, eps: float, angles, rope_dim: int) -> tuple[CompressorPools, CompressorPools]:
    """h [T, d] -> (pools, keys) with the entries this step completes written: wkv / wgate [Dc, d] (no wgate at
    ratio 1), norm [Dc], wk [Di, Dc], k_norm [Di]; the entries rotated at j * r (angles.entries[ratio])."""
    a_all = (h.to(wide.dtype) @ wkv.to(wide.dtype).t()).float()                                   # [T, Dc]
    writes = batch.state.writes[ratio]
    if wgate is None:                         # ratio 1: every token completes its own entry
        if ratio != 1:
            raise ValueError(f"latent_compress: a ratio-{ratio} source needs its gate (wgate)")
        pooled = a_all.index_select(0, writes.rows)
    else:
        z_all = (h.to(wide.dtype) @ wgate.to(wide.dtype).t()).float()
        kv, gate, valid = window_rows(a_all, z_all, batch, pools, ratio=ratio, overlap=False)
        g = gate.to(wide.dtype).masked_fill(~valid[:, :, None], float("-inf"))
        pooled = (torch.softmax(g, dim=1) * kv.to(wide.dtype).masked_fill(~valid[:, :, None], 0)).sum(dim=1).float()
        store_rows(a_all, z_all, batch, pools)
    main, key = latent_entries(pooled, norm, wk, k_norm, angles.entries[ratio], rope_dim, eps)
    pools.entries.index_copy_(0, writes.slots, main.to(pools.entries.dtype))
    keys.entries.index_copy_(0, writes.slots, key.to(keys.entries.dtype))
    return pools, keys


def index_start(batch: Batch) -> tuple[None, None]:
    """Before layer 0: no selection and no candidate blocks."""
    return None, None


def shared_index_select(q: torch.Tensor, weights: torch.Tensor, batch: Batch, keys: torch.Tensor,
                        candidates: torch.Tensor | None, *, topk: int, ratio: int, weight_scale: float,
                        candidate_source: bool, block: int | None, topk_blocks: int | None, group=None):
    """-> (selection [T, topk] int64 sequence-local entry ids, ascending, -1 = none; candidates [T, N] bool or None,
    N the batch's most entries).

    q [T, Hi, Di] (rotated, FP4-simulated), weights [T, Hi] unscaled, keys the latest source's key pool. The entries
    are scored one tile at a time with a running top-k, as V4's indexer (indexer.select: lower ids first at a tie),
    so a query's scores are never all held: a tile is whole candidate blocks, whose best scores the candidate
    source keeps ([T, blocks]) to choose its blocks after the last tile, and a reindex layer scores only inside
    the kept blocks (its own top-k then; the candidate source's own top-k uses every score)."""
    q, weights = parallel.gather_heads(q, weights, group)
    addr, t = batch.state, q.shape[0]
    total, limit = addr.max_entries[ratio], (batch.positions + 1) // ratio                 # visible ids < limit
    ws = weights.to(wide.dtype) * weight_scale
    n = indexer.block_size(t, q.shape[1], q.shape[2])
    if candidate_source or candidates is not None:
        n = -(-n // block) * block                                      # whole candidate blocks per tile
    if candidates is not None and not candidate_source:
        candidates = torch.nn.functional.pad(candidates, (0, -total % n))         # False past the last entry
    best, best_ids = indexer.empty_selection(t, topk)
    maxima = []
    for lo in range(0, total, n):
        ids = torch.arange(lo, lo + n, dtype=torch.int64)
        scores = indexer.block_scores(q, ws, indexer._keys(addr, keys, ratio, ids))
        scores = scores.masked_fill_(ids[None, :] >= limit[:, None], float("-inf"))
        if candidate_source:
            maxima.append(scores.view(t, n // block, block).amax(-1))
        elif candidates is not None:
            scores = scores.masked_fill_(~candidates[:, lo:lo + n], float("-inf"))
        best, best_ids = indexer.merge_top(best, best_ids, scores, ids.expand(t, n), topk)
    if candidate_source:
        best_blocks = torch.cat(maxima, dim=1) if maxima else torch.zeros(t, 0, dtype=wide.dtype)
        candidates = kept_entries(best_blocks, limit, block, topk_blocks, total)
    elif candidates is not None:
        candidates = candidates[:, :total]
    return indexer.selected_ids(best, best_ids), candidates
