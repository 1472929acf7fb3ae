"""Where routed experts live under expert parallelism (EP), as a record the MoE ops read.

Rank r of an EP group of size P holds experts [r*E/P, (r+1)*E/P). `local_of[r, e]` is the local
slot of global expert e on rank r, or `n_local` (a zero-weight dummy slot) when rank r does not
hold it: the 310P routing op accepts only local ids and ignores any expert range (L06). The map
is built from the live rank at load time, never cached from another process (B11).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from spec.tables import block_experts


class ExpertPlacement(NamedTuple):
    n_experts: int
    ep_size: int
    ranks: tuple[int, ...]     # EP ranks this process runs: its own, or all of them when simulating EP
    local_of: torch.Tensor     # [ep_size, E] int32 global expert -> local slot on each rank (n_local = dummy)
    group: object = None       # torch.distributed EP group when the ranks are processes (lib/distributed/expert_exchange.py)
    dispatch: str = "allgather"  # token exchange over `group`: "allgather" | "alltoall"

    @property
    def n_local(self) -> int:
        return self.n_experts // self.ep_size

    def experts_of(self, rank: int) -> slice:
        """The global expert ids rank `rank` holds, as a slice."""
        return slice(rank * self.n_local, (rank + 1) * self.n_local)


def expert_placement(n_experts: int, ep_size: int = 1, rank: int = 0, simulate: bool = False) -> ExpertPlacement:
    """Placement for `rank` of an EP group; `simulate` runs every rank's share in this process."""
    if ep_size < 1 or n_experts % ep_size:
        raise ValueError(f"expert parallel size {ep_size} must divide n_routed_experts ({n_experts})")
    if not 0 <= rank < ep_size:
        raise ValueError(f"EP rank {rank} is outside 0..{ep_size - 1}")
    n_local = n_experts // ep_size
    experts = torch.arange(n_experts)
    rows = []
    for r in range(ep_size):
        local = (experts >= r * n_local) & (experts < (r + 1) * n_local)
        rows.append(torch.where(local, experts - r * n_local, torch.full_like(experts, n_local)))
    ranks = tuple(range(ep_size)) if simulate else (rank,)
    return ExpertPlacement(n_experts, ep_size, ranks, torch.stack(rows).to(torch.int32))


def local_ids(ids: torch.Tensor, local_of: torch.Tensor) -> torch.Tensor:
    """Global expert ids [T, k] -> one rank's local slots (`local_of` is that rank's row); other
    ranks' experts map to the dummy slot `n_local` (L06)."""
    return local_of.index_select(0, ids.flatten()).view_as(ids)                 # [T, k] int32


def placement_for_block(cfg, layer, options) -> ExpertPlacement:
    """tensors.yaml `derived` builder: the placement of this process's EP rank. Under real EP the
    options carry the rank read from the live process group at load time (lib.distributed.process_group.live, B11)."""
    place = options.faults.expert_placement or expert_placement      # a re-introduced field bug (conformance)
    placement = place(block_experts(cfg, layer), options.ep_size, options.ep_rank, options.ep_simulate)
    return placement._replace(group=options.ep_group, dispatch=options.ep_dispatch)


def rank_experts(record, placement: ExpertPlacement, rank: int):
    """A rank's experts out of a stacked expert record (W8A8, W4A8, packed FP4: every field [E, ...]).
    A process holding only its own experts already has them; holding all (simulated EP), slice."""
    if record[0].shape[0] == placement.n_local:
        return record
    sl = placement.experts_of(rank)
    return type(record)(*(field[sl] for field in record))
