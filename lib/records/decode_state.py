"""Per-sequence decode state of the reference runtime (DSV4-REFERENCE §3.12), as plain records.

Records are immutable: a forward returns new records and never mutates the ones passed in, so a
caller can keep the old state (speculative decoding rewinds by simply keeping it). Paged storage
of the same state for devices is a runtime concern layered on top; these records are its meaning.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class CompressorState(NamedTuple):
    """One compressor (the attention's, or the CSA indexer's own) of one sequence."""
    buf_kv: torch.Tensor     # [b, C] projections A of the incomplete window's tokens, b = length % m
    buf_gate: torch.Tensor   # [b, C] gate logits Z + ape of those tokens
    prev_kv: torch.Tensor    # [m or 0, Dc] CSA: "a" half of the last complete window (overlap); [0, Dc] before the first and always for HCA
    prev_gate: torch.Tensor  # [m or 0, Dc]
    entries: torch.Tensor    # [E, Dc] compressed entries so far, normalised, RoPE applied; E = length // m
    # This call's new positions' projections, fp32: the per-position rows paged storage keeps
    # (lib/runtime/paged_cache.py rebuilds every field above from them, the committed length and the entries).
    # Not read by the ops; empty on a state that no compress call produced.
    rows_kv: torch.Tensor = torch.zeros(0, 0)     # [n, C] A of the n new positions
    rows_gate: torch.Tensor = torch.zeros(0, 0)   # [n, C] Z + ape of the n new positions


class LayerCache(NamedTuple):
    window: torch.Tensor             # [<= sliding_window, head_dim] raw KV of the latest positions, oldest first
    comp: CompressorState | None     # CSA / HCA layers
    index: CompressorState | None    # CSA layers: the indexer's keys


class SeqCache(NamedTuple):
    length: int                      # tokens already folded into this state
    layers: tuple[LayerCache, ...]   # one per backbone layer, schedule order


def empty_compressor(channels: int, entry_dim: int, entry_dtype=torch.float32) -> CompressorState:
    f32 = torch.float32
    return CompressorState(torch.zeros(0, channels, dtype=f32), torch.zeros(0, channels, dtype=f32),
                           torch.zeros(0, entry_dim, dtype=f32), torch.zeros(0, entry_dim, dtype=f32),
                           torch.zeros(0, entry_dim, dtype=entry_dtype),
                           torch.zeros(0, channels, dtype=f32), torch.zeros(0, channels, dtype=f32))
