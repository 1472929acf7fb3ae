"""Compressor, lightning indexer and sparse sink attention as device composites (L10) over paged state.

Same equations and the same addressing as the reference (backends/cpu/ops), with device numerics:
fp32 pooling, scores and softmax, KV and compressed entries in the compute dtype, int32 positions
and float sort keys (L13), and only fixed-shape ops — gathers by computed rows and index_copy_
scatters, never boolean indexing or index_put (L12). The whole batch goes through each op at once
(rows of every sequence addressed through batch.state), so launches do not grow with the batch, and
the rows a step reads and writes are built once per step on the host (Addressing.step), not per layer.
"""
from __future__ import annotations

import torch

from backends.common import dense
from backends.common.rope import rope
from lib.distributed import process_group as parallel
from lib.emulation import invariant_matmul as invariant
from lib.emulation.invariant_matmul import matmul
from lib.records.batch import Batch
from lib.records.decode_state import CompressorPools

# Entries attended per HCA block (a running softmax across blocks) and the tile budget of one
# indexer block: memory per step whatever the context. Every block has its full width (entries
# past the sequence's masked), so a step's temporaries have the same shapes at any context: a
# block that grew with the context grew the peak and fragmented the emulation's host heap, and a
# device graph would be captured again at every new width.
HCA_BLOCK = 256
INDEX_TILE_BYTES = 1 << 25


