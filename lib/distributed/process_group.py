"""Tensor and expert parallelism over torch.distributed: sizes, process groups, and the collectives
the generated code and the MoE ops call.

A deployment runs W = max(TP, EP) ranks, one process per device; TP and EP are each 1 or W (the
field's TP=8 + EP=8 is W=8 with both groups the whole world). The groups are created before any
weight is loaded: communicators made after the weights could not get their buffers on 310P (L17).
Every rank reads its ranks from the live process group when it loads, never from a value computed
in another process: an EP rank cached before fork sent every token to rank 0's experts (B11).

What travels is chosen so that no rank rounds a partial result: EP moves one row per (token,
expert) pair and combines after the exchange (lib/distributed/expert_exchange.py), wo_b sums its per-group products in fp32
before its one rounding (graph op `o_proj`), the vocab-split embedding has one non-zero rank per
row. On CPU the transport is gloo, carrying partial sums in fp64; on a device the same calls go
to HCCL / RCCL, summing fp32.
"""
from __future__ import annotations

import datetime
import os
import time
from typing import Any, Callable, NamedTuple

import torch

DISPATCH_MODES = ("allgather", "alltoall")
# Generous: an idle server's workers wait in a broadcast for the next step.
GROUP_TIMEOUT = datetime.timedelta(days=7)


class Parallel(NamedTuple):
    """One rank's view of the parallel layout (the default is a single process)."""
    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    tp_group: Any = None          # torch.distributed ProcessGroup, None when tp_size == 1
    ep_group: Any = None
    ep_dispatch: str = "allgather"

    @property
    def world(self) -> int:
        return max(self.tp_size, self.ep_size)


SINGLE = Parallel()


def check_sizes(cfg, tp: int, ep: int) -> int:
    """The world size for TP x EP on this config, or ValueError naming what does not divide."""
    for name, size in (("tensor parallel size", tp), ("expert parallel size", ep)):
        if size < 1:
            raise ValueError(f"{name} must be >= 1, got {size}")
    world = max(tp, ep)
    if tp not in (1, world) or ep not in (1, world):
        raise ValueError(f"TP={tp} and EP={ep}: each must be 1 or the world size max(TP, EP)={world}")
    divides = {"num_attention_heads": cfg.num_attention_heads, "o_groups": cfg.o_groups,
               "index_n_heads": cfg.index_n_heads, "vocab_size": cfg.vocab_size}
    for key, value in divides.items():
        if value % tp:
            raise ValueError(f"tensor parallel size {tp} does not divide {key} ({value}); accepted TP sizes: "
                             f"{[t for t in (1, 2, 4, 8, 16) if all(v % t == 0 for v in divides.values())]}")
    for key in ("n_routed_experts", "dspark_n_routed_experts"):      # V4.1's DSpark stages split their own
        value = getattr(cfg, key)
        if value is not None and value % ep:
            raise ValueError(f"expert parallel size {ep} does not divide {key} ({value})")
    return world


def init_process_group(rank: int, world: int, init_method: str, backend: str | None = None,
                       peers_gone: Callable[[], str | None] | None = None, join_timeout: float | None = None,
                       scope: str = "") -> None:
    """Join the job's process group. Call before loading any weight (L17).

    init_method is "tcp://host:port", where rank 0 holds the rendezvous store, or "env://": a job
    torchrun started, whose store is at MASTER_ADDR:MASTER_PORT (torchrun's agent on node 0 holds
    it); `scope` then keeps one attempt's keys apart from an earlier attempt's in that store. Every
    other rank marks its arrival there first, and rank 0 waits for the marks polling `peers_gone()`
    (a reason once a rank's process has exited): a rank that dies on its way in (a failed import,
    its arguments failing to unpickle under spawn) then fails the launch at once, naming the rank,
    instead of leaving rank 0 in the rendezvous for the group's whole timeout. Where rank 0 cannot
    see the others' processes (other hosts), `join_timeout` seconds bound that wait instead."""
    import torch.distributed as dist

    backend = backend or os.environ.get("DSV4GEN_DIST_BACKEND", "gloo")
    if init_method == "env://":
        store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=GROUP_TIMEOUT))
        store = dist.PrefixStore(f"dsv4gen/{scope}", store) if scope else store
    else:
        host, _, port = init_method.removeprefix("tcp://").rpartition(":")
        if not init_method.startswith("tcp://") or not host or not port.isdigit():
            raise ValueError(f"init_method '{init_method}' is not tcp://host:port or env://")
        store = dist.TCPStore(host, int(port), world, is_master=rank == 0, timeout=GROUP_TIMEOUT,
                              wait_for_workers=False)
    arrived = [f"dsv4gen/arrived/{r}" for r in range(1, world)]
    if rank:
        store.set(arrived[rank - 1], "1")
    else:
        start = time.monotonic()
        while not store.check(arrived):
            if peers_gone is not None and (reason := peers_gone()):
                raise RuntimeError(f"{reason} before joining the process group")
            if join_timeout is not None and time.monotonic() - start > join_timeout:
                missing = [r for r, key in enumerate(arrived, start=1) if not store.check([key])]
                raise RuntimeError(f"rank(s) {', '.join(map(str, missing))} did not join the process group "
                                   f"within {join_timeout:.0f} s ({init_method}): their processes failed "
                                   "before joining or cannot reach the store")
            time.sleep(0.1)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=GROUP_TIMEOUT)


