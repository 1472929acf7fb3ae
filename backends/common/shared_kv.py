"""DeepSeek-V4.1's shared compressed KV as device composites (V41-REFERENCE §3.4-3.9; the reference:
backends/cpu/ops/shared_kv.py, latent_entries.py, candidates.py).

No vllm-ascend or torch_npu kernel implements V4.1's ratio-2 / ratio-1 compressor, its latent indexer or the
two-level candidate selection (the fused compressor, indexer and attention accept ratios 4 and 128 only:
backends/ascend910/profile.yaml `fused` limits), so every backend runs these composites: fp32 pooling, norms,
scores and gates, the cache formats simulated on the values (lib/quant/kv_simulation.py, no read-back), int32
ids and float sort keys (L13), fixed-shape ops only (L12). The indexer scores one tile of entries at a time
(attention.index_block), so memory does not grow with the context: the candidate source keeps each tile's
block maxima, [T, blocks], not the [T, entries] scores the reference holds; the kept blocks go on as [T, entries]
bool, the reference's layout.
"""
from __future__ import annotations

import torch

from backends.common import dense
from backends.common.attention import block_ids, index_block, pool_groups
from backends.common.rope import rope
from lib.distributed import process_group as parallel
from lib.emulation import invariant_matmul as invariant
from lib.emulation.invariant_matmul import matmul
from lib.quant.kv_simulation import fp4_index, fp4_main, simulated
from lib.records.batch import Batch
from lib.records.decode_state import CompressorPools

_NO_ID = float(2 ** 24)     # the sort key of an empty selection slot: above every entry id


def simulate_format(x, format: str):
    """The graph's `simulate_format`: the reference's own rounding (lib/quant/kv_simulation.py, which reads no value
    back to the host) on the device's tensors, fp32 inside, x's dtype out."""
    return simulated(format)(x)


def latent_compress(h, batch: Batch, pools: CompressorPools, keys: CompressorPools, wkv, wgate, norm, wk, k_norm, *,
                    ratio: int, eps: float, angles, rope_dim: int, rms=dense.rms):
    """h [T, d] -> (pools, keys) with the entries this step completes written (main entries and index keys).

    Ratio 2: K | G [T, 2Dc] side by side as the ring holds them (one GEMM where the profile merges wkv and wgate),
    pooled by attention.pool_groups (no ape, no overlap); ratio 1: each token's own K row. The projections are
    fp32 products, as the fused V4 compressor keeps its A | Z state rows in fp32. From the pooled latent: the main
    entry RMS-normalised, rotated at j * r, FP4-simulated in blocks of 16; the index key W_k on the normalised
    latent before its rotation, k_norm, rotated, FP4-simulated in blocks of 32."""
    x = h.float()
    writes = batch.state.writes[ratio]
    if ratio == 1:                           # every token completes its own entry; no gate
        if wgate is not None:
            raise ValueError("latent_compress: a ratio-1 KV source has no gate; wgate was given")
        pooled = matmul(x, wkv.float().t()).index_select(0, writes.rows)            # [K, Dc]
    else:                                    # wgate None: wkv holds K's rows then G's (merged_weights, halves)
        az = matmul(x, wkv.float().t()) if wgate is None else \
            torch.cat((matmul(x, wkv.float().t()), matmul(x, wgate.float().t())), dim=-1)
        pooled = pool_groups(az, batch, pools, ratio=ratio, overlap=False)
    latent = rms(pooled, norm.float(), eps)                                         # fp32, pre-RoPE: W_k reads it
    projected = matmul(latent.to(wk.dtype), wk.t()).float()
    key = fp4_index(rope(rms(projected, k_norm.float(), eps), angles.entries[ratio], rope_dim))
    main = fp4_main(rope(latent, angles.entries[ratio], rope_dim))
    pools.entries.index_copy_(0, writes.slots, main.to(pools.entries.dtype))
    keys.entries.index_copy_(0, writes.slots, key.to(keys.entries.dtype))
    return pools, keys


def index_start(batch: Batch) -> tuple[None, None]:
    """Before layer 0: no selection and no candidate blocks."""
    return None, None