def index_block(queries: int, heads: int, dim: int) -> int:
    """Entries per indexer block: at most INDEX_TILE_BYTES of fp32 keys [T, n, Di], products
    [T, Hi, n] and the keys repeated per head that the batch-invariant CPU bmm makes
    (lib/emulation/invariant_matmul.py); 16..1024."""
    return max(16, min(1024, INDEX_TILE_BYTES // max(1, queries * (heads * dim + heads + dim) * 4)))


def compress(h, batch: Batch, pools: CompressorPools, wkv, wgate, ape, norm, *, ratio: int,
             overlap: bool, eps: float, angles, rope_dim: int, rms=dense.rms) -> CompressorPools:
    """h [T, d] -> the same pools with this step's entries (fp32 pooling, stored in the pool's
    dtype) and projection rows (fp32) written; `angles`: the step's RoPE of this table, whose entries
    of `ratio` rotate the completed entries at m * e. `wgate` None: wkv holds both projections, A's
    rows then Z's (profile merged_weights, halves), one GEMM.

    A step's rows A | Z [T, 2C] sit side by side as the state pool holds them, so the pooled positions
    are one gather from the pool's rows and the step's, and the step's rows one write."""
    addr = batch.state
    slot = addr.step(("phase", ratio))                                          # [T] int32 position mod m
    x = h.to(wkv.dtype)
    if wgate is None:
        az = matmul(x, wkv.t()).float()                                         # [T, 2C] A | Z
        az[:, az.shape[-1] // 2:] += ape.float().index_select(0, slot)
    else:
        z = matmul(x, wgate.t()).float() + ape.float().index_select(0, slot)
        az = torch.cat((matmul(x, wkv.t()).float(), z), dim=-1)
    new = pool_groups(az, batch, pools, ratio=ratio, overlap=overlap)              # [K, Dc] fp32
    new = rms(new, norm.float(), eps)                                           # fp32
    entries = rope(new, angles.entries[ratio], rope_dim)                        # at m * e
    pools.entries.index_copy_(0, addr.writes[ratio].slots, entries.to(pools.entries.dtype))
    return pools


def pool_groups(az, batch: Batch, pools: CompressorPools, *, ratio: int, overlap: bool) -> torch.Tensor:
    """The step's rows A | Z [T, 2C] (fp32) -> the entries it completes pooled, [K, Dc] fp32 (softmax of Z over each
    entry's positions per channel, `overlap`: window e-1's first half and window e's second), and the step's rows
    written into the ring after every read of it. The pooled positions are one gather from the ring's rows and
    the step's."""
    addr = batch.state
    c, ring = az.shape[-1] // 2, pools.state.shape[1]
    span = 2 * ratio if overlap else ratio
    q = addr.step(("span_pos", ratio, span))                                   # [K, S] positions pooled
    src = addr.step(("span", ratio, span, ring)).reshape(-1)
    rows = pools.state[1:].view(-1, 2 * c)                                      # the sequence slots' ring rows
    pooled = torch.cat((rows, az)).index_select(0, src).view(*q.shape, 2 * c)
    kv, gate = pooled[..., :c], pooled[..., c:]
    if overlap:
        dc = c // 2
        kv = torch.cat((kv[:, :ratio, :dc], kv[:, ratio:, dc:]), dim=1)
        gate = torch.cat((gate[:, :ratio, :dc], gate[:, ratio:, dc:]), dim=1)
    valid = addr.step(("span_valid", ratio, span))[:, :, None]                 # pooled positions that exist
    weights = torch.softmax(torch.where(valid, gate, float("-inf")), dim=1)
    new = (weights * torch.where(valid, kv, 0.0)).sum(dim=1)                    # [K, Dc]
    rows.index_copy_(0, addr.step(("ring", ring)), az)
    return new


def compressed_entries(pools: CompressorPools):
    return pools.entries


def index_select(q, weights, batch: Batch, keys, *, topk: int, ratio: int, weight_scale: float,
                 group=None) -> torch.Tensor:
    """Top-k entries per query -> [T, topk] int32 sequence-local ids (selected first, ascending),
    -1 = none; fp32 scores, keys read from the pool one block of entries at a time.

    Under TP each rank holds Hi/tp heads of q [T, Hi/tp, Di] and weights [T, Hi/tp]. They are
    gathered, not the scores: summed per rank and all-reduced, the fp32 head sum would be grouped
    by TP size and could flip a near-tie at the top-k boundary, while every rank summing all heads
    in one process's order selects exactly what one process selects."""
    q, weights = parallel.gather_heads(q, weights, group)
    addr, t = batch.state, q.shape[0]
    limit = addr.step(("limit", ratio))                                          # [T] int32 entries readable
    ws = weights.float() * weight_scale
    # the running top-k starts empty; these and each block's ids are constants of the step's shapes, made once
    best = dense.leading(("index best", topk, str(q.device)), t,
                         lambda rows: torch.full((rows, topk), float("-inf"), device=q.device))
    best_ids = dense.leading(("index best ids", topk, str(q.device)), t,                    # float sort keys (L13)
                             lambda rows: torch.full((rows, topk), -1.0, device=q.device))
    n = index_block(t, q.shape[1], q.shape[2])                                  # every block full width
    for lo in range(0, addr.max_entries[ratio], n):
        ids, float_ids = block_ids(lo, n, q.device)
        rows = addr.entry_block(ratio, lo, n).reshape(-1)
        k = keys.index_select(0, rows).view(t, n, -1).float()                   # [T, n, Di]
        dots = invariant.bmm(q.float(), k.transpose(1, 2))                        # [T, Hi, n]
        scores = (ws.unsqueeze(-1) * torch.relu(dots)).sum(1)
        scores = torch.where(ids[None, :] < limit[:, None], scores, float("-inf"))
        cand, cand_ids = torch.cat((best, scores), 1), torch.cat((best_ids, float_ids.expand(t, n)), 1)
        top = cand.topk(topk, dim=-1)
        best, best_ids = top.values, torch.gather(cand_ids, 1, top.indices)
    # selected ids first in ascending order, then -1: one layout whatever filled the empty slots
    key = torch.where(torch.isfinite(best), best_ids, float(2 ** 24))
    order = key.sort(dim=-1).values
    return torch.where(order == float(2 ** 24), -1.0, order).to(torch.int32)


def block_ids(lo: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The entry ids lo .. lo + n - 1 of a block, int32 and as float sort keys: constants of the block."""
    return dense.arange(lo + n, torch.int32, device)[lo:], dense.arange(lo + n, torch.float32, device)[lo:]


def sparse_attention(q, kv, batch: Batch, windows, entries, selection, sink, *, window: int, ratio: int):
    """Window + compressed entries + sink, fp32 softmax; o in kv's dtype, the window pool written.

    Every query gets its own key rows in one canonical layout: slot k of its W window slots holds
    position t-W+1+k (slots before position 0 masked), then its entries (CSA: the selected rows;
    HCA: every entry, a fixed-size block at a time under a running softmax). A query's sums
    therefore run over the same operands in the same order whether it is decoded alone or
    verified with five drafts after it: batch invariance, which lossless speculative decoding
    needs, holds by construction."""
    addr, d, t = batch.state, q.shape[-1], q.shape[0]
    src = addr.step(("window", window, windows.shape[1])).reshape(-1)           # slot k: position t-W+1+k
    keys = torch.cat((windows.view(-1, d).to(kv.dtype), kv)).index_select(0, src).view(t, window, d)
    mask = addr.step(("window_mask", window))
    if entries is not None and selection is not None:
        limit = addr.step(("limit", ratio))
        sel = selection.to(torch.int64)
        rows = addr.entry_rows_of(ratio, sel).reshape(-1)
        keys = torch.cat((keys, entries.index_select(0, rows).view(*sel.shape, d).to(kv.dtype)), dim=1)
        mask = torch.cat((mask, (selection >= 0) & (selection < limit[:, None])), dim=1)
    qf, kf = q.float(), keys.float()
    logits = torch.where(mask[:, None, :], invariant.bmm(qf, kf.transpose(1, 2)) / d ** 0.5, float("-inf"))
    sk = sink.float()[None, :, None]
    top = torch.maximum(logits.amax(-1, keepdim=True), sk)
    e = torch.exp(logits - top)
    total, acc = e.sum(-1, keepdim=True), invariant.bmm(e, kf)
    if entries is not None and selection is None:
        limit = addr.step(("limit", ratio))
        for lo in range(0, addr.max_entries[ratio], HCA_BLOCK):
            ids, _ = block_ids(lo, HCA_BLOCK, q.device)
            rows = addr.entry_block(ratio, lo, HCA_BLOCK).reshape(-1)
            block = entries.index_select(0, rows).view(t, ids.shape[0], d).to(kv.dtype).float()
            lg = torch.where((ids[None, :] < limit[:, None])[:, None, :],
                             invariant.bmm(qf, block.transpose(1, 2)) / d ** 0.5, float("-inf"))
            new_top = torch.maximum(top, lg.amax(-1, keepdim=True))
            shrink, e = torch.exp(top - new_top), torch.exp(lg - new_top)
            total = total * shrink + e.sum(-1, keepdim=True)
            acc = acc * shrink + invariant.bmm(e, block)
            top = new_top
    out = (acc / (total + torch.exp(sk - top))).to(kv.dtype)                       # [T, H, D]
    rows = addr.step(("ring", windows.shape[1]))
    windows.view(-1, d).index_copy_(0, rows, kv.to(windows.dtype))
    return out, windows
