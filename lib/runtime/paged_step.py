"""One forward over paged decode state: views -> `lib.runtime.loaded_model.step` -> write rows -> commit.

The generated forward only ever sees dense records (lib/records/decode_state.py); this is the one place that
moves them in and out of the block pools of a `lib.runtime.paged_cache.PagedCache`. Knows no scheduler: which
sequences step together, and how many speculative positions to keep, is the caller's choice.
"""
from __future__ import annotations

import lib.runtime.loaded_model as runtime
from lib.records.batch import Batch
from lib.guard.capability import section
from lib.runtime.paged_cache import CacheFull, PagedCache


def paged_step(model, batch: Batch, store: PagedCache, seq_ids: list, *, commit: bool = True, **step_kwargs):
    """Step `batch` (sequence s continues store.length(seq_ids[s])) and store its new rows.

    Blocks for every new position are allocated first, for the whole batch or not at all
    (CacheFull). With `commit` each sequence's length becomes start + n; with commit=False the
    rows are stored but uncommitted, and the caller commits what it accepts with set_length
    (speculative verify). Returns step's result without the caches: (logits, *rest).
    """
    if len(seq_ids) != len(batch.seq_lens):
        raise ValueError(f"{len(seq_ids)} sequence ids for a batch of {len(batch.seq_lens)} sequences")
    for seq_id, start in zip(seq_ids, batch.starts):
        if store.length(seq_id) != start:
            raise ValueError(f"sequence {seq_id!r}: the cache holds {store.length(seq_id)} committed positions but "
                             f"the batch continues at position {start}")
    ends = [start + n for start, n in zip(batch.starts, batch.seq_lens)]
    if not store.can_fit(list(zip(seq_ids, ends))):
        raise CacheFull(f"a batch of {len(seq_ids)} sequences up to lengths {ends} does not fit: blocks used/total "
                        f"{store.usage()}; nothing was allocated")
    with section("paged cache"):
        for seq_id, end in zip(seq_ids, ends):
            store.ensure(seq_id, end)
        views = store.views(seq_ids)
    logits, caches, *rest = runtime.step(model, batch, views, **step_kwargs)
    with section("paged cache"):
        store.write(seq_ids, batch.starts, batch.seq_lens, caches)
    if commit:
        for seq_id, end in zip(seq_ids, ends):
            store.set_length(seq_id, end)
    return (logits, *rest)
