"""The pools a deployment's decode state takes, derived from the state declaration alone.

One function turns the declaration (the generated package's `STATE`, lib/records/decode_state.py)
and a deployment (schedule, dtype, block geometry, `max_seqs`, `num_blocks`, `slack`) into every
pool's shape and dtype. lib/runtime/paged_cache.py allocates exactly these; `dsv4gen plan` sums
their bytes (lib/planner/cache_layout.py), so the planner and the engine cannot disagree.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from lib.records.decode_state import items_for


class PoolShape(NamedTuple):
    owner: str               # "layer7" or "stage0" (a drafter stage's ring)
    item: str                # declared name: "window", "comp.kv", "index.entries", ...
    lifetime: str            # "sequence" | "entry"
    ratio: int               # the owner's compress ratio (entry pools: the block table they use)
    shape: tuple[int, ...]   # [max_seqs + 1, rows, dim] ring pools (slot max_seqs: trash; one more slot, slot 0,
                             # before them where the item declares slot0_unused) | [(blocks + 1) * P, dim]
                             # entry pools (the last block: trash, the padded writes of a bucketed step)
    dtype: torch.dtype

    @property
    def bytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty(0, dtype=self.dtype).element_size()

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one position of a ring, one entry of a block pool)."""
        return self.shape[-1] * torch.empty(0, dtype=self.dtype).element_size()


def group_blocks(num_blocks: int, ratio: int, max_seqs: int) -> int:
    """Physical blocks of the entry group of `ratio`: `num_blocks` blocks of context positions
    fill cdiv(num_blocks, ratio) blocks of entries, plus one partly filled block per sequence."""
    return -(-num_blocks // ratio) + max_seqs


def pool_shapes(state, cfg, layers, stages, *, compute_dtype: torch.dtype, block_tokens: int, max_seqs: int,
                num_blocks: int, slack: int, ring_multiple: int = 1) -> list[PoolShape]:
    """Every pool, backbone layers in schedule order, then each drafter stage's ring (`stages`:
    the drafter's schedule, or () when nothing drafts); ring pools get a multiple of `ring_multiple`
    rows (the profile's cache.ring_rows_multiple)."""
    out = []
    owners = [(f"layer{layer.index}", layer) for layer in layers] + [(f"stage{layer.stage}", layer) for layer in stages]
    for owner, layer in owners:
        for item in items_for(state, layer.attention, layer.kv_source):
            dtype = compute_dtype if item.dtype == "compute" else getattr(torch, item.dtype)
            dim = item.dim(cfg, layer.ratio, slack)
            if item.lifetime == "sequence":
                rows = item.rows(cfg, layer.ratio, slack)
                shape = (max_seqs + 1 + item.slot0_unused, -(-rows // ring_multiple) * ring_multiple, dim)
            else:
                shape = ((group_blocks(num_blocks, layer.ratio, max_seqs) + 1) * block_tokens, dim)
            out.append(PoolShape(owner, item.name, item.lifetime, layer.ratio, shape, dtype))
    return out


def entry_ratios(shapes: list[PoolShape]) -> list[int]:
    return sorted({s.ratio for s in shapes if s.lifetime == "entry"})
