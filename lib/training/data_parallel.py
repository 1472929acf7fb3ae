"""Data-parallel training: each rank runs the same model on its share of every step's batch.

The reference forward is bound by per-op overhead at the tiny model's widths, so a second thread speeds a
step up far less than a second process on half the batch does (docs/training.md gives the measured step
times). Every rank draws the same batch from the same stream and takes its share of the conversations
(`split`); the losses are normalised by the whole batch's counts (`Share.total`), the gradients and the
routers' loads are summed over the ranks (`Share.sum`), so each step is the single-process step on the
whole batch up to rounding, and every rank applies bit-identical updates (gloo hands every rank the same
sums), keeping the replicas equal without ever sending weights.
Must not know the model, the loss or the task mix.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import socket
from typing import Callable, NamedTuple

import torch

from lib.distributed import process_group


# What one more conversation costs a rank beyond its tokens, in tokens: the reference forward loops over a
# batch's sequences in attention, and each costs about this many tokens' worth of a step's time.
PER_SEQUENCE = 32


def split(seqs: list, world: int, groups: list[tuple[int, list[int]]] = ()) -> list[list]:
    """`seqs` in `world` shares of about equal cost (tokens + PER_SEQUENCE each; the costliest first onto the
    cheapest share), each share in the batch's order; empty shares only when there are fewer conversations (a
    group counting as one) than ranks. `groups`: (tokens shared, members) of conversations whose opening is
    computed once when they share a rank (lib/training/target.py shared_prefixes): each group goes to one rank
    whole, its opening counted once."""
    units = [(n + sum(len(seqs[m].ids) - n + PER_SEQUENCE for m in members), members) for n, members in groups]
    grouped = {m for _, members in groups for m in members}
    units += [(len(s.ids) + PER_SEQUENCE, [i]) for i, s in enumerate(seqs) if i not in grouped]
    loads, owner = [0] * world, {}
    for cost, members in sorted(units, key=lambda u: (-u[0], u[1][0])):
        rank = min(range(world), key=lambda r: (loads[r], r))
        owner.update(dict.fromkeys(members, rank))
        loads[rank] += cost
    return [[s for i, s in enumerate(seqs) if owner[i] == rank] for rank in range(world)]


def take(seqs: list, share: "Share", groups: list[tuple[int, list[int]]] = (), usable: Callable = bool):
    """(the Share to sum with, this rank's conversations): its `split` share, or, when any rank's share is not
    `usable` (default: empty), the whole batch on every rank, summed as in one process."""
    shares = split(seqs, share.world, groups)
    if not all(usable(s) for s in shares):
        return Share(), seqs
    return share, shares[share.rank]


class Share(NamedTuple):
    """This process's place in the data-parallel group (`group` None: the whole batch in one process)."""
    rank: int = 0
    world: int = 1
    group: object = None

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks (in fp64, then in x's dtype)."""
        return process_group.all_reduce(x, self.group).to(x.dtype) if self.group is not None else x

    def total(self, counts: list[int]) -> list[int]:
        if self.group is None:
            return counts
        return [int(n) for n in self.sum(torch.tensor(counts, dtype=torch.float64)).tolist()]

    def sum_grads(self, leaves: list[torch.Tensor]) -> None:
        """Every leaf's gradient summed over the ranks, in one reduction. A leaf no rank's share reached (an
        expert no token chose) keeps no gradient, as in one process on the whole batch, so AdamW skips it."""
        if self.group is None:
            return
        import torch.distributed as dist

        sizes = [v.numel() for v in leaves]
        flat = torch.cat([torch.cat([v.grad.reshape(-1) if v.grad is not None else v.new_zeros(v.numel()),
                                     v.new_ones(1) if v.grad is not None else v.new_zeros(1)]) for v in leaves])
        dist.all_reduce(flat, group=self.group)     # in the gradients' dtype: gloo gives every rank the same sums
        for v, part, n in zip(leaves, flat.split([n + 1 for n in sizes]), sizes):
            v.grad = part[:n].view_as(v).to(v.dtype) if part[n] > 0 else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def ranks(world: int, worker: Callable, args: tuple):
    """This process as rank 0 of `world`, with `worker(rank, world, init_method, *args)` started in a fresh
    process for each other rank; yields this process's Share. On leaving, the group is closed and the
    workers joined; a worker that failed fails the run with its rank and exit code."""
    if world < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {world}")
    if world == 1:
        yield Share()
        return
    import torch.distributed as dist

    init_method = f"tcp://127.0.0.1:{_free_port()}"
    spawn = multiprocessing.get_context("spawn")
    procs = [spawn.Process(target=worker, args=(rank, world, init_method, *args), daemon=True)
             for rank in range(1, world)]

    def gone() -> str | None:
        dead = [(r, p.exitcode) for r, p in enumerate(procs, start=1) if p.exitcode is not None]
        return f"data-parallel rank {dead[0][0]} exited with code {dead[0][1]}" if dead else None

    try:
        for p in procs:
            p.start()
        process_group.init_process_group(0, world, init_method, peers_gone=gone)
        yield Share(0, world, dist.group.WORLD)
    except Exception as err:
        for p in procs:                  # a rank that died mid-step shows here as a broken connection: name it
            if p.pid is not None:
                p.join(timeout=5)
        if (reason := gone()) and not str(err).startswith(reason):
            raise RuntimeError(f"{reason} (rank 0: {err})") from err
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        for p in procs:
            if p.pid is not None:
                p.join(timeout=60)
            if p.is_alive():
                p.kill()
    failed = [(r, p.exitcode) for r, p in enumerate(procs, start=1) if p.exitcode]
    if failed:
        raise RuntimeError(f"data-parallel rank {failed[0][0]} exited with code {failed[0][1]}")


def join(rank: int, world: int, init_method: str) -> Share:
    """A worker rank's Share, once it has joined rank 0's group."""
    import torch.distributed as dist

    process_group.init_process_group(rank, world, init_method)
    return Share(rank, world, dist.group.WORLD)
