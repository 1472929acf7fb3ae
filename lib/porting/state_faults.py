"""Fault sites of the paged decode state: the address arithmetic (B12-B14) and two long-context bugs.

B12-B14 are field bugs (data/porting-lessons.yaml) in the arithmetic lib/records/addressing.py
names: they reach a run as a `PagedSites` record passed to `PagedCache(..., sites=)`, so every
read and write of the device's pools goes through the wrong function, as the field port's did.

C01 and C02 are not from the field reports. They are bugs a port of the compressor or the indexer
plausibly carries that nothing short shows: both are exact below a context length (C01: 8192
positions, C02: 1028), so only long-context conformance (`--context`,
lib/porting/conformance_context.py) can catch them. They reach the device as a call of the
generated code rendered again (codegen Rewrite `calls`), wrapping the backend's own lowering.
"""
from __future__ import annotations

import torch


# ---- B12-B14: PagedSites functions, same signatures as lib/records/addressing.py's -------------
def logical_as_physical(table, seq, q, block_tokens, logical_block_tokens):
    """B12: the block-table entry taken as a physical block id: row = entry * P + q % P. Where one
    physical block is f > 1 logical ones (310P, L19) the rows land f times too far."""
    col = (q // logical_block_tokens).clamp(0, max(0, table.shape[1] - 1))
    entry = table[seq, col].clamp(min=0).to(torch.int64)
    return entry * block_tokens + q % block_tokens


def raw_token_positions(ratio, start, end):
    """B13: compressed entries slotted by the position of the token that emitted them, (e + 1) m - 1,
    instead of by their entry index e."""
    return (torch.arange(start // ratio, end // ratio, dtype=torch.int64) + 1) * ratio - 1


def last_group(tables, ratio):
    """B14: every layer reads the block tables of the last entry group, whatever its ratio."""
    return tables[-1]


# ---- C01, C02: lowerings of `compress` and `index_select` with a long-context bug -------------
# The context lengths (at CSA ratio 4) from which each bug changes a result. Float16 holds every
# multiple of 4 up to 8192 exactly; past it a position m*e rounds to a multiple of 8, so every
# other CSA entry is one compression window off: the first, entry 2049 at 8196 (rounded to 8192),
# is completed by position 8199. C02's kernel tiles the entries by C02_TILE: entry C02_TILE is
# the first outside its first tile.
C02_TILE = 256
C01_SHOWS_FROM = 8200
C02_SHOWS_FROM = (C02_TILE + 1) * 4


def fp16_entry_positions(h, batch, pools, wkv, wgate, ape, norm, *, ratio, overlap, eps, angles, rope_dim):
    """C01: the compressor rotates entry e at its position m*e carried in float16 (a port that
    builds the positions in the compute dtype). Exact below C01_SHOWS_FROM for CSA (and far beyond
    for HCA's multiples of 128); past it an entry is rotated one window too early or late.

    The backend's compressor writes the entries at the exact positions; rotating a written entry
    by the rounding error d gives RoPE(p + d) (rotations compose), and d = 0 leaves it as it was."""
    from backends.common import attention

    pools = attention.compress(h, batch, pools, wkv, wgate, ape, norm, ratio=ratio, overlap=overlap, eps=eps,
                               angles=angles, rope_dim=rope_dim)
    return _fp16_drift(pools, batch, ratio, angles, rope_dim)


def fp16_entry_positions_fused(h, batch, pools, wkv, wgate, ape, norm, *, ratio, overlap, eps, angles, rope_dim):
    """C01 where ascend910's fused compressor writes the entries (its rope rows built from float16 positions)."""
    from backends.ascend910 import fused_attention

    pools = fused_attention.compress_fused(h, batch, pools, wkv, wgate, ape, norm, ratio=ratio, overlap=overlap,
                                           eps=eps, angles=angles, rope_dim=rope_dim)
    return _fp16_drift(pools, batch, ratio, angles, rope_dim)


def _fp16_drift(pools, batch, ratio: int, angles, rope_dim: int):
    from backends.common import rope

    writes = batch.state.writes[ratio]
    exact = writes.ids * ratio
    drift = exact.to(torch.float16).to(torch.int64) - exact
    rows = pools.entries.index_select(0, writes.slots)
    turn = drift.float()[:, None] * angles.inv_freq.float()[None, :]
    pools.entries.index_copy_(0, writes.slots, rope.rope(rows, (turn.cos(), turn.sin()), rope_dim).to(rows.dtype))
    return pools


def last_block_top_k(q, weights, batch, keys, *, topk, ratio, weight_scale, group=None):
    """C02: an indexer kernel tiling the entries by C02_TILE whose running top-k is restarted in
    every tile (its accumulator initialised inside the tile loop), so only the top-k of the batch's
    last tile survives. Exact while a sequence has at most C02_TILE entries (C02_TILE * ratio
    positions); past that, no query can select an entry older than the last tile.

    The backend's own selection is run over the last tile alone: entry ids, positions, the entry
    count and each row's readable entries shifted down by the tile's start, so it sees only those."""
    from backends.common import attention

    addr = batch.state
    skip = (max(addr.max_entries[ratio] - 1, 0) // C02_TILE) * C02_TILE
    if skip == 0:
        return attention.index_select(q, weights, batch, keys, topk=topk, ratio=ratio, weight_scale=weight_scale,
                                      group=group)
    table = addr.step(("entries", ratio))        # the step's entry rows, read from entry `skip` on
    tail = addr._replace(max_entries={**addr.max_entries, ratio: addr.max_entries[ratio] - skip},
                         rows={**addr.rows, ("entries", ratio): table[:, skip:],
                               ("limit", ratio): addr.step(("limit", ratio)) - skip})
    view = batch._replace(positions=batch.positions - skip * ratio, state=tail)
    picked = attention.index_select(q, weights, view, keys, topk=topk, ratio=ratio, weight_scale=weight_scale,
                                    group=group)
    return torch.where(picked >= 0, picked + skip, picked)
