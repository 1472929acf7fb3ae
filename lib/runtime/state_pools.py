"""The pools a deployment's decode state takes, derived from the state declaration alone.

One function turns the declaration (the generated package's `STATE`, lib/records/decode_state.py)
and a deployment (schedule, dtype, block geometry, `max_seqs`, `num_blocks`, `slack`) into every
pool's shape and dtype. lib/runtime/paged_cache.py allocates exactly these; `dsv4gen plan` sums
their bytes (lib/planner/cache_layout.py), so the planner and the engine cannot disagree; and
`backbone_pools` hands each layer's allocated tensors to the forward as its LayerPools.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from lib.records.addressing import PagedSites
from lib.records.decode_state import CompressorPools, LayerPools, items_for


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


def _layer_pools(tensors: dict, owner: str, ratio: int) -> LayerPools:
    def compressor(prefix: str) -> CompressorPools | None:
        if (owner, f"{prefix}.entries") not in tensors:
            return None
        return CompressorPools(tensors.get((owner, f"{prefix}.state")), tensors[(owner, f"{prefix}.entries")], ratio)
    return LayerPools(tensors.get((owner, "window")), compressor("comp"), compressor("index"))


def backbone_pools(tensors: dict, layers, sites: PagedSites) -> tuple[LayerPools, ...]:
    """Every backbone layer's pools; a compressed layer that makes no KV of its own (V4.1, after a KV source) reads
    the latest source's compressor and key pools (sites.reused_pools: lib/records/addressing.py)."""
    out, source = [], None
    for layer in layers:
        pools = _layer_pools(tensors, f"layer{layer.index}", layer.ratio)
        if layer.kv_source:
            source = pools
        elif layer.ratio and source is not None:
            pools = sites.reused_pools(source, pools)
        out.append(pools)
    return tuple(out)
