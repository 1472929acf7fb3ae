"""Paged decode state (lib/runtime/paged_cache.py): slot mapping, the declared pools, paged decode ==
long prefill across block boundaries, rewind, chunking, batching, block accounting, B12-B14.

Everything goes through make_tiny -> load_model -> the generated forward, as users run it (B21).
The tiny model's window is 16 and its ratios 4 / 8; cpu blocks are 16 tokens, 310P's are 32-token
physical blocks addressed as 16 logical blocks of 2 (L19), so the prompts below cross every kind
of boundary.
"""
from __future__ import annotations

import re

import pytest
import torch

from helpers import prompt_ids
from lib.records.addressing import PagedSites, physical_slots
from lib.records.batch import make_batch
from lib.runtime.loaded_model import load_model
from lib.runtime.paged_cache import CacheFull, PagedCache
from lib.runtime.paged_step import paged_step, prefill_logits
from spec.profile import load_profile, profile_path
from spec.yamlio import SpecError

TOL = 1e-5          # the cpu reference's chunking tolerance (tests/backends/test_reference.py)


@pytest.fixture(scope="module")
def models(tiny_ckpt):
    return {b: load_model(tiny_ckpt, b) for b in ("cpu", "ascend310p")}


def _store(model, num_blocks: int = 64, max_seqs: int = 4, seqs=("s",), sites=PagedSites(), slack: int = 6) -> PagedCache:
    store = PagedCache(model, num_blocks, max_seqs=max_seqs, slack=slack, sites=sites)
    for s in seqs:
        store.add(s)
    return store


def _last(model, store, seq, ids: list[int]) -> torch.Tensor:
    """Paged logits of the last of `ids`, continuing the sequence's committed length."""
    start = store.length(seq)
    (logits,) = paged_step(model, make_batch([ids], [start], last_only=True), store, [seq])
    return logits[-1]


