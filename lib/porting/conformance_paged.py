"""Conformance over paged decode state: the device's whole-model runs, and what only paged state can get wrong.

Decode state has one path: pools addressed through block tables (lib/runtime/paged_cache.py), so
there is no dense state to restore. A run teacher-forces the reference's tokens through
`paged_step` with the backend's own block geometry, and three properties are checked on it:

- placement: the sequence behind another one (a staggered cache: its blocks at other physical ids,
  its entry groups' tables different from each other, as in a serving cache) and alone in a fresh
  cache gives identical logits. Addresses must never change numbers; B12-B14 read rows that hold
  other data in the staggered cache (in a fresh one every group hands out the same block ids);
- batch: four copies in one batch agree bit for bit (uninitialised grouped-matmul rows, B10);
- rewind: a verify step stored without committing, then rewound, leaves every row the committed
  length can read (`PagedCache.live_rows`) as it was: rejected drafts leave no trace.

And the state itself: those live rows against the reference's at the same length, each read
through its own cache's tables (entries slotted wrongly, B13, are rows never written there).

The reference's recorded runs step through `recording_step`, which gives every recorded attention
call a copy of the pools it read (the live pools are written in place by that step and later ones).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from lib.records.addressing import PagedSites
from lib.records.batch import make_batch
from lib.records.decode_state import CompressorPools, LayerPools, items_for
from lib.runtime.paged_cache import PagedCache
from lib.runtime.paged_step import paged_step

SPACER = "spacer"
VERIFY_WIDTH = 6            # the verify a rewind check stores: the anchor + a DSpark block of 5


def new_store(model, lengths: list[int], *, sites: PagedSites = PagedSites(), slack: int = 1,
              staggered: bool = True) -> tuple[PagedCache, list[int]]:
    """A cache sized to sequences of `lengths` (ids 0, 1, ...), so a slot that strays outside its
    sequence's blocks fails loudly. `staggered`: a spacer sequence first takes one block of the
    smallest ratio's entry group and none of the others', so every later sequence has different
    block ids in each group."""
    block = model.facts.block_tokens
    store = PagedCache(model, sum(-(-n // block) for n in lengths) + 1, max_seqs=len(lengths) + staggered,
                       slack=slack, sites=sites)
    if staggered and store.ratios:
        store.add(SPACER)
        store.ensure(SPACER, store.ratios[0])
    for seq in range(len(lengths)):
        store.add(seq)
    return store, list(range(len(lengths)))


class PagedRun(NamedTuple):
    logits: list[torch.Tensor] | None   # [copies, V] last-row logits after the prompt and each forced token
    rewound_clean: bool | None          # a rewound verify left the live rows as they were (None: none made)
    error: str | None                   # a slot mapping gone wrong can index outside its pool (B12, B13)
    state: dict | None = None           # sequence 0's live rows at the end (PagedCache.live_rows)


def paged_run(model, prompt: list[int], tokens: list[int], *, copies: int = 1, sites: PagedSites = PagedSites(),
              staggered: bool = True, rewind_at: int | None = None) -> PagedRun:
    """Logits after the prompt and after each forced token but the last, one position per step; with
    `rewind_at` k a junk verify is stored and rewound before forced token k. An index error is a
    finding of the report, not a crash of it."""
    try:
        return _teacher_forced(model, prompt, tokens, copies, sites, staggered, rewind_at)
    except (IndexError, RuntimeError) as err:
        return PagedRun(None, None, f"{type(err).__name__}: {err}")


def _teacher_forced(model, prompt, tokens, copies, sites, staggered, rewind_at) -> PagedRun:
    total = len(prompt) + len(tokens) + VERIFY_WIDTH
    store, seqs = new_store(model, [total] * copies, sites=sites, staggered=staggered,
                            slack=1 if rewind_at is None else VERIFY_WIDTH)
    (logits,) = paged_step(model, make_batch([prompt] * copies, last_only=True), store, seqs)
    out, pos, clean = [logits], len(prompt), None
    for k, token in enumerate(tokens[:-1]):
        if k == rewind_at:
            clean = rewound_verify(model, store, seqs, pos)
        (logits,) = paged_step(model, make_batch([[token]] * copies, [pos] * copies, last_only=True), store, seqs)
        out.append(logits)
        pos += 1
    return PagedRun(out, clean, None, store.live_rows(seqs[0]))


def rewound_verify(model, store: PagedCache, seqs: list, pos: int) -> bool:
    """Store a verify of VERIFY_WIDTH junk tokens at `pos` without committing, rewind to `pos`:
    whether every live row of every sequence is bit for bit what it was."""
    before = [store.live_rows(s) for s in seqs]
    gen = torch.Generator().manual_seed(pos)
    junk = torch.randint(16, model.cfg.vocab_size, (VERIFY_WIDTH,), generator=gen).tolist()
    paged_step(model, make_batch([junk] * len(seqs), [pos] * len(seqs)), store, seqs, commit=False)
    for s in seqs:
        store.set_length(s, pos)
    after = [store.live_rows(s) for s in seqs]
    return all(b.keys() == a.keys() and all(torch.equal(b[k], a[k]) for k in b) for b, a in zip(before, after))


# A state row passes when it is nearer the reference's row than to nothing: the device's rounding
# keeps rows within a few percent (ascend910's W4A8 experts, compounded over the layers before:
# 0.08 median measured on the tiny model), a row read from another slot or never written is at
# 1.0 or more (B13: every entry row).
STATE_ROW_BUDGET = 0.5


def state_check(reference: dict, state: dict | None, error: str | None, check_type):
    """The device's live rows against the reference's at the same committed length, each read
    through its own cache's block tables: the median relative row error of every item (window
    rings, compressor rings, entries of every layer) within STATE_ROW_BUDGET."""
    name = "paged state vs the reference's (median row error, worst item)"
    if error is not None or state is None:
        return check_type(name, f"not run: {(error or 'no state')[:50]}", f"<= {STATE_ROW_BUDGET}", False)
    if state.keys() != reference.keys() or any(state[k].shape != reference[k].shape for k in reference):
        return check_type(name, "other items or rows than the reference's", f"<= {STATE_ROW_BUDGET}", False)
    worst, where = 0.0, ""
    for key, want in reference.items():
        if want.numel():
            got, want = state[key].float(), want.float()
            err = (got - want).norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-12)
            err = torch.where(torch.isfinite(got).all(-1), err, float("inf")).median().item()
            worst, where = max((worst, where), (err, key))
    return check_type(name, f"{worst:.4f} ({where})", f"<= {STATE_ROW_BUDGET}", worst <= STATE_ROW_BUDGET)


def placement_check(first: PagedRun, fresh: PagedRun, check_type):
    """first: the sequence behind the spacer (staggered); fresh: the same alone in a fresh cache."""
    name = "staggered cache == fresh cache (teacher-forced logits, bit for bit)"
    failed = first.error or fresh.error
    if failed is not None:
        return check_type(name, f"not run: {failed[:50]}", "identical", False)
    worst = max((a - b).abs().max().item() for a, b in zip(first.logits, fresh.logits))
    same = all(torch.equal(a, b) for a, b in zip(first.logits, fresh.logits))
    return check_type(name, "identical" if same else f"max |delta| {worst:.3g}", "identical", same)


def batch_checks(batched: PagedRun, check_type) -> list:
    """batched: four copies in a staggered cache with a rewound verify midway."""
    names = ("4x batch replicas (a rewound verify midway): identical to each other",
             "rewound verify: every live row unchanged")
    if batched.error is not None:
        return [check_type(name, f"not run: {batched.error[:50]}", "identical", False) for name in names]
    rows_agree = all(torch.equal(b[i], b[0]) for b in batched.logits for i in range(1, b.shape[0]))
    return [check_type(names[0], "identical" if rows_agree else "differ", "identical", rows_agree),
            check_type(names[1], "unchanged" if batched.rewound_clean else "changed", "unchanged",
                       bool(batched.rewound_clean))]


# ---- the reference's recorded steps ---------------------------------------------------------------
def copy_pools(pools: LayerPools, state=(), kind: str = "", dtype: torch.dtype | None = None) -> LayerPools:
    """A copy of one layer's pools; with `dtype`, every item the declaration (spec/state.yaml) keeps
    in the compute dtype is cast to it (the compressors' projection rings stay fp32)."""
    compute = {item.name for item in items_for(state, kind) if item.dtype == "compute"} if dtype else set()

    def cast(name: str, t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype if name in compute else t.dtype, copy=True)

    def comp(prefix: str, c: CompressorPools | None) -> CompressorPools | None:
        return None if c is None else CompressorPools(None if c.state is None else cast(f"{prefix}.state", c.state),
                                                      cast(f"{prefix}.entries", c.entries), c.ratio)
    window = None if pools.window is None else cast("window", pools.window)
    return LayerPools(window, comp("comp", pools.comp), comp("index", pools.index))


# the generated dispatch tables whose calls are sub-layers: V4's attention, V4.1's, and the MoE FFN of both
SUBLAYER_TABLES = {"ATTENTION": "attention", "ATTENTION_V41": "attention", "FFN": "ffn"}


def recording_step(model, store: PagedCache, batch, seq_ids: list, recorded: list, keep: bool = True) -> torch.Tensor:
    """One paged step of a recording reference (`recorded`: its rendering's RECORDED list). Its
    attention calls get a copy of the pools as they were when called: before the step, but a V4.1 layer that
    reuses a KV source's pools reads them as the source left them this step (only the source writes them,
    before it); without `keep` the
    step's records are dropped (a long prefill's early chunks)."""
    start = len(recorded)
    before = [copy_pools(p) for p in store.layers] if keep else None
    (logits,) = paged_step(model, batch, store, seq_ids)
    if not keep:
        del recorded[start:]
        return logits
    where = {layer.index: i for i, layer in enumerate(model.layers)}
    for k in range(start, len(recorded)):
        table, kind, args, kwargs, out = recorded[k]
        if SUBLAYER_TABLES.get(table) == "attention":    # (lp, h, batch, cache, [selection, candidates,] layer, ...)
            layer = args[-3]
            pools = before[where[layer.index]]
            if layer.ratio and not layer.kv_source:      # V4.1: its KV source wrote this step's entries before it read
                now = copy_pools(store.layers[where[layer.index]])
                pools = pools._replace(comp=now.comp, index=now.index)
            recorded[k] = (table, kind, (*args[:3], pools, *args[4:]), kwargs, out)
    return logits
