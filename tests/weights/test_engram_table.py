"""V4.1's Engram table in host memory, sharded by rows per rank (lib/weights/engram_table.py)."""
from __future__ import annotations

import pytest
import torch

from backends.cpu.ops.engram import engram_rows
from lib.weights.checkpoint import Checkpoint
from lib.weights.engram_table import load_shard, shard_rows


def test_rows_split_in_contiguous_blocks_of_the_ceiling():
    assert [shard_rows(10, r, 3) for r in range(3)] == [(0, 4), (4, 8), (8, 10)]
    assert [shard_rows(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    with pytest.raises(ValueError, match="rank 3 is not in 0 .. 2"):
        shard_rows(10, 3, 3)


def test_the_ranks_rows_sum_to_the_whole_tables_and_each_reads_only_its_own(v41_tiny_ckpt):
    ckpt = Checkpoint(v41_tiny_ckpt)
    whole = load_shard(ckpt, "layers.4")
    assert whole.rows == 30058 and whole.weight.shape == (30058, 32) and whole.nbytes == 30058 * (32 + 1)
    ids = torch.randint(0, whole.rows, (5, 24), generator=torch.Generator().manual_seed(0))
    ids[0, :3] = torch.tensor([0, 10019, 30057])           # the first row, a block edge, the last row
    full = whole.lookup(ids)
    assert full.shape == (5, 24, 32)
    raw = ckpt.read("layers.4.engram.embed.weight"), ckpt.read("layers.4.engram.embed.scale")
    assert torch.equal(full, engram_rows(ids, *raw))        # the reference op's dequantisation of those rows
    parts = []
    for rank in range(3):
        before = ckpt.bytes_read
        shard = load_shard(ckpt, "layers.4", rank, 3)
        assert ckpt.bytes_read - before == shard.nbytes == shard.weight.shape[0] * 33    # only its rows' bytes
        parts.append(shard.lookup(ids))
    assert torch.equal(parts[0] + parts[1] + parts[2], full)             # the all-reduce of the ranks' rows
    assert bool((parts[1][0, 0] == 0).all()) and torch.equal(parts[0][0, 0], full[0, 0])
    with pytest.raises(ValueError, match="hash id 30058 is outside the table's 30058 rows"):
        whole.lookup(torch.tensor([30058]))
    with pytest.raises(ValueError, match="no Engram table under layers.2.engram.embed.weight"):
        load_shard(ckpt, "layers.2")


def test_int8_tables_as_the_field_stores_them_read_their_rows_exactly():
    """The field's engram_int8/ tables: int8 rows with an fp32 scale per 32 channels (quant.yaml int8_row32); a rank's
    block of rows returns the stored values times their scales, zeros for rows it does not hold, and a 3-rank split
    of 10 rows (4, 4, 2) sums to the whole table."""
    from lib.quant.reference_formats import decode_int8_row32, encode_int8_row32
    from lib.weights.engram_table import EngramShard, layer_lookup

    table = torch.randn(10, 64, generator=torch.Generator().manual_seed(0))
    parts = encode_int8_row32(table, None)
    assert parts["weight"].dtype == torch.int8 and tuple(parts["scale"].shape) == (10, 2)
    values = decode_int8_row32(parts, None)
    assert float((values - table).abs().max()) <= float(parts["scale"].max()) / 2 + 1e-7   # half a step at most
    ids = torch.tensor([[[0, 9, 4]], [[5, 3, 8]]])                                          # [T, 1 layer, 3 columns]
    total = torch.zeros(2, 3, 64)
    for rank in range(3):
        lo, hi = shard_rows(10, rank, 3)
        shard = EngramShard(parts["weight"][lo:hi], parts["scale"][lo:hi], 0, hi - lo)
        total += layer_lookup(ids, shard, layer_index=1, layer_ids=(1,), tables=(10,), shard=rank, shards=3)
    assert torch.equal(total, values[ids[:, 0]])


def test_tp_splits_an_engram_table_no_tp_size_divides_into_ceil_blocks():
    """tensors.yaml `tp: row_blocks`: V4.1-Flash's second table has 384,016,682 rows, which neither TP 4 nor TP 8
    divides; each rank reads its block of ceil(rows / TP) rows (the last one short) and its scales' same rows."""
    from lib.weights.tp_slices import check_tp, part_index
    from spec.tables import expand
    from spec.variants import variant_config

    cfg = variant_config("v41-flash")
    logical = expand(cfg)
    table = next(t for t in logical if t.key == "layers.14.engram.embed.weight")
    assert table.shape[0] == 384_016_682 and table.shape[0] % 4 and table.shape[0] % 8
    for tp in (4, 8):
        check_tp(cfg, logical, tp, 0)                     # no refusal
        blocks = [part_index(table, cfg, tp, rank) for rank in range(tp)]
        spans = [(b["weight"].start, b["weight"].stop) for b in blocks]
        assert spans == [shard_rows(table.shape[0], rank, tp) for rank in range(tp)]
        assert all(b["scale"][1:] == b["weight"][1:] for b in blocks)          # the same rows of the scales
        assert spans[-1][1] == table.shape[0] and spans[-1][1] - spans[-1][0] < spans[0][1] - spans[0][0]
