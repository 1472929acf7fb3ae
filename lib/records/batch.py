"""The batch record every generated `forward` takes: sequences' new tokens concatenated.

Token-parallel ops (linears, norms, MoE) see one flat [T] axis; ops that touch per-sequence
state (compressors, indexer, attention) walk `segments()`. Sequence layout is host metadata
(Python ints), so reading it never syncs the device.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple

import torch


class Segment(NamedTuple):
    index: int      # sequence number within the batch
    lo: int         # first row of this sequence in the flat token axis
    hi: int         # one past its last row
    start: int      # tokens already in this sequence's cache (= position of row lo)


class Batch(NamedTuple):
    tokens: torch.Tensor        # [T] int64 token ids, sequences concatenated
    positions: torch.Tensor     # [T] int64 absolute positions
    seq_lens: tuple[int, ...]   # new tokens per sequence
    starts: tuple[int, ...]     # cached tokens per sequence before this step
    logit_rows: torch.Tensor | None = None   # [R] rows whose logits to compute; None = every row

    def segments(self) -> Iterator[Segment]:
        lo = 0
        for i, (n, start) in enumerate(zip(self.seq_lens, self.starts)):
            yield Segment(i, lo, lo + n, start)
            lo += n


def make_batch(chunks: list[list[int]], starts: list[int] | None = None, last_only: bool = False) -> Batch:
    """Batch from per-sequence token lists continuing at the given cache lengths (default 0).

    `last_only` asks for logits of each sequence's last new token only (decoding)."""
    starts = list(starts or [0] * len(chunks))
    if len(starts) != len(chunks):
        raise ValueError(f"{len(chunks)} sequences but {len(starts)} start positions")
    if any(len(c) == 0 for c in chunks):
        raise ValueError("every sequence in a batch needs at least one new token")
    tokens = torch.tensor([t for c in chunks for t in c], dtype=torch.int64)
    positions = torch.tensor([s + i for c, s in zip(chunks, starts) for i in range(len(c))], dtype=torch.int64)
    lens = tuple(len(c) for c in chunks)
    rows = None
    if last_only:
        ends = [sum(lens[: i + 1]) - 1 for i in range(len(lens))]
        rows = torch.tensor(ends, dtype=torch.int64)
    return Batch(tokens, positions, lens, tuple(starts), rows)
