"""A DeepSeek-V4.1 Engram table held in host memory, one rank's share of its rows (V41-REFERENCE §4.5, from the
official `inference/model.py`, code-index id 70871433627, and the 910 field report's host-resident tables).

Each Engram table is ~384M rows of 256 FP8 values with one E8M0 scale per 32 (about 101 GB); a device holds none
of it. A rank keeps its contiguous block of ceil(rows / world) rows in host memory, exactly as stored (FP8 bytes
and scale bytes, pinned where an accelerator is present so the copy to it is asynchronous), and for a step
dequantises only the rows the step's hash ids name: ids outside its block give zero rows, so the sum of every
rank's rows (an all-reduce) is the whole table's, bit for bit. Reading the block from the checkpoint reads only
those rows' bytes (safetensors slices).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from lib.quant.bit_codecs import dequant_fp8_block
from lib.quant.reference_formats import decode, decode_int8_row32
from lib.weights.checkpoint import Checkpoint

CHANNELS_PER_SCALE = 32


class EngramShard(NamedTuple):
    """Rows [start, start + weight.shape[0]) of one Engram table."""
    weight: torch.Tensor      # [rows of this rank, E] float8_e4m3fn (the release) or int8 (the field's engram_int8/),
                              # as stored; or the values, without a scale
    scale: torch.Tensor | None  # [rows of this rank, E / 32] E8M0 bytes (FP8 rows) or fp32 (int8 rows), as stored;
                                # None: `weight` holds the values
    start: int                # the first row this rank holds
    rows: int                 # rows of the whole table

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale) if t is not None)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] int64 rows of the whole table -> [..., E] fp32: this rank's rows dequantised, zeros for ids
        another rank holds."""
        if bool(((ids < 0) | (ids >= self.rows)).any()):
            bad = ids[(ids < 0) | (ids >= self.rows)][0].item()
            raise ValueError(f"Engram hash id {bad} is outside the table's {self.rows} rows")
        local = ids.flatten() - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        at = torch.where(mine, local, torch.zeros_like(local))
        weight = self.weight.index_select(0, at)
        if self.scale is None:
            rows = weight.float()
        elif weight.dtype == torch.int8:             # int8 per 32 channels with an fp32 scale (the field's tables)
            rows = decode_int8_row32({"weight": weight, "scale": self.scale.index_select(0, at)}, None)
        else:
            rows = dequant_fp8_block(weight, self.scale.index_select(0, at), block=(1, CHANNELS_PER_SCALE)).float()
        return torch.where(mine[:, None], rows, 0.0).view(*ids.shape, -1)   # a stand-in row's values never leak


def layer_lookup(ids: torch.Tensor, table: EngramShard, *, layer_index: int, layer_ids, tables, shard: int,
                 shards: int) -> torch.Tensor:
    """The graph's `engram_lookup` on the host: the rows this layer's column of the batch's hash ids [T, L, C] names
    -> [T, C, E] fp32. `table` holds rank `shard`'s block of the layer's table (shard_rows: ceil(rows / shards)
    rows each, the last block short; every row in one process), `tables` every Engram layer's row count; rows
    another rank holds are zeros, so the ranks' sum is the lookup."""
    rows = tables[list(layer_ids).index(layer_index)]
    start, stop = shard_rows(rows, shard, shards)
    if table.weight.shape[0] != stop - start:
        raise ValueError(f"Engram table of layer {layer_index}: rank {shard} of {shards} holds "
                         f"{table.weight.shape[0]} rows, its block of the {rows}-row table is {stop - start}")
    return EngramShard(table.weight, table.scale, start, rows).lookup(ids[:, list(layer_ids).index(layer_index)])


def to_engram_rows(storage: str, parts: dict[str, torch.Tensor], cfg) -> EngramShard:
    """Runtime format `engram_rows` (spec/runtime.yaml): a table in one shard of all its (this rank's) rows, the
    release's FP8 rows or the field's int8 ones as stored, any other storage (a FLOAT table) decoded once."""
    if storage in ("fp8_row32", "int8_row32"):
        weight = parts["weight"].contiguous()
        return EngramShard(weight, parts["scale"].contiguous(), 0, weight.shape[0])
    values = decode(storage, parts, cfg).float().contiguous()
    return EngramShard(values, None, 0, values.shape[0])


def shard_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """[start, stop) of `rank`'s contiguous block of ceil(rows / world) rows (the last block may be short)."""
    if not 0 <= rank < world:
        raise ValueError(f"Engram shard: rank {rank} is not in 0 .. {world - 1}")
    per = -(-rows // world)
    return min(rank * per, rows), min((rank + 1) * per, rows)


def load_shard(ckpt: Checkpoint, prefix: str, rank: int = 0, world: int = 1) -> EngramShard:
    """Rank `rank` of `world`'s block of the Engram table of block `prefix` ("layers.1"), read from the checkpoint
    (only its rows' bytes) into host memory."""
    key = f"{prefix}.engram.embed"
    if f"{key}.weight" not in ckpt.headers:
        raise ValueError(f"{ckpt.root}: no Engram table under {key}.weight (Engram layers: "
                         f"{list(ckpt.config.engram_layer_ids or ())})")
    rows = ckpt.headers[f"{key}.weight"].shape[0]
    start, stop = shard_rows(rows, rank, world)
    weight, scale = (ckpt.read(f"{key}.{part}", (slice(start, stop),)) for part in ("weight", "scale"))
    if torch.accelerator.is_available():    # page-locked: the step's rows go to the device asynchronously
        weight, scale = weight.pin_memory(), scale.pin_memory()
    return EngramShard(weight, scale, start, rows)
