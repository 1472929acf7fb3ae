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
from backends.cpu.ops.candidates import candidate_mask, reindex_scores
from backends.cpu.ops.compressor import store_rows, window_rows
from backends.cpu.ops.latent_entries import latent_entries
from lib.distributed import process_group as parallel
from lib.records.batch import Batch
from lib.records.decode_state import CompressorPools

_NONE = torch.iinfo(torch.int64).max


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
    """-> (selection [T, topk] int64 sequence-local entry ids, ascending, -1 = none; candidates [T, N] bool or None).

    q [T, Hi, Di] (rotated, FP4-simulated), weights [T, Hi] unscaled, keys the latest source's key pool. Every
    query's scores over every entry its sequence has (N: the batch's most) are held at once: the candidate
    blocks need all of them."""
    q, weights = parallel.gather_heads(q, weights, group)
    scores = indexer.all_scores(q, weights, batch, keys, ratio=ratio, weight_scale=weight_scale)     # [T, N], -inf
    if candidate_source:
        candidates = candidate_mask(scores, (batch.positions + 1) // ratio, block, topk_blocks)
    elif candidates is not None:
        scores = reindex_scores(scores, candidates)
    k = min(topk, scores.shape[1])
    best = torch.sort(scores, dim=1, descending=True, stable=True)        # at a tie the lower id first
    ids = torch.where(torch.isfinite(best.values[:, :k]), best.indices[:, :k], _NONE).sort(dim=1).values
    ids = torch.where(ids == _NONE, -1, ids)
    if k < topk:
        ids = torch.nn.functional.pad(ids, (0, topk - k), value=-1)
    return ids, candidates
