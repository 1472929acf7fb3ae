"""Decode state as the generated forward sees it: pools, not per-sequence copies (DSV4-REFERENCE §3.12).

`StateItem` is one entry of the state declaration (spec/state.yaml, rendered into each backend's
generated package as `STATE`); lib/runtime/paged_cache.py allocates one pool per item and layer.
A layer's pools come in as a `LayerPools` record; the ops write into them in place (scatters by
slot) and read them by slot or block table (lib/records/addressing.py), so nothing is copied out
per sequence and back. Knows no allocation and no scheduling.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch


class StateItem(NamedTuple):
    """One declared piece of decode state (spec/state.yaml says what each field means)."""
    name: str                                   # "window", "comp.kv", "comp.entries", ...
    kinds: tuple[str, ...]                      # attention kinds that keep it
    lifetime: str                               # "sequence" (ring rows in a per-sequence slot) | "entry"
    rows: Callable[..., int] | None             # (cfg, ratio, slack) -> ring rows; None for entry lifetime
    dim: Callable[..., int]                     # (cfg, ratio, slack) -> row width
    dtype: str                                  # "compute" | "float32"
    slot0_unused: bool = False                  # the pool has one more slot, slot 0, never read or written
    sources_only: bool = False                  # kept only by layers that make the compressed KV (kv_source)


class CompressorPools(NamedTuple):
    """One compressor's state in one layer: its ring of per-position projections and its entries.
    The ring keeps A and Z + ape of a position side by side in one row, as vllm-ascend's fused
    compressor reads and writes its state (ascend910); `kv` and `gate` are the two halves as views."""
    state: torch.Tensor | None  # [max_seqs + 2, R, 2C] fp32 rows A | Z + ape; slot 0 unused, sequence slot s at s + 1,
                                # position p in row p % R; None where nothing is pooled across steps (V4.1's
                                # index keys, its ratio-1 source)
    entries: torch.Tensor    # [blocks * block_tokens, Dc] compressed entries, by the block table of `ratio`
    ratio: int

    @property
    def kv(self) -> torch.Tensor:
        """[max_seqs + 1, R, C] fp32 projections A of the sequence slots (a view)."""
        return self.state[1:, :, : self.state.shape[-1] // 2]

    @property
    def gate(self) -> torch.Tensor:
        """[max_seqs + 1, R, C] fp32 gate logits Z + ape, same rows (a view)."""
        return self.state[1:, :, self.state.shape[-1] // 2:]


class LayerPools(NamedTuple):
    """A block's decode state: what the generated forward reads as `cache.<field>`."""
    window: torch.Tensor | None         # [max_seqs + 1, R, D] raw KV ring (a drafter stage: its context ring)
    comp: CompressorPools | None        # CSA / HCA layers
    index: CompressorPools | None       # CSA layers: the indexer's compressor and keys


def items_for(state: tuple[StateItem, ...], kind: str, kv_source: bool = True) -> tuple[StateItem, ...]:
    """The items a layer of attention kind `kind` keeps; `kv_source`: whether it makes the compressed KV (a V4.1
    layer after a source keeps none of the source's items, it reads the source's)."""
    return tuple(item for item in state if kind in item.kinds and (kv_source or not item.sources_only))
