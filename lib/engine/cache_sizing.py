"""The engine's use of the paged cache: sizing, admission room, and the DSpark context rings.

The rings are position-keyed rows in the same tokens group as the raw KV (one pool per drafter
stage, "draft.<s>"), written only for committed positions and read back as each stage's last W
rows, so they obey the same block tables, release and free as everything else.
"""
from __future__ import annotations

import torch

from lib.runtime.paged_cache import PagedCache


def blocks_for(model, seqs: int, length: int) -> int:
    """Tokens-group blocks for `seqs` sequences of `length` positions each."""
    block = model.facts.block_tokens
    return seqs * -(-length // block)


def make_store(model, num_blocks: int, max_seqs: int, rings: bool) -> PagedCache:
    store = PagedCache.for_model(model, num_blocks=num_blocks, max_seqs=max_seqs)
    if rings:
        for layer in model.stages:
            store.add_rows(f"draft.{layer.stage}", model.cfg.head_dim, model.state_dtype,
                           horizon=model.cfg.sliding_window)
    return store


def can_admit(store: PagedCache, seq_id, length: int, reserve_blocks: int) -> bool:
    """Room for a new sequence's first `length` positions while keeping `reserve_blocks` tokens
    blocks free for the decodes already running (the admission gate, L26)."""
    used, total = store.usage()["tokens"]
    need = -(-length // store.block_tokens)
    return store.can_fit([(seq_id, length)]) and total - used - need >= reserve_blocks


def total_blocks(store: PagedCache) -> int:
    return store.usage()["tokens"][1]


def draft_rings(store: PagedCache, model, seq_id) -> list[torch.Tensor]:
    """Each stage's ring: rows of committed positions [L - W, L), oldest first."""
    length, window = store.length(seq_id), model.cfg.sliding_window
    return [store.read_rows(f"draft.{layer.stage}", seq_id, max(0, length - window), length)
            for layer in model.stages]


def write_draft_rows(store: PagedCache, model, seq_id, start: int, rows: list[torch.Tensor]) -> None:
    """rows[s] [n, head_dim]: stage s's ring rows for positions [start, start + n)."""
    for layer, values in zip(model.stages, rows):
        store.write_rows(f"draft.{layer.stage}", seq_id, start, values)
