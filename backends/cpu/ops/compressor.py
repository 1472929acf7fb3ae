"""Reference KV compressor (DSV4-REFERENCE §3.7, §3.8 for the indexer's own) over paged state.

Every step projects A = W_kv h and Z = W_gate h + ape[t mod m] for its tokens; each entry a token
completes (batch.state.writes: entry e by position (e + 1) m - 1) pools its window's rows, read
from this step's rows or from the sequence's ring of earlier ones, so prefill in any chunking
equals one long prefill (§3.12, L24). Then the step's rows go into the ring. No loop over
sequences or windows: one gather of [K, span] rows for the K entries of the whole batch.
"""
from __future__ import annotations

import torch

from backends.cpu.ops.basic import gather_rows, rms_norm, wide
from backends.cpu.ops.rope import rope
from lib.records.batch import Batch
from lib.records.decode_state import CompressorPools


def window_rows(a_all: torch.Tensor, z_all: torch.Tensor, batch: Batch, pools: CompressorPools, *, ratio: int,
                overlap: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows each new entry pools: (kv [K, S, Dc], gate [K, S, Dc], valid [K, S]) with S = 2m
    overlapping (window e-1's "a" half, then window e's "b" half) or m. Slots before position 0
    (the first window's missing left half) are not valid."""
    addr, c = batch.state, a_all.shape[-1]
    writes, ring = addr.writes[ratio], pools.kv.shape[1]
    span = 2 * ratio if overlap else ratio
    q = (writes.ids * ratio - (span - ratio))[:, None] + torch.arange(span)              # [K, S] positions
    src = addr.sources(writes.seq[:, None].expand_as(q), q, ring)
    kv = gather_rows(torch.cat((pools.kv.view(-1, c), a_all)), src)                       # [K, S, C]
    gate = gather_rows(torch.cat((pools.gate.view(-1, c), z_all)), src)
    if overlap:
        dc = c // 2
        kv = torch.cat((kv[:, :ratio, :dc], kv[:, ratio:, dc:]), dim=1)                   # [K, 2m, Dc]
        gate = torch.cat((gate[:, :ratio, :dc], gate[:, ratio:, dc:]), dim=1)
    return kv, gate, q >= 0


def store_rows(a_all: torch.Tensor, z_all: torch.Tensor, batch: Batch, pools: CompressorPools) -> None:
    """This step's projections into the sequences' rings (after every read of them)."""
    c, ring = a_all.shape[-1], pools.kv.shape[1]
    rows = batch.state.ring_writes(batch.positions, ring)
    pools.kv.view(-1, c).index_copy_(0, rows, a_all.to(pools.kv.dtype))
    pools.gate.view(-1, c).index_copy_(0, rows, z_all.to(pools.gate.dtype))


def compress(h: torch.Tensor, batch: Batch, pools: CompressorPools, wkv: torch.Tensor, wgate: torch.Tensor,
             ape: torch.Tensor, norm: torch.Tensor, *, ratio: int, overlap: bool, eps: float,
             angles, rope_dim: int) -> CompressorPools:
    """h [T, d] -> the same pools with this step's entries and rows written.

    wkv, wgate [C, d] with C = 2*Dc when `overlap` (CSA: series a = [:Dc], b = [Dc:]) else Dc;
    ape [ratio, C] biases the gate by position within the window. Pooling is a softmax over the
    window's slots per channel in fp64; entries are RMS-normalised and rotated at position m*e.
    """
    a_all = (h.to(wide.dtype) @ wkv.to(wide.dtype).t()).float()                                      # [T, C]
    z_all = (h.to(wide.dtype) @ wgate.to(wide.dtype).t() + ape.to(wide.dtype)[batch.positions % ratio]).float()
    writes = batch.state.writes[ratio]
    kv, gate, valid = window_rows(a_all, z_all, batch, pools, ratio=ratio, overlap=overlap)
    g = gate.to(wide.dtype).masked_fill(~valid[:, :, None], float("-inf"))
    pooled = (torch.softmax(g, dim=1) * kv.to(wide.dtype).masked_fill(~valid[:, :, None], 0)).sum(dim=1).float()
    entries = rope(rms_norm(pooled, norm, eps), angles.entries[ratio], rope_dim)   # [K, Dc] at m * e
    pools.entries.index_copy_(0, writes.slots, entries.to(pools.entries.dtype))
    store_rows(a_all, z_all, batch, pools)
    return pools


def compressed_entries(pools: CompressorPools) -> torch.Tensor:
    """The compressor's entry pool [blocks * P, Dc] (read through the block table of its ratio)."""
    return pools.entries
