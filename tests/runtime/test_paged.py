"""Paged decode state (lib/runtime/paged_cache.py): slot mapping, views == dense records, paged == dense decode,
teacher forcing across block boundaries, rewind, chunking, batching, block accounting, B12-B14.

Everything goes through make_tiny -> load_model -> the generated forward, as users run it (B21).
The tiny model's window is 16 and its ratios 4 / 8; cpu blocks are 16 tokens, 310P's are 32-token
physical blocks addressed as 16 logical blocks of 2 (L19), so the prompts below cross every kind
of boundary. The paged state is the dense state rebuilt bit for bit, so paged-vs-dense is exact.
"""
from __future__ import annotations

import re

import pytest
import torch

from backends.common.paging import physical_slots
from helpers import prompt_ids
from lib.records.batch import make_batch
from lib.porting.faults import injection
from lib.runtime.paged_cache import CacheFull, PagedCache, PagedSites
from lib.runtime.paged_step import paged_step
from lib.runtime.loaded_model import load_model, step
from spec.profile import CacheGeometry, load_profile, profile_path
from spec.yamlio import SpecError

TOL = 1e-5          # the cpu reference's chunking tolerance (tests/backends/test_reference.py)


@pytest.fixture(scope="module")
def models(tiny_ckpt):
    return {b: load_model(tiny_ckpt, b) for b in ("cpu", "ascend310p")}


def _store(model, num_blocks: int = 64, max_seqs: int = 4, seqs=("s",), sites=PagedSites()) -> PagedCache:
    store = PagedCache.for_model(model, num_blocks=num_blocks, max_seqs=max_seqs, sites=sites)
    for s in seqs:
        store.add(s)
    return store


def _last(model, store, seq, ids: list[int]) -> torch.Tensor:
    """Paged logits of the last of `ids`, continuing the sequence's committed length."""
    start = store.length(seq)
    (logits,) = paged_step(model, make_batch([ids], [start], last_only=True), store, [seq])
    return logits[-1]


def _assert_records_equal(got, want):
    assert got.length == want.length
    for i, (g, w) in enumerate(zip(got.layers, want.layers)):
        pairs = [("window", g.window, w.window)]
        for part in ("comp", "index"):
            gs, ws = getattr(g, part), getattr(w, part)
            assert (gs is None) == (ws is None), (i, part)
            if gs is not None:
                pairs += [(f"{part}.{f}", getattr(gs, f), getattr(ws, f))
                          for f in ("buf_kv", "buf_gate", "prev_kv", "prev_gate", "entries")]
        for name, a, b in pairs:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f"layer {i} {name}"


