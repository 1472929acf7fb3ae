"""Free physical blocks of one block pool (host bookkeeping: nothing here touches a device tensor)."""
from __future__ import annotations

import heapq


class BlockAllocator:
    """The free blocks (or slots) of one pool; the lowest id is handed out first, so runs are
    reproducible."""

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
