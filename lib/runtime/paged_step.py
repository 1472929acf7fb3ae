"""One forward over paged decode state: allocate, address, run the generated forward, commit.

The generated forward takes the cache's pools and a batch whose Addressing names every sequence's
slot and block tables (lib/runtime/paged_cache.py); its ops write the new rows in place. Knows no
scheduler: which sequences step together, and how many speculative positions to keep, is the
caller's choice.
"""
from __future__ import annotations

import torch

from lib.guard.capability import section
from lib.records.batch import Batch, make_batch
from lib.runtime.paged_cache import CacheFull, PagedCache


def paged_step(model, batch: Batch, store: PagedCache, seq_ids: list, *, commit: bool = True,
               with_hidden: bool = False, graph=None):
    """Step `batch` (sequence s continues store.length(seq_ids[s])) and store its new rows.

    Blocks for every new position are allocated first, for the whole batch or not at all
    (CacheFull). With `commit` each sequence's length becomes start + n; with commit=False the
    rows are stored but uncommitted, and the caller commits what it accepts with set_length
    (speculative verify). Returns (logits,), or (logits, main_hidden) with `with_hidden`:
    main_hidden [T, k*d] the DSpark context features of every row (None without a drafter).
    With a `graph` (lib/runtime/step_graph.py StepGraph) the step runs as that bucket's exported
    graph: addressed at its static shapes, padded, and the padding's rows dropped from the outputs.
    """
    if len(seq_ids) != len(batch.seq_lens):
        raise ValueError(f"{len(seq_ids)} sequence ids for a batch of {len(batch.seq_lens)} sequences")
    ends = [start + n for start, n in zip(batch.starts, batch.seq_lens)]
    for seq_id, start in zip(seq_ids, batch.starts):
        if store.length(seq_id) != start:
            raise ValueError(f"sequence {seq_id!r}: the cache holds {store.length(seq_id)} committed positions but "
                             f"the batch continues at position {start}")
    if not store.can_fit(list(zip(seq_ids, ends))):
        raise CacheFull(f"a batch of {len(seq_ids)} sequences up to lengths {ends} does not fit: blocks used/total "
                        f"{store.usage()}; nothing was allocated")
    real = sum(batch.seq_lens)
    with section("paged cache"):
        for seq_id, end in zip(seq_ids, ends):
            store.ensure(seq_id, end)
        picked = batch.logit_rows
        if graph is not None:           # a graph computes every row's logits (one static shape per bucket)
            batch = batch._replace(logit_rows=None)
        batch = store.address(batch, seq_ids, None if graph is None else graph.shape)
    if graph is None:
        with torch.inference_mode():
            logits, _, hidden = model.forward(model.params, batch, store.layers, model.cfg, model.rope)
    else:
        logits, hidden = graph(batch, store)
        logits = logits[:real] if picked is None else logits.index_select(0, picked)
        hidden = None if hidden is None else hidden[:real]
    if commit:
        for seq_id, end in zip(seq_ids, ends):
            store.set_length(seq_id, end)
    return (logits, hidden) if with_hidden else (logits,)


def prefill_logits(model, ids: list[int], chunk: int | None = None, *, with_hidden: bool = False):
    """Logits [len(ids), V] of every position of one sequence (and its main_hidden with
    `with_hidden`), prefilled in chunks of `chunk` tokens (default: one chunk), in a cache of its own."""
    if not ids:
        raise ValueError("no token ids given")
    store = PagedCache.for_lengths(model, [len(ids)])
    store.add(0)
    size = chunk or len(ids)
    logits, hidden = [], []
    for pos in range(0, len(ids), size):
        out = paged_step(model, make_batch([ids[pos:pos + size]], [pos]), store, [0], with_hidden=True)
        logits.append(out[0])
        hidden.append(out[1])
    logits = torch.cat(logits)
    if not with_hidden:
        return logits
    return logits, (None if hidden[0] is None else torch.cat(hidden))
