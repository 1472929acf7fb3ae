"""Expert-parallel dispatch and combine around a backend's own routed-expert compute.

`exchange` gives every token its routed-expert output whatever the EP layout:
- no EP group (one process, or EP simulated in one process): the backend computes it directly;
- "allgather" (the 310P path): every rank already holds every token (attention is replicated or
  tensor-parallel), runs its own experts on all of them with other ranks' routes sent to the
  zero-weight dummy slot (L06), and one all-reduce sums the partials;
- "alltoall": each rank takes a slice of the tokens, sends every (token, expert) pair to the rank
  holding that expert, gets the weighted expert rows back, sums its tokens' rows and all-gathers
  the slices. Less compute per rank, data-dependent message sizes (a host sync per layer).

`partial(x, weights, ids)` is the backend's compute over the experts this process holds, in fp32
and not yet rounded to the compute dtype, so partial sums are reduced before the one rounding.
"""
from __future__ import annotations

from typing import Callable

import torch

from lib import parallel

Partial = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def exchange(placement, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, partial: Partial,
             dtype: torch.dtype) -> torch.Tensor:
    """[T, d] routed output in `dtype` for x [T, d], routing weights / global ids [T, k]."""
    group = getattr(placement, "group", None)
    if group is None:
        return partial(x, weights, ids).to(dtype)
    if placement.dispatch == "allgather":
        return parallel.all_reduce(partial(x, weights, ids), group).to(dtype)
    return _all_to_all(placement, x, weights, ids, partial).to(dtype)


def _all_to_all(placement, x, weights, ids, partial: Partial) -> torch.Tensor:
    import torch.distributed as dist

    group, rank = placement.group, placement.ranks[0]
    world = dist.get_world_size(group)
    t, k = ids.shape
    bounds = [t * r // world for r in range(world + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    token = torch.arange(hi - lo).repeat_interleave(k)                       # [P] this rank's pairs
    expert = ids[lo:hi].reshape(-1)
    order = torch.argsort(torch.div(expert, placement.n_local, rounding_mode="floor"), stable=True)
    counts = torch.bincount(torch.div(expert, placement.n_local, rounding_mode="floor"), minlength=world).tolist()
    rows = x[lo:hi].index_select(0, token[order])
    meta = torch.stack((weights[lo:hi].reshape(-1)[order].double(), expert[order].double()), dim=1)
    got_rows = parallel.all_to_all(list(rows.split(counts)), group)
    got_meta = torch.cat(parallel.all_to_all(list(meta.split(counts)), group))
    received = [r.shape[0] for r in got_rows]
    got_rows = torch.cat(got_rows)
    if got_rows.shape[0]:   # rows travel back in fp64 so every rank sends one dtype
        done = partial(got_rows, got_meta[:, :1].to(weights.dtype), got_meta[:, 1:].to(ids.dtype)).double()
    else:
        done = torch.zeros(0, x.shape[-1], dtype=torch.float64)
    back = torch.cat(parallel.all_to_all(list(done.split(received)), group))    # my pairs, in `order`
    pair_out = torch.zeros_like(back).index_copy(0, order, back)
    mine = torch.zeros(hi - lo, x.shape[-1], dtype=back.dtype).index_add(0, token, pair_out)
    return _gather_rows(mine, bounds, group)


def _gather_rows(mine: torch.Tensor, bounds: list[int], group) -> torch.Tensor:
    """Every rank's token slice, in rank order (slices may differ by one row: pad, gather, trim)."""
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    widest = max(sizes)
    padded = torch.cat((mine, mine.new_zeros(widest - mine.shape[0], mine.shape[1])))
    parts = parallel.all_gather(padded, group, dim=0).split(widest)
    return torch.cat([p[:n] for p, n in zip(parts, sizes)])
