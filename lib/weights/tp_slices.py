"""Which slice of each stored tensor a tensor-parallel (TP) rank reads (DSV4-REFERENCE §4.3).

A logical tensor's tensors.yaml `tp` rule splits it into `tp_size` equal chunks on dim 0 (`rows`)
or dim 1 (`cols`), or into blocks of ceil(rows / tp_size) rows, the last one short (`row_blocks`: a V4.1 Engram
table, whose 384,016,682 rows no TP size divides); rank r reads chunk r. Every stored part is sliced on the same dim in its own
units: an FP8 block format's `.scale` [ceil(out/128), ceil(in/128)] in 128-row/column blocks. The
field sliced the weight of row-parallel linears and not their scale (B05). A rank's share is
either whole blocks, or a part of one block whose scale every rank sharing it reads (the small
test checkpoints: 128 wo_a rows over 2 ranks); any other split is refused, with every offending
tensor named, before any byte is read: a bad TP size must not cost a full load (the 310P field
restarted an 8-minute load ~60 times).
Knows the tensor table and the formats' shape expressions; nothing about backends or runtime formats.
"""
from __future__ import annotations

from typing import NamedTuple

from spec import expr
from spec.config import ModelConfig
from spec.tables import Logical, Part, load_quant

SPLIT_DIMS = {"rows": 0, "row_blocks": 0, "cols": 1}

# config widths a TP split divides by meaning, not only by shape: whole heads and wo_a groups per rank
WHOLE_PER_RANK = (("num_attention_heads", "attention heads are split across TP ranks"),
                  ("o_groups", "each TP rank holds whole wo_a groups (wq_b heads and wo_a groups split together)"),
                  ("index_n_heads", "indexer heads are split across TP ranks"))


class TPSlice(NamedTuple):
    """The range [start, stop) of dim `dim` of one stored part that this rank reads."""
    dim: int
    start: int
    stop: int

    def index(self) -> tuple[slice, ...]:
        return (slice(None),) * self.dim + (slice(self.start, self.stop),)


def _extent(part: Part, logical: Logical, dim: int, size: int, cfg: ModelConfig) -> int | None:
    """Stored elements along `dim` of `part` for a logical extent `size` (None: not a whole number)."""
    if part.shape is None:
        return size
    block = cfg.quantization_config.weight_block_size
    env = {"block_out": block[0], "block_in": block[1]}
    if len(logical.shape) == 2:
        env["rows"], env["cols"] = logical.shape
    env[("rows", "cols")[dim]] = size
    try:
        return expr.evaluate(part.shape[dim], env)
    except expr.ExprError:
        return None


def unit(part: Part, logical: Logical, dim: int, cfg: ModelConfig) -> int:
    """Logical rows/columns one stored element of `part` covers along `dim`, from the format's own
    shape expression: the first x where the count is whole and grows right after x (cdiv(x, 128)
    -> 128 for an FP8 scale, x/2 -> 2 for packed FP4, x -> 1 for a plain weight)."""
    for x in range(1, logical.shape[dim] + 1):
        here, after = _extent(part, logical, dim, x, cfg), _extent(part, logical, dim, x + 1, cfg)
        if here is not None and (after is None or after > here):
            return x
    return logical.shape[dim]


def split_problem(logical: Logical, cfg: ModelConfig, tp_size: int) -> str | None:
    """Why `logical` cannot be split `tp_size` ways by its `tp` rule (None: it can, or is not split)."""
    dim = SPLIT_DIMS.get(logical.entry.tp)
    if dim is None or tp_size == 1:
        return None
    what = f"{logical.key} {list(logical.shape)} (tp: {logical.entry.tp})"
    size = logical.shape[dim]
    if size % tp_size and logical.entry.tp != "row_blocks":
        return f"{what}: TP {tp_size} does not divide dim {dim} ({size})"
    chunk = -(-size // tp_size)
    fmt = load_quant().formats[logical.format]
    for part, stored in zip(fmt.parts, logical.parts):
        u = unit(part, logical, dim, cfg)
        if chunk % u and u % chunk:      # neither whole blocks nor an even part of one block
            noun = ("row", "column")[dim]
            return (f"{what}: TP {tp_size} gives each rank {chunk} {noun}s, but {stored.key} ({stored.dtype}) "
                    f"holds one value per {u} {noun}s: rank 1's slice would start at {noun} {chunk}, inside a "
                    f"block that rank also leaves (B05); use a TP size whose share is a multiple or a divisor of {u}")
    return None


def check_tp(cfg: ModelConfig, logical: tuple[Logical, ...], tp_size: int, tp_rank: int) -> None:
    """Refuse a TP size or rank this config cannot be split by, naming every offending tensor once
    (the first layer's key per tensor-table entry: the same entry fails the same way in every layer)."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"TP rank {tp_rank} of TP size {tp_size}: the size must be at least 1 and the "
                         f"rank in 0..{tp_size - 1}")
    if tp_size == 1:
        return
    problems = [f"TP {tp_size} does not divide {key} ({getattr(cfg, key)}): {why}"
                for key, why in WHOLE_PER_RANK if getattr(cfg, key) % tp_size]
    seen: set[tuple] = set()
    for t in logical:
        if (t.entry.key, t.shape) in seen:
            continue
        seen.add((t.entry.key, t.shape))
        problem = split_problem(t, cfg, tp_size)
        if problem:
            problems.append(problem)
    if problems:
        raise ValueError(f"cannot split this checkpoint for tensor parallelism {tp_size}:\n" + "\n".join(problems))


def part_index(logical: Logical, cfg: ModelConfig, tp_size: int, tp_rank: int) -> dict[str, TPSlice] | None:
    """Part role -> the slice this rank reads; None: the whole tensor (replicated, experts, or TP 1).
    Assumes check_tp passed: a share is whole elements of every part, or lies inside one element
    (then the part's slice is that element: every rank in the block reads its scale)."""
    dim = SPLIT_DIMS.get(logical.entry.tp)
    if dim is None or tp_size == 1:
        return None
    size = logical.shape[dim]
    chunk = -(-size // tp_size)             # `rows` / `cols`: tp_size divides the size (check_tp)
    fmt = load_quant().formats[logical.format]
    out = {}
    for part, stored in zip(fmt.parts, logical.parts):
        u = unit(part, logical, dim, cfg)
        lo, hi = min(tp_rank * chunk, size), min((tp_rank + 1) * chunk, size)
        out[stored.role] = TPSlice(dim, lo // u, -(-hi // u))     # covering elements
    return out