# ---- slot mapping -------------------------------------------------------------------------------
def test_physical_slots_lay_logical_blocks_out_by_physical_block():
    """310P (L19): a physical block b appears as logical ids 16b..16b+15, each of 2 positions;
    tables are per batch sequence [S, n] and rows are looked up per (sequence, position)."""
    blocks = [3, 0]                                               # the sequence's 1st block is physical 3
    table = torch.tensor([[b * 16 + r for b in blocks for r in range(16)]], dtype=torch.int32)
    q = torch.arange(64, dtype=torch.int64)
    slots = physical_slots(table, torch.zeros_like(q), q, 32, 2)
    assert slots.dtype == torch.int64
    assert slots.tolist() == [blocks[p // 32] * 32 + p % 32 for p in range(64)]
    for p in (0, 1, 2, 31, 33, 62):                                # the formula itself, position by position
        logical = int(table[0, p // 2])
        assert slots[p] == (logical // 16) * 32 + (logical % 16) * 2 + p % 2
    two = torch.tensor([[0, 1, 2], [5, 4, -1]], dtype=torch.int32)  # 16/16: one entry per block; -1 padding
    seq = torch.tensor([0, 1, 1, 1])
    assert physical_slots(two, seq, torch.tensor([40, 0, 17, 40]), 16, 16).tolist() == [40, 80, 65, 8]   # padding: block 0


def test_cache_geometry_is_a_profile_fact(tmp_path):
    assert load_profile("ascend310p").cache.block_tokens == 32
    assert load_profile("ascend310p").cache.logical_block_tokens == 2
    assert "L19" in load_profile("ascend310p").cache.lessons
    assert load_profile("cpu").cache.block_tokens == 16
    source = profile_path("cpu").read_text()
    bad = tmp_path / "profile.yaml"
    bad.write_text(re.sub(r"^cache:.*$", "", source, flags=re.M))
    with pytest.raises(SpecError, match="missing required key 'cache'"):
        load_profile("cpu", bad)
    bad.write_text(source.replace("logical_block_tokens: 16", "logical_block_tokens: 5"))
    with pytest.raises(SpecError, match=r"profile.yaml:\d+: cache block_tokens 16 must be a positive multiple of "
                                        r"logical_block_tokens 5"):
        load_profile("cpu", bad)


# ---- the declared pools -------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["cpu", "ascend310p"])
def test_pools_are_what_the_state_declaration_says(models, backend):
    """Windows and compressor rings: one slot per sequence plus a trash slot (compressor state: A | Z
    rows, after an unused slot 0), rows from spec/state.yaml (W + slack; 2m or m + slack); entries
    and keys: block pools of each ratio,
    cdiv(num_blocks, m) + max_seqs blocks and a trash block. Nothing else is allocated."""
    model = models[backend]
    cfg, p = model.cfg, model.facts.block_tokens
    store = _store(model, num_blocks=8, max_seqs=3, seqs=(), slack=6)
    dtype = model.state_dtype
    for layer, pools in zip(model.layers, store.layers):
        assert pools.window.shape == (4, cfg.sliding_window + 6, cfg.head_dim) and pools.window.dtype == dtype
        if layer.attention == "swa":
            assert pools.comp is None and pools.index is None
            continue
        m = layer.ratio
        span = 2 * m if layer.attention == "csa" else m
        width = 2 * cfg.head_dim if layer.attention == "csa" else cfg.head_dim
        assert pools.comp.state.shape == (5, span + 6, 2 * width) and pools.comp.state.dtype == torch.float32
        assert pools.comp.kv.shape == pools.comp.gate.shape == (4, span + 6, width)          # views of slots 1..
        assert pools.comp.kv.data_ptr() == pools.comp.state[1].data_ptr()
        assert pools.comp.gate.data_ptr() == pools.comp.state[1, 0, width:].data_ptr()
        assert pools.comp.entries.shape == ((-(-8 // m) + 3 + 1) * p, cfg.head_dim) and pools.comp.entries.dtype == dtype
        if layer.attention == "csa":
            assert pools.index.entries.shape == ((-(-8 // m) + 3 + 1) * p, cfg.index_head_dim)
    per_token = sum((cfg.head_dim + (cfg.index_head_dim if l.attention == "csa" else 0)) / l.ratio
                    for l in model.layers if l.ratio) * torch.empty(0, dtype=dtype).element_size()
    assert store.bytes_per_token() == per_token
    assert store.total_bytes() == sum(t.numel() * t.element_size() for pools in store.layers
                                      for t in (pools.window, *(pools.comp or ())[:2], *(pools.index or ())[:2])
                                      if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("backend, lengths", [("ascend310p", (1, 2, 3, 31, 32, 33, 63, 64, 65)),
                                              ("cpu", (15, 16, 17))])
def test_teacher_forcing_across_block_boundaries(models, backend, lengths):
    """B12's detector: paged prefill(n) + one paged decode of token n == paged prefill(n + 1)."""
    model = models[backend]
    budget = load_profile(backend).conformance["logits"].budget if backend != "cpu" else TOL
    ids = prompt_ids(max(lengths) + 1, model.cfg.vocab_size, seed=4)
    for n in lengths:
        store = _store(model, seqs=("decode", "prefill"))
        _last(model, store, "decode", ids[:n])
        decoded = _last(model, store, "decode", ids[n:n + 1])
        prefilled = _last(model, store, "prefill", ids[:n + 1])
        err = (decoded - prefilled).abs().max().item()
        assert err <= budget, f"{backend} n={n}: |delta logit| {err} > {budget}"
        assert torch.argmax(decoded) == torch.argmax(prefilled), f"{backend} n={n}: top-1 differs"


def test_rewind_after_rejected_drafts(models):
    """Prefill 20, verify 6 drafted positions uncommitted (windows of ratio 4 and 8 complete at
    position 23, inside the rejected span), keep 1: the rest equals never having speculated."""
    model = models["cpu"]
    ids = prompt_ids(20, model.cfg.vocab_size, seed=5)
    plain = _store(model)
    logits = [_last(model, plain, "s", ids)]
    tokens = []
    for _ in range(10):
        tokens.append(int(torch.argmax(logits[-1])))
        logits.append(_last(model, plain, "s", tokens[-1:]))

    spec = _store(model)
    _last(model, spec, "s", ids)
    drafts = [tokens[0]] + prompt_ids(5, model.cfg.vocab_size, seed=6)      # first right, then junk
    (verify,) = paged_step(model, make_batch([drafts], [20]), spec, ["s"], commit=False)
    assert spec.length("s") == 20                                          # nothing committed yet
    spec.set_length("s", 21)                                               # one draft accepted
    assert torch.equal(verify[0], logits[1])
    for i in range(1, 10):
        assert torch.equal(_last(model, spec, "s", tokens[i:i + 1]), logits[i + 1]), f"step {i}"
    with pytest.raises(ValueError, match="cannot commit length 40"):
        spec.set_length("s", 40)                                           # never written
    assert torch.equal(prefill_logits(model, ids + tokens[:10])[-1], logits[10])


def test_chunked_prefill_through_paged_step_is_invariant(models):
    """L24 on the paged path: chunks 1, 7, 64 and all at once give the same logits."""
    model = models["cpu"]
    ids = prompt_ids(70, model.cfg.vocab_size, seed=7)
    results = []
    for chunk in (70, 1, 7, 64):
        store, out = _store(model), []
        for lo in range(0, len(ids), chunk):
            (logits,) = paged_step(model, make_batch([ids[lo:lo + chunk]], [lo]), store, ["s"])
            out.append(logits)
        results.append(torch.cat(out))
    for chunk, got in zip((1, 7, 64), results[1:]):
        assert (got - results[0]).abs().max().item() <= TOL, f"chunk {chunk}"


# ---- batching and block accounting ----------------------------------------------------------------
def test_interleaved_sequences_equal_their_solo_runs_and_free_returns_blocks(models):
    model = models["cpu"]
    vocab = model.cfg.vocab_size
    a, b = prompt_ids(40, vocab, seed=8), prompt_ids(25, vocab, seed=9)
    solo = {}
    for name, ids in (("a", a), ("b", b)):
        store = _store(model, seqs=(name,))
        (solo[name],) = paged_step(model, make_batch([ids]), store, [name])
    store = _store(model, seqs=("a", "b"))
    # a prefills 29 next to b's 10, then a's single decode steps next to 7-token chunks of b
    first, = paged_step(model, make_batch([a[:29], b[:10]]), store, ["a", "b"])
    got_a, got_b = [first[:29]], [first[29:]]
    for pos_a, pos_b in ((29, 10), (30, 17)):
        out, = paged_step(model, make_batch([a[pos_a:pos_a + 1], b[pos_b:pos_b + 7]], [pos_a, pos_b]),
                          store, ["a", "b"])
        got_a.append(out[:1])
        got_b.append(out[1:])
    for pos in range(31, 40):
        out, = paged_step(model, make_batch([a[pos:pos + 1]], [pos]), store, ["a"])
        got_a.append(out)
    assert store.length("a") == 40 and store.length("b") == 24
    assert (torch.cat(got_a) - solo["a"]).abs().max().item() <= TOL
    assert (torch.cat(got_b) - solo["b"][:24]).abs().max().item() <= TOL
    assert store.usage()["c4"][0] == 1 + 1 and store.usage()["c8"][0] == 1 + 1   # 10 / 6 and 5 / 3 entries
    assert store.usage()["slots"] == (2, 4)
    store.free("a")
    store.free("b")
    assert all(used == 0 for used, _ in store.usage().values())


@pytest.mark.parametrize("backend", ["cpu", "ascend310p"])
def test_a_forked_sequence_continues_as_its_source_does(models, backend):
    """fork: the copy reads back every row its source reads (rings, the compressors' unfinished windows, entries of
    both ratios), in blocks of its own; both continue exactly alike, as one whole prefill does, and writing the
    copy leaves the source's rows as they were."""
    model = models[backend]
    ids = prompt_ids(70, model.cfg.vocab_size, seed=12)
    store = _store(model, seqs=("pad", "a", "b"))
    store.ensure("pad", 20)                      # a's blocks are not block 0 of either group
    paged_step(model, make_batch([ids[:45]]), store, ["a"])
    source = store.live_rows("a")
    store.fork("a", "b")
    assert store.length("b") == 45
    for name, rows in store.live_rows("b").items():
        assert torch.equal(rows, source[name]), name
    assert not set(store._seq("a").tables[4]) & set(store._seq("b").tables[4])
    got_b = _last(model, store, "b", ids[45:])
    assert all(torch.equal(rows, source[name]) for name, rows in store.live_rows("a").items())
    got_a = _last(model, store, "a", ids[45:])
    assert torch.equal(got_a, got_b)
    assert (got_a - _last_of_prefill(model, ids)).abs().max().item() <= TOL
    with pytest.raises(ValueError, match="already has 70 positions written"):
        store.fork("b", "a")


def test_cache_full_names_the_shortfall_and_allocates_nothing(tiny_ckpt):
    model = load_model(tiny_ckpt, "cpu")
    store = PagedCache(model, 8, max_seqs=2)
    assert store.usage() == {"slots": (0, 2), "c4": (0, 4), "c8": (0, 3)}   # cdiv(8, m) + max_seqs
    store.add("a")
    store.add("b")
    store.ensure("a", 4 * 16 * 4)                                 # 256 positions: all 4 c4 blocks (64 entries)
    before = store.usage()
    assert before["c4"] == (4, 4) and before["c8"] == (2, 3)
    assert not store.can_fit([("b", 4)]) and store.can_fit([("b", 3)])
    with pytest.raises(CacheFull, match=r"sequence 'b' needs 1 c4 blocks \(0 of 4 free\).*nothing was allocated"):
        store.ensure("b", 4)
    assert store.usage() == before                                # c8 was not touched either
    with pytest.raises(CacheFull, match="maximum of 2"):
        store.add("c")
    store.free("a")
    store.ensure("b", 4)
    assert store.usage() == {"slots": (1, 2), "c4": (1, 4), "c8": (0, 3)}


def test_memory_grows_with_compressed_entries_only(models):
    """A long sequence holds a fixed slot (its windows and rings) plus blocks of entries: at 1,000
    positions 250 / 16 c4 blocks and 125 / 16 c8 blocks, nothing per raw position."""
    model = models["cpu"]
    store = _store(model, num_blocks=80, max_seqs=1)
    ids = prompt_ids(1000, model.cfg.vocab_size, seed=10)
    for lo in range(0, 1000, 250):
        (logits,) = paged_step(model, make_batch([ids[lo:lo + 250]], [lo]), store, ["s"])
    assert store.usage()["c4"][0] == -(-250 // 16) and store.usage()["c8"][0] == -(-125 // 16)
    assert torch.equal(logits[-1], _last_of_prefill(model, ids))


def _last_of_prefill(model, ids):
    return prefill_logits(model, ids, chunk=250)[-1]


def test_drafter_rings_round_trip_on_the_hybrid_geometry(tiny_ckpt):
    """The drafter's rings: per-sequence slots of W rows written for committed positions; a ring
    keeps the last W positions whatever was written before."""
    model = load_model(tiny_ckpt, "ascend310p")
    store = PagedCache(model, 4, max_seqs=2, rings=True)
    w, d = model.cfg.sliding_window, model.cfg.head_dim
    assert len(store.rings) == len(model.stages) and store.rings[0].window.shape == (3, w, d)
    store.add("b")
    store.add("a")
    values = [torch.arange(40 * d, dtype=torch.float16).reshape(40, d) + s for s in range(len(model.stages))]
    store.write_ring("a", 0, [v[:30] for v in values])
    store.write_ring("a", 30, [v[30:] for v in values])
    store.ensure("a", 40)
    store.address(make_batch([[1] * 40]), ["a"])                   # marks 40 positions written
    store.set_length("a", 40)
    rows = store.live_rows("a")
    for s, v in enumerate(values):
        assert torch.equal(rows[f"stage{s}.window"], v[40 - w:])
    assert store.rings[0].window[0].abs().sum() == 0               # b's slot (0) untouched
    with pytest.raises(KeyError, match="not in the cache"):
        store.write_ring("c", 0, values)


# ---- injected field bugs ----------------------------------------------------------------------------
def _teacher_forced(model, ids: list[int], steps: int, sites=PagedSites()) -> list[torch.Tensor]:
    """A pool sized to the run, so a stray slot falls outside it instead of landing unnoticed. A
    short sequence first takes block 0 of the ratio-4 group only, so the sequence under test holds
    different blocks in its two groups (B14 reads the other group's table)."""
    total = len(ids) + steps
    store = _store(model, num_blocks=-(-total // model.facts.block_tokens) + 1, max_seqs=2, seqs=("pad", "s"),
                   sites=sites)
    store.ensure("pad", 4)                                         # one c4 block, no c8 block
    out = [_last(model, store, "s", ids)]
    for pos in range(len(ids), total):
        out.append(_last(model, store, "s", [int(ids[pos % len(ids)])]))
    return out


@pytest.mark.parametrize("bug", ["B12", "B13", "B14"])
def test_injected_paging_bugs_are_caught(models, bug):
    """Each bug's run against the correct run of the same backend: logits differ, or a slot falls
    outside its pool."""
    from lib.porting.faults import injection

    model = models["ascend310p"]
    ids = prompt_ids(70, model.cfg.vocab_size, seed=11)
    right = _teacher_forced(model, ids, 4)
    with injection(bug, "ascend310p") as fault:
        try:
            wrong = _teacher_forced(model, ids, 4, fault.paged)
            caught = not all(torch.equal(a, b) for a, b in zip(right, wrong))
        except (IndexError, RuntimeError):                        # a slot outside its pool or table
            caught = True
    assert caught, f"{bug} went unnoticed"


@pytest.mark.parametrize("backend", ["ascend310p", "cpu"])
def test_step_rows_are_what_each_layer_computed_and_built_once(models, backend):
    """The rows a step's layers read (lib/records/addressing.py with_step_rows) equal the per-call address
    arithmetic on a mixed batch (two sequences at different lengths, one mid-window), on the 310P hybrid
    block geometry and the reference's; a key the step did not build is refused by name."""
    model = models[backend]
    store = PagedCache.for_lengths(model, [40, 40])
    for s in (0, 1):
        store.add(s)
        store.ensure(s, 40)
    vocab = model.cfg.vocab_size
    paged_step(model, make_batch([prompt_ids(13, vocab, 3), prompt_ids(6, vocab, 4)], [0, 0]), store, [0, 1])
    batch = store.address(make_batch([prompt_ids(3, vocab, 5), prompt_ids(1, vocab, 6)], [13, 6]), [0, 1])
    addr, pos, w = batch.state, batch.positions, model.cfg.sliding_window
    seq = addr.row_seq
    window = pos[:, None] - w + 1 + torch.arange(w)
    for (kind, *key), rows in addr.rows.items():
        if kind == "ring":
            assert torch.equal(rows, addr.ring_writes(pos, key[0]))
        elif kind == "window":
            assert torch.equal(rows, addr.sources(seq[:, None].expand_as(window), window, key[1]))
        elif kind == "window_mask":
            assert torch.equal(rows, window >= 0)
        elif kind == "span":
            m, n, r = key
            q = (addr.writes[m].ids * m - (n - m))[:, None] + torch.arange(n)
            assert torch.equal(addr.rows[("span_pos", m, n)], q)
            assert torch.equal(addr.rows[("span_valid", m, n)], q >= 0)
            assert torch.equal(rows, addr.sources(addr.writes[m].seq[:, None].expand_as(q), q, r))
        elif kind == "phase":
            assert torch.equal(rows, (pos % key[0]).to(torch.int32))
        elif kind == "limit":
            assert torch.equal(rows, ((pos + 1) // key[0]).to(torch.int32))
        elif kind == "entry_base":                     # each row's offset into its flattened entry table
            assert torch.equal(rows, seq[:, None] * addr.rows[("entries", key[0])].shape[1])
        elif kind == "query_start":                    # a paged kernel's cu_seqlens_q and seqused_kv
            assert rows.tolist() == [0, 3, 4] and torch.equal(addr.rows[("seq_lens",)], torch.tensor([16, 7]).int())
        elif kind == "row_ends":                       # each token row its own batch of one query
            assert rows.tolist() == [1, 2, 3, 4]
        elif kind == "row_table":
            assert torch.equal(rows, addr.sites.group_of(addr.tables, key[0]).table[seq])
        elif kind == "window_table":                   # every entry the sequence's slot, cdiv(max_len, R) wide
            assert rows.dtype == torch.int32 and rows.shape == (2, -(-16 // key[0]))
            assert torch.equal(rows, addr.seq_slot.int()[:, None].expand_as(rows))
        elif kind == "state_table":                    # the compressor state's: the slot + 1 (its pool's slot 0 unused)
            assert rows.dtype == torch.int32 and rows.shape == (2, -(-16 // key[0]))
            assert torch.equal(rows, addr.seq_slot.int()[:, None].expand_as(rows) + 1)
        elif kind == "start_pos":                      # positions before the step, int32
            assert torch.equal(rows, addr.seq_start.int())
    for m in addr.max_entries:
        ids = torch.arange(addr.max_entries[m] + 3).expand(seq.shape[0], -1)
        want = addr.entry_rows(m, seq[:, None].expand_as(ids).reshape(-1), ids.reshape(-1)).view(ids.shape)
        assert torch.equal(addr.entry_block(m, 0, ids.shape[1]), want)
        assert torch.equal(addr.entry_rows_of(m, ids), want)
    kinds = {k[0] for k in addr.rows}
    assert kinds == {"ring", "window", "window_mask", "span", "span_pos", "span_valid", "phase", "entries",
                     "entry_base", "limit", "query_start", "seq_lens", "start_pos", "window_table", "state_table",
                     "row_ends", "row_table"}
    with pytest.raises(KeyError, match=r"no rows \('ring', 999\)"):
        addr.step(("ring", 999))
