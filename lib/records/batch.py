"""The batch record every generated `forward` takes: sequences' new tokens concatenated.

Token-parallel ops (linears, norms, MoE) see one flat [T] axis; ops that touch decode state
(compressors, indexer, attention) address it through `state`, an Addressing record of tensors
(row -> sequence, slots, block tables, slot mappings: lib/records/addressing.py), so they run
batch-wide with no loop over sequences. `seq_lens` / `starts` are host copies of the layout for
the host's own bookkeeping (scheduling, splitting outputs); ops never branch on them per sequence.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from lib.records.addressing import Addressing


class Batch(NamedTuple):
    tokens: torch.Tensor        # [T] int64 token ids, sequences concatenated
    positions: torch.Tensor     # [T] int64 absolute positions
    seq_lens: tuple[int, ...]   # new tokens per sequence
    starts: tuple[int, ...]     # cached tokens per sequence before this step
    logit_rows: torch.Tensor | None = None   # [R] rows whose logits to compute; None = every row
    state: Addressing | None = None          # where the sequences' decode state lives (PagedCache.address)
    engram_ids: torch.Tensor | None = None   # [T, Engram layers, C] int64 hash ids (V4.1; PagedCache.address)


def make_batch(chunks: list[list[int]], starts: list[int] | None = None, last_only: bool = False) -> Batch:
    """Batch from per-sequence token lists continuing at the given cache lengths (default 0).

    `last_only` asks for logits of each sequence's last new token only (decoding)."""
    starts = list(starts or [0] * len(chunks))
    if len(starts) != len(chunks):
        raise ValueError(f"{len(chunks)} sequences but {len(starts)} start positions")
    if any(len(c) == 0 for c in chunks):
        raise ValueError("every sequence in a batch needs at least one new token")
    tokens = torch.tensor([t for c in chunks for t in c], dtype=torch.int64)
    lens = tuple(len(c) for c in chunks)
    positions = positions_of(lens, starts)
    rows = None
    if last_only:
        rows = torch.tensor(lens, dtype=torch.int64).cumsum(0) - 1
    return Batch(tokens, positions, lens, tuple(starts), rows)


def positions_of(seq_lens, starts) -> torch.Tensor:
    """[T] int64 positions start_s .. start_s + n_s - 1 of every sequence, concatenated (built on
    the host from ints: no device op, no sync)."""
    return torch.tensor([s + i for n, s in zip(seq_lens, starts) for i in range(n)], dtype=torch.int64)