# ---- slot mapping -------------------------------------------------------------------------------
def test_physical_slots_lay_logical_blocks_out_by_physical_block():
    """310P (L19): a physical block b appears as logical ids 16b..16b+15, each of 2 positions."""
    blocks = [3, 0]                                               # the sequence's 1st block is physical 3
    table = torch.tensor([b * 16 + r for b in blocks for r in range(16)], dtype=torch.int32)
    q = torch.arange(64, dtype=torch.int64)
    slots = physical_slots(table, q, 32, 2)
    assert slots.dtype == torch.int64
    expected = [blocks[p // 32] * 32 + p % 32 for p in range(64)]
    assert slots.tolist() == expected
    # the formula itself, position by position
    for p in (0, 1, 2, 31, 33, 62):
        logical = int(table[p // 2])
        assert slots[p] == (logical // 16) * 32 + (logical % 16) * 2 + p % 2
    identity = torch.tensor([0, 1, 2], dtype=torch.int32)            # 16/16: one entry per block
    assert physical_slots(identity, torch.arange(48), 16, 16).tolist() == list(range(48))


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


# ---- views ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["cpu", "ascend310p"])
def test_views_equal_the_dense_records(models, backend):
    """Empty: exactly model.new_cache(). After a paged prefill of 37 (crossing 16, 32 and the
    ratio windows): exactly the records the dense step returned."""
    model = models[backend]
    store = _store(model)
    empty, want = store.views(["s"])[0], model.new_cache()
    _assert_records_equal(empty, want)
    for g, w in zip(empty.layers, want.layers):
        for part in ("comp", "index"):
            if getattr(g, part) is not None:
                assert torch.equal(getattr(g, part).rows_kv, getattr(w, part).rows_kv)
    ids = prompt_ids(37, model.cfg.vocab_size)
    paged_step(model, make_batch([ids]), store, ["s"])
    _, dense = step(model, make_batch([ids]), [model.new_cache()])
    _assert_records_equal(store.views(["s"])[0], dense[0])


# ---- paged == dense ------------------------------------------------------------------------------
@pytest.mark.parametrize("backend, prompt_len, steps",
                         [("cpu", 20, 40), ("ascend310p", 20, 40), ("cpu", 70, 4), ("ascend310p", 70, 4)])
def test_paged_decode_is_bit_identical_to_dense(models, backend, prompt_len, steps):
    model = models[backend]
    store = _store(model)
    ids = prompt_ids(prompt_len, model.cfg.vocab_size, seed=3)
    batch = make_batch([ids], last_only=True)
    (paged,) = paged_step(model, batch, store, ["s"])
    dense, caches = step(model, batch, [model.new_cache()])
    for pos in range(prompt_len, prompt_len + steps):
        assert torch.equal(paged, dense), f"{backend}: logits differ after {pos} positions"
        token = int(torch.argmax(dense[-1]))
        batch = make_batch([[token]], [pos], last_only=True)
        (paged,) = paged_step(model, batch, store, ["s"])
        dense, caches = step(model, batch, caches)
    assert torch.equal(paged, dense)
    assert store.length("s") == prompt_len + steps


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
    assert store.usage()["tokens"][0] == 3 + 2                     # 40 and 24 positions of 16-token blocks
    store.free("a")
    store.free("b")
    assert all(used == 0 for used, _ in store.usage().values())


def test_cache_full_names_the_shortfall_and_allocates_nothing(tiny_ckpt):
    model = load_model(tiny_ckpt, "cpu")
    store = PagedCache(model, CacheGeometry(16, 16, "test"), 8, max_seqs=2)
    assert store.usage() == {"tokens": (0, 8), "c4": (0, 4), "c8": (0, 3)}   # cdiv(8, m) + max_seqs
    assert store.bytes_per_block()["tokens"] > store.bytes_per_block()["c8"] > 0
    store.add("a")
    store.add("b")
    store.ensure("a", 128)                                        # every tokens block
    before = store.usage()
    assert not store.can_fit([("b", 16)]) and store.can_fit([("b", 0)])
    with pytest.raises(CacheFull, match=r"sequence 'b' needs 1 tokens blocks \(0 of 8 free\).*nothing was allocated"):
        store.ensure("b", 16)
    assert store.usage() == before                                # c4 / c8 were not touched either
    with pytest.raises(CacheFull, match="maximum of 2"):
        store.add("c")
    store.free("a")
    store.ensure("b", 16)
    assert store.usage()["tokens"] == (1, 8)


def test_release_old_frees_blocks_and_decoding_still_matches(models):
    """Blocks wholly below L - max(W, HCA m, 2 * CSA m) are freed; decoding is unchanged."""
    model = models["cpu"]
    store = _store(model)
    ids = prompt_ids(20, model.cfg.vocab_size, seed=10)
    assert store.horizon == 16                                    # W = 16, 2 * 4, 8
    batch = make_batch([ids], last_only=True)
    (paged,) = paged_step(model, batch, store, ["s"])
    dense, caches = step(model, batch, [model.new_cache()])
    freed = 0
    for pos in range(20, 60):
        assert torch.equal(paged, dense), f"after {pos} positions"
        freed += store.release_old("s")
        batch = make_batch([[int(torch.argmax(dense[-1]))]], [pos], last_only=True)
        (paged,) = paged_step(model, batch, store, ["s"])
        dense, caches = step(model, batch, caches)
    assert torch.equal(paged, dense)
    assert freed == 2 and store.usage()["tokens"][0] == 4 - 2      # positions < 32 released at L = 48
    with pytest.raises(ValueError, match="released"):
        store.set_length("s", 30)
    with pytest.raises(RuntimeError, match="released block"):
        store.read_rows("layer0.kv", "s", 20, 40)


def test_extra_row_kinds_round_trip_on_the_hybrid_geometry(tiny_ckpt):
    """The pool API a drafter's ring uses ("draft.0"): position-keyed rows in the tokens group."""
    model = load_model(tiny_ckpt, "ascend310p")
    store = _store(model, num_blocks=4, seqs=("a", "b"))
    pool = store.add_rows("draft.0", 8, torch.float16, horizon=40)
    assert pool.shape == (4 * 32, 8) and store.rows("draft.0") is pool and store.horizon == 40
    store.ensure("b", 10)                                          # b takes physical block 0, a block 1
    store.ensure("a", 40)
    values = torch.arange(40 * 8, dtype=torch.float16).reshape(40, 8)
    store.write_rows("draft.0", "a", 0, values)
    assert torch.equal(store.read_rows("draft.0", "a", 5, 37), values[5:37])
    assert torch.equal(pool[32:64], values[:32])                   # a's first block is physical 1
    with pytest.raises(IndexError, match="beyond the 64 positions"):
        store.read_rows("draft.0", "a", 60, 70)
    with pytest.raises(KeyError, match="no cache rows 'draft.9'"):
        store.rows("draft.9")


# ---- injected field bugs ----------------------------------------------------------------------------
def _paged_matches_dense(model, ids: list[int], steps: int, sites=PagedSites()) -> bool:
    """A pool sized to the run, so a stray slot falls outside it instead of landing unnoticed."""
    total = len(ids) + steps
    store = _store(model, num_blocks=-(-total // model.facts.block_tokens), max_seqs=1, sites=sites)
    batch = make_batch([ids], last_only=True)
    (paged,) = paged_step(model, batch, store, ["s"])
    dense, caches = step(model, batch, [model.new_cache()])
    same = torch.equal(paged, dense)
    for pos in range(len(ids), total):
        batch = make_batch([[int(torch.argmax(dense[-1]))]], [pos], last_only=True)
        (paged,) = paged_step(model, batch, store, ["s"])
        dense, caches = step(model, batch, caches)
        same &= torch.equal(paged, dense)
    return same


@pytest.mark.parametrize("bug", ["B12", "B13", "B14"])
def test_injected_paging_bugs_are_caught(models, bug):
    model = models["ascend310p"]
    ids = prompt_ids(30, model.cfg.vocab_size, seed=11)
    assert _paged_matches_dense(model, ids, 4)
    with injection(bug, "ascend310p") as fault:
        try:
            caught = not _paged_matches_dense(model, ids, 4, fault.paged)
        except (IndexError, RuntimeError):                        # a slot outside its pool or table
            caught = True
    assert caught, f"{bug} went unnoticed"