def live(tp: int, ep: int, ep_dispatch: str = "allgather") -> Parallel:
    """This process's Parallel, read from the live default group (B11)."""
    import torch.distributed as dist

    if ep_dispatch not in DISPATCH_MODES:
        raise ValueError(f"EP dispatch '{ep_dispatch}' is not one of {', '.join(DISPATCH_MODES)}")
    if not dist.is_initialized():
        if max(tp, ep) > 1:
            raise RuntimeError("TP/EP > 1 needs torch.distributed initialised first (lib.distributed.process_group.init_process_group)")
        return SINGLE._replace(ep_dispatch=ep_dispatch)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != max(tp, ep):
        raise ValueError(f"the process group has {world} ranks but TP={tp}, EP={ep} needs {max(tp, ep)}")
    group = dist.group.WORLD
    return Parallel(tp, rank if tp > 1 else 0, ep, rank if ep > 1 else 0,
                    group if tp > 1 else None, group if ep > 1 else None, ep_dispatch)


# ---- collectives (identity without a group) ---------------------------------------------------
def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group's ranks, carried in fp64 (exact for the partials this code reduces)."""
    if group is None:
        return x
    import torch.distributed as dist

    from lib.guard.capability import allow

    with allow("the gloo transport carries partial sums in fp64; HCCL / RCCL reduce fp32 on a device"):
        wide = x.to(torch.float64).contiguous()
        dist.all_reduce(wide, group=group)
        return wide.to(x.dtype)


def all_reduce_max(x: torch.Tensor, group) -> torch.Tensor:
    if group is None:
        return x
    import torch.distributed as dist

    out = x.clone().contiguous()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group)
    return out


def all_gather(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order."""
    if group is None:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def gather_heads(q: torch.Tensor, weights: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's indexer heads, in rank order and one collective: q [T, Hi/tp, Di] and head
    weights [T, Hi/tp] -> [T, Hi, Di] and [T, Hi], each in its own dtype (carried in the wider of
    the two, so both come back exactly)."""
    if group is None:
        return q, weights
    wide = torch.promote_types(q.dtype, weights.dtype)
    both = all_gather(torch.cat((q.to(wide), weights.to(wide).unsqueeze(-1)), dim=-1), group, dim=1)
    return both[..., :-1].to(q.dtype), both[..., -1].to(weights.dtype)


def all_to_all(chunks: list[torch.Tensor], group) -> list[torch.Tensor]:
    """Rank r sends chunks[s] to rank s and receives rank s's chunk r; chunks may differ in rows
    (counts are exchanged first, so the receiver can size its buffers)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    sizes = torch.tensor([c.shape[0] for c in chunks], dtype=torch.int64)
    incoming = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(incoming, sizes, group=group)
    counts = incoming.tolist()
    tail = chunks[0].shape[1:]
    # one flat exchange with uneven splits (gloo's list form needs equal sizes)
    out = torch.empty((sum(counts), *tail), dtype=chunks[0].dtype)
    dist.all_to_all_single(out, torch.cat(chunks).contiguous(), output_split_sizes=counts,
                           input_split_sizes=sizes.tolist(), group=group)
    return list(out.split(counts))