def shared_index_select(q, weights, batch: Batch, keys, candidates, *, topk: int, ratio: int, weight_scale: float,
                        candidate_source: bool, block: int | None, topk_blocks: int | None, group=None):
    """-> (selection [T, topk] int32 sequence-local entry ids, ascending, -1 = none; candidates [T, N] bool, True at
    the entries of the kept blocks (N: the batch's most entries, the reference's layout), or None).

    score(t, j) = sum_h w_th relu(q_th . k_j), visible iff j < limit_t, one tile of entries at a time with a
    running top-k by a stable sort, so that at a tie the lower id wins, as in the reference: V4.1's FP4-simulated
    queries and keys tie often (a score is exactly 0 wherever ReLU zeroes every head), and which of the tied
    entries a query reads changes its output by far more than the device's rounding does. A tile is whole
    candidate blocks, so the candidate source keeps each block's best score as it goes and chooses the blocks after
    the last tile (the newest visible block always kept); a reindex layer masks each tile by the kept blocks."""
    q, weights = parallel.gather_heads(q, weights, group)
    addr, t = batch.state, q.shape[0]
    limit = addr.step(("limit", ratio))                                          # [T] int32 entries readable
    ws = weights.float() * weight_scale
    n = index_block(t, q.shape[1], q.shape[2])
    if candidate_source or candidates is not None:
        n = -(-n // block) * block                                              # whole candidate blocks per tile
    # the running top-k starts empty (float sort keys, L13): constants of the step's shapes, made once
    best = dense.leading(("index best", topk, str(q.device)), t,
                         lambda rows: torch.full((rows, topk), float("-inf"), device=q.device))
    best_ids = dense.leading(("index best ids", topk, str(q.device)), t,
                             lambda rows: torch.full((rows, topk), -1.0, device=q.device))
    block_best, total = [], addr.max_entries[ratio]
    if candidates is not None and not candidate_source:                         # whole tiles: False past the last
        candidates = torch.nn.functional.pad(candidates, (0, -total % n))
    for lo in range(0, total, n):
        ids, float_ids = block_ids(lo, n, q.device)
        rows = addr.entry_block(ratio, lo, n).reshape(-1)
        k = keys.index_select(0, rows).view(t, n, -1).float()                   # [T, n, Di]
        dots = invariant.bmm(q.float(), k.transpose(1, 2))                        # [T, Hi, n]
        scores = (ws.unsqueeze(-1) * torch.relu(dots)).sum(1)
        scores = torch.where(ids[None, :] < limit[:, None], scores, float("-inf"))
        if candidate_source:
            block_best.append(scores.view(t, n // block, block).amax(-1))
        elif candidates is not None:
            scores = torch.where(candidates[:, lo:lo + n], scores, float("-inf"))
        top = torch.sort(torch.cat((best, scores), 1), dim=-1, descending=True, stable=True)
        best = top.values[:, :topk]
        best_ids = torch.gather(torch.cat((best_ids, float_ids.expand(t, n)), 1), 1, top.indices[:, :topk])
    if candidate_source:
        candidates = _kept_blocks(block_best, limit, block, topk_blocks, t, q.device)
        candidates = candidates.repeat_interleave(block, dim=1)[:, :total]
    elif candidates is not None:
        candidates = candidates[:, :total]
    order = torch.where(torch.isfinite(best), best_ids, _NO_ID).sort(dim=-1).values
    return torch.where(order == _NO_ID, -1.0, order).to(torch.int32), candidates


def _kept_blocks(block_best: list, limit, block: int, topk_blocks: int, t: int, device) -> torch.Tensor:
    """[T, blocks] bool: the best topk_blocks blocks by their best score whose score is finite, the block holding the
    newest visible entry always (its score set to +inf first)."""
    if not block_best:                                            # no entry complete yet: nothing to keep
        return torch.zeros(t, 0, dtype=torch.bool, device=device)
    best = torch.cat(block_best, 1)                                              # [T, blocks]
    newest = ((limit.to(torch.int64) - 1).clamp(min=0) // block).clamp(max=best.shape[1] - 1)
    forced = torch.where(limit > 0, float("inf"), float("-inf")).unsqueeze(1)
    best = best.scatter(1, newest.unsqueeze(1), forced)
    top = torch.sort(best, dim=-1, descending=True, stable=True)                  # at a tie the lower block first
    k = min(topk_blocks, best.shape[1])
    return torch.zeros_like(best, dtype=torch.bool).scatter(1, top.indices[:, :k], top.values[:, :k] > float("-inf"))
