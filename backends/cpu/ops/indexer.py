"""Reference lightning-indexer selection (DSV4-REFERENCE §3.8) over keys in block pools.

score(t, w) = sum_j weight_scale * weights[t, j] * ReLU(q[t, j] . keys[w]) in fp64, visible iff
w < (t + 1) / ratio. The keys are read from the pool block by block of entries (`block_size`
ids of every batch sequence at once, through its block table) and the top-k is kept as a running
selection, so memory does not grow with the context: [T, k + block] scores at any length. The
selection is a set in ascending entry id; at a tie on the k-th score the lower ids are taken
(ties are real: a score is exactly 0 wherever ReLU zeroes every head), so it does not depend on
the block size or on which other queries share the batch.
"""
from __future__ import annotations

import torch

from backends.cpu.ops.basic import gather_rows, wide

from lib.records.batch import Batch

# Entries scored per block: the [T, block, Di] keys and [T, Hi, block] products of a block stay
# within INDEX_TILE_BYTES (a prefill chunk takes fewer entries per block than a decode batch), and
# the running top-k sorts k + block candidates per query. 16 MiB: at 32 MiB a 512-token chunk's
# fp64 products are 6.4 MiB per block, and such blocks kept missing the holes the chunk before left
# in the host heap, which grew over a long prefill; narrower blocks cost longer sorts per entry.
INDEX_TILE_BYTES = 1 << 24
INDEX_MIN_BLOCK, INDEX_MAX_BLOCK = 16, 1024
# Every block of a step, the last included, is as wide as the others (entries past the sequence's are
# masked), so a step's temporaries take one of a few shapes at any context and memory is flat beyond the
# first blocks (a last block that grew with the context made every chunk allocate new sizes, and the heap
# grew). A batch whose longest sequence has fewer entries than a block holds takes the next power of two
# instead (at least INDEX_MIN_BLOCK): a short context does not score a thousand masked entries per query,
# and the widths a step can take stay a handful.


def block_size(queries: int, heads: int, dim: int, itemsize: int = 8) -> int:
    per_entry = queries * (heads + dim) * itemsize
    return max(INDEX_MIN_BLOCK, min(INDEX_MAX_BLOCK, INDEX_TILE_BYTES // max(1, per_entry)))


def block_width(entries: int, widest: int) -> int:
    """Entries per block for a batch whose longest sequence has `entries`: `widest`, or the power of two
    (at least INDEX_MIN_BLOCK) that holds them all when that is narrower. A query's scores and selection do
    not depend on it: every entry is scored on its own and the running top-k keeps lower ids at a tie."""
    return min(widest, max(INDEX_MIN_BLOCK, 1 << max(entries - 1, 0).bit_length()))


def block_scores(q: torch.Tensor, ws: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """fp64 scores [T, B] of queries q [T, Hi, Di] against their own keys [T, B, Di], or keys [B, Di]
    all of them share (a batch of one sequence: one GEMM instead of T small ones); ws [T, Hi]."""
    spec = "thd,bd->thb" if keys.dim() == 2 else "thd,tbd->thb"
    relu = torch.einsum(spec, q.to(wide.dtype), keys.to(wide.dtype)).relu_()                       # [T, Hi, B]
    return torch.bmm(ws.to(wide.dtype).unsqueeze(1), relu).squeeze(1)                        # [T, B]


def _keys(addr, keys: torch.Tensor, ratio: int, ids: torch.Tensor) -> torch.Tensor:
    """Keys of entries ids [B] for every query: [B, Di] when the batch is one sequence (its queries
    share them; a shape fact, no sync), else [T, B, Di] through each query's block table."""
    t, n = addr.row_seq.shape[0], ids.shape[0]
    if addr.seq_slot.shape[0] == 1:
        return gather_rows(keys, addr.entry_rows(ratio, torch.zeros_like(ids), ids))
    rows = addr.entry_rows(ratio, addr.row_seq[:, None].expand(t, n).reshape(-1), ids.repeat(t)).view(t, n)
    return gather_rows(keys, rows)


def merge_top(best_scores: torch.Tensor, best_ids: torch.Tensor, scores: torch.Tensor, ids: torch.Tensor,
              k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best of a running selection, kept in (score descending, id ascending) order, and a block of
    later entries (ascending ids, all above the selection's), returned in that order. One stable sort
    keeps it: the selection comes first and the block after, so equal scores stay in ascending id
    (lower ids first at a tie); the caller puts the final selection in id order once."""
    all_scores, all_ids = torch.cat((best_scores, scores), dim=1), torch.cat((best_ids, ids), dim=1)
    order = torch.sort(all_scores, dim=1, descending=True, stable=True).indices[:, :k]
    return torch.gather(all_scores, 1, order), torch.gather(all_ids, 1, order)


def all_scores(q: torch.Tensor, weights: torch.Tensor, batch: Batch, keys: torch.Tensor, *, ratio: int,
               weight_scale: float) -> torch.Tensor:
    """Every query's fp64 scores [T, E] against all entries of its sequence (E: the batch's longest),
    -inf where not visible: the whole matrix `select` never holds (checks of its top-k margins)."""
    addr, t = batch.state, q.shape[0]
    n = addr.max_entries[ratio]
    ids = torch.arange(n, dtype=torch.int64)
    scores = block_scores(q, weights.to(wide.dtype) * weight_scale, _keys(addr, keys, ratio, ids))
    return scores.masked_fill_(ids[None, :] >= ((batch.positions + 1) // ratio)[:, None], float("-inf"))


def select(q: torch.Tensor, weights: torch.Tensor, batch: Batch, keys: torch.Tensor, *, topk: int, ratio: int,
           weight_scale: float) -> torch.Tensor:
    """Top-k entries per query -> [T, topk] int64 sequence-local ids in ascending order, -1 = none.

    q [T, Hi, Di] (RoPE applied), weights [T, Hi] (all heads), keys the indexer's entry pool."""
    addr = batch.state
    t = q.shape[0]
    limit = (batch.positions + 1) // ratio                                               # [T]: visible ids < limit
    ws = weights.to(wide.dtype) * weight_scale
    best, best_ids = empty_selection(t, topk)
    n = block_width(addr.max_entries[ratio], block_size(t, q.shape[1], q.shape[2]))      # every block this wide
    for lo in range(0, addr.max_entries[ratio], n):
        ids = torch.arange(lo, lo + n, dtype=torch.int64)
        scores = block_scores(q, ws, _keys(addr, keys, ratio, ids)).masked_fill_(ids[None, :] >= limit[:, None],
                                                                                 float("-inf"))
        best, best_ids = merge_top(best, best_ids, scores, ids.expand(t, n), topk)
    return selected_ids(best, best_ids)


def empty_selection(t: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The running selection of `merge_top` before any block: k empty slots per query, scores -inf [T, k] fp64,
    ids -k..-1 [T, k] (below every real id, in order)."""
    best_ids = (torch.arange(topk, dtype=torch.int64) - topk).expand(t, topk)
    return torch.full((t, topk), float("-inf"), dtype=wide.dtype), best_ids


_NONE = torch.iinfo(torch.int64).max


def selected_ids(best: torch.Tensor, best_ids: torch.Tensor) -> torch.Tensor:
    """A finished running selection -> [T, k] ids: the selected entries first, in ascending id, then -1 padding;
    one layout whatever else the selection held (which unselectable entries filled its empty slots)."""
    order = torch.where(torch.isfinite(best), best_ids, _NONE).sort(dim=1).values
    return torch.where(order == _NONE, -1, order)
