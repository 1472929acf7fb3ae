"""Expert-parallel dispatch and combine around a backend's own routed-expert compute.

A backend splits its routed experts in two (`Experts`): `rows` computes one output row per
(token, expert) pair for the experts this process holds (zero rows for pairs held elsewhere), and
`combine` makes each token's weighted sum of its k rows, with the device's own combine op. The
exchange goes between the two, so every layout combines the same rows in the same op:

- no EP group (one process, or EP simulated in one process): combine(rows(x));
- "allgather" (the 310P path): every rank holds every token, computes its experts' pairs, and one
  all-reduce of the pair rows (each row is non-zero on exactly one rank: the sum is exact) gives
  every rank all rows before the one combine;
- "alltoall": each rank takes a slice of the tokens, sends every (token, expert) pair to the rank
  holding that expert, gets the expert rows back, combines its tokens and all-gathers the slices.
  Less compute per rank, data-dependent message sizes (a host sync per layer).

A rank never rounds a partial weighted sum, which is what made per-rank combines drift from one
process (EP=2 on 310P from step 6). The price: the all-gather path all-reduces k rows per token
instead of one (decode sends few tokens, so latency, not bytes, dominates it).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from lib.distributed import process_group as parallel


class Experts(NamedTuple):
    """A backend's routed-expert compute, split where the EP exchange goes."""
    rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]       # (x [T, d], ids [T, k]) -> [T*k, d]
    combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]    # (rows [T*k, d], weights [T, k]) -> [T, d]
    row_dtype: torch.dtype                                           # what `rows` returns
    out_dtype: torch.dtype                                           # what `combine` returns


def weighted_sum(rows: torch.Tensor, weights: torch.Tensor, *, out_dtype: torch.dtype) -> torch.Tensor:
    """A combine for backends without an unpermute op: each token's weighted sum of its k pair rows
    [T*k, d], in the rows' dtype, rounded once to `out_dtype` -> [T, d]."""
    t, k = weights.shape
    return (rows.reshape(t, k, -1) * weights.to(rows.dtype).unsqueeze(-1)).sum(1).to(out_dtype)


def exchange(placement, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Experts) -> torch.Tensor:
    """[T, d] routed output for x [T, d], routing weights / global expert ids [T, k]."""
    group = getattr(placement, "group", None)
    if group is None:
        return experts.combine(experts.rows(x, ids), weights)
    if placement.dispatch == "allgather":
        return experts.combine(parallel.all_reduce(experts.rows(x, ids), group), weights)
    return _all_to_all(placement, x, weights, ids, experts)


def _all_to_all(placement, x, weights, ids, experts: Experts) -> torch.Tensor:
    import torch.distributed as dist

    group, rank = placement.group, placement.ranks[0]
    world = dist.get_world_size(group)
    t, k = ids.shape
    bounds = [t * r // world for r in range(world + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    token = torch.arange(hi - lo).repeat_interleave(k)                       # [P] this rank's pairs, t-major
    expert = ids[lo:hi].reshape(-1).to(torch.int64)
    dest = torch.div(expert, placement.n_local, rounding_mode="floor")
    order = torch.argsort(dest, stable=True)
    counts = torch.bincount(dest, minlength=world).tolist()
    got_rows = parallel.all_to_all(list(x[lo:hi].index_select(0, token[order]).split(counts)), group)
    got_ids = torch.cat(parallel.all_to_all(list(expert[order].split(counts)), group))
    received = [r.shape[0] for r in got_rows]
    got_rows = torch.cat(got_rows)
    d = x.shape[-1]
    if got_rows.shape[0]:   # each received pair is a one-expert token; rows travel in fp64 (one dtype for all)
        done = experts.rows(got_rows, got_ids[:, None].to(ids.dtype)).double()
    else:
        done = torch.zeros(0, d, dtype=torch.float64)
    back = torch.cat(parallel.all_to_all(list(done.split(received)), group))    # my pairs, in `order`
    pair_rows = torch.zeros_like(back).index_copy(0, order, back).to(experts.row_dtype)
    if hi > lo:
        mine = experts.combine(pair_rows, weights[lo:hi]).double()
    else:
        mine = torch.zeros(0, d, dtype=torch.float64)
    return _gather_rows(mine, bounds, group).to(experts.out_dtype)


def _gather_rows(mine: torch.Tensor, bounds: list[int], group) -> torch.Tensor:
    """Every rank's token slice, in rank order (slices may differ by one row: pad, gather, trim)."""
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    widest = max(sizes)
    padded = torch.cat((mine, mine.new_zeros(widest - mine.shape[0], mine.shape[1])))
    parts = parallel.all_gather(padded, group, dim=0).split(widest)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])
