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


def can_admit(store: PagedCache, seq_id, length: int, reserve_blocks: int) -> bool:
    """Room for a new sequence's first `length` positions while keeping `reserve_blocks` blocks of
    every entry group free for the decodes already running (the admission gate, L26)."""
    return store.can_fit([(seq_id, length)]) and store.spare([(seq_id, length)]) >= reserve_blocks


def total_blocks(store: PagedCache) -> int:
    """Context capacity in blocks of block_tokens positions (what --num-blocks sets)."""
    return store.num_blocks


def draft_rings(store: PagedCache) -> tuple:
    """Each drafter stage's ring pools (read by the drafter through the draft batch's addressing)."""
    return store.rings


def write_draft_rows(store: PagedCache, seq_id, start: int, rows: list[torch.Tensor]) -> None:
    """rows[s] [n, head_dim]: stage s's ring rows for committed positions [start, start + n)."""
    store.write_ring(seq_id, start, rows)
