"""Block tables and slot mapping of paged decode state (L19, B12).

A group's positions live in physical blocks of `block_tokens` pool rows. A sequence's block table
lists LOGICAL block ids because the attention kernel addresses blocks of `logical_block_tokens`
positions: one physical block appears as f = block_tokens // logical_block_tokens consecutive
logical ids (310P: 32-token blocks as 16 logical blocks of 2). Geometry only: this module knows
no model, no sequence and no request.
"""
from __future__ import annotations

import heapq

import torch


def logical_ids(physical: int, block_tokens: int, logical_block_tokens: int) -> list[int]:
    """The block-table entries of physical block `physical`: b*f .. b*f+f-1."""
    f = block_tokens // logical_block_tokens
    return list(range(physical * f, physical * f + f))


def physical_slots(table: torch.Tensor, q: torch.Tensor, block_tokens: int,
                   logical_block_tokens: int) -> torch.Tensor:
    """Pool rows [k] int64 of group positions q [k] int64 under a block table [n_logical] int32.

    logical = table[q // l]; physical = logical // f; offset = (logical % f) * l + q % l;
    slot = physical * P + offset. The factor f comes from the table geometry (P, l), never from
    request data (B12); table ids and the gather index stay int32 (L13).
    """
    factor = block_tokens // logical_block_tokens
    logical = table.index_select(0, (q // logical_block_tokens).to(torch.int32))        # [k] int32
    physical = logical // factor
    offset = (logical % factor) * logical_block_tokens + (q % logical_block_tokens).to(torch.int32)
    return physical.to(torch.int64) * block_tokens + offset.to(torch.int64)


class BlockAllocator:
    """The free physical blocks of one group; the lowest id is handed out first, so runs are
    reproducible. Host bookkeeping: nothing here touches a device tensor."""

    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))          # a heap (sorted is one)

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"{n} blocks wanted but {len(self._free)} of {self.num_blocks} are free")
        return [heapq.heappop(self._free) for _ in range(n)]

    def give_back(self, blocks: list[int]) -> None:
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block {b} does not belong to a pool of {self.num_blocks} blocks")
            heapq.heappush(self._free, b)
