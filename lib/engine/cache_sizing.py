"""The engine's use of the paged cache: sizing, admission room, and the DSpark context rings.

The rings are per-sequence slots like every other fixed piece of state (lib/runtime/paged_cache.py),
written only for committed positions, so they obey the same slots, free and preemption.
"""
from __future__ import annotations

import torch

from lib.runtime.paged_cache import PagedCache


def blocks_for(model, seqs: int, length: int) -> int:
    """Context blocks for `seqs` sequences of `length` positions each."""
    block = model.facts.block_tokens
    return seqs * -(-length // block)


def make_store(model, num_blocks: int, max_seqs: int, rings: bool, slack: int = 1) -> PagedCache:
    """`slack`: positions one step may leave uncommitted (1 + the draft block when speculating)."""
    return PagedCache(model, num_blocks, max_seqs=max_seqs, slack=slack, rings=rings)


def can_admit(store: PagedCache, seq_id, length: int, running: dict, reserve_blocks: int) -> bool:
    """Room for a new sequence's first `length` positions while every running sequence (`running`:
    id -> the positions it holds after this step) keeps room to grow by `reserve_blocks` blocks of
    block_tokens positions, the unit --num-blocks counts in (the admission gate, L26). The reserve is
    counted in positions, not blocks per entry group: a block of the ratio-m group covers
    m x block_tokens positions, so a group is asked for a block only by the sequences that the growth
    carries into a new one (a block per sequence in every group would hold back most of a coarse
    group, which has only cdiv(num_blocks, m) + max_seqs blocks)."""
    span = reserve_blocks * store.block_tokens
    grown = [(other, end + span) for other, end in running.items()]
    return store.can_fit([(seq_id, length), *grown])


def total_blocks(store: PagedCache) -> int:
    """Context capacity in blocks of block_tokens positions (what --num-blocks sets)."""
    return store.num_blocks


def draft_rings(store: PagedCache) -> tuple:
    """Each drafter stage's ring pools (read by the drafter through the draft batch's addressing)."""
    return store.rings


def write_draft_rows(store: PagedCache, seq_id, start: int, rows: list[torch.Tensor]) -> None:
    """rows[s] [n, head_dim]: stage s's ring rows for committed positions [start, start + n)."""
    store.write_ring(seq_id, start, rows)
