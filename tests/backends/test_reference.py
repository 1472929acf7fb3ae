"""The cpu reference backend's paged decode state: prefill + decode == long prefill, batching, rewinds.

Runs the tiny checkpoint through make_tiny -> load_model -> the generated forward, the path
users take (B21). Tolerance 1e-5 is the acceptance bound; the reference computes every op in
fp64 and rounds to fp32, so in practice the results are bit-identical.
"""
from __future__ import annotations

import pytest
import torch

from codegen.lower import Rewrite
from helpers import chunked_logits, prefill_logits, prompt_ids
from lib.porting.rendering import rendered
from lib.records.batch import make_batch
from lib.runtime.loaded_model import load_model
from lib.runtime.paged_cache import PagedCache
from lib.runtime.paged_step import paged_step
from lib.weights.tiny_checkpoint import make_tiny
from spec.schedule import backbone

TOL = 1e-5


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(make_tiny(tmp_path_factory.mktemp("tiny") / "ckpt"))


def test_tiny_prompt_crosses_every_boundary(model):
    """The lengths used below cross the window and several compression windows of every kind."""
    cfg, total = model.cfg, 48
    ratios = {layer.ratio for layer in backbone(cfg) if layer.ratio}
    assert {layer.attention for layer in backbone(cfg)} == {"swa", "csa", "hca"}
    assert {layer.routing for layer in backbone(cfg)} == {"hash", "learned"}
    assert total > 2 * cfg.sliding_window
    for ratio in ratios:
        # decode positions 20..47 complete at least two windows of each ratio
        assert sum((p + 1) % ratio == 0 for p in range(20, total)) >= 2
    assert cfg.index_topk < total // 4          # the indexer really selects (CSA ratio 4)


@pytest.mark.parametrize("n_prefill", [1, 13, 20])
def test_prefill_then_decode_equals_long_prefill(model, n_prefill):
    ids = prompt_ids(48, model.cfg.vocab_size)
    full = prefill_logits(model, ids)
    steps = chunked_logits(model, ids, [n_prefill] + [1] * (len(ids) - n_prefill))
    assert (steps - full).abs().max().item() <= TOL


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_is_invariant(model, chunk):
    """L24: chunking must not change results."""
    ids = prompt_ids(48, model.cfg.vocab_size, seed=2)
    sizes = [min(chunk, len(ids) - i) for i in range(0, len(ids), chunk)]
    assert (chunked_logits(model, ids, sizes) - prefill_logits(model, ids)).abs().max().item() <= TOL


def test_decode_state_is_what_the_declaration_says(model):
    """After 48 tokens: fixed rings per sequence slot (window W + slack rows, compressor rings of
    2m or m + slack), and entries written for exactly the 48 // m complete windows (§3.12)."""
    cfg = model.cfg
    store = PagedCache.for_lengths(model, [48], slack=3)
    store.add("s")
    paged_step(model, make_batch([prompt_ids(45, cfg.vocab_size)]), store, ["s"])
    paged_step(model, make_batch([prompt_ids(3, cfg.vocab_size, seed=5)], [45]), store, ["s"])
    assert store.length("s") == 48
    slot, tables = store._seqs["s"].slot, store._seqs["s"].tables
    for layer, pools in zip(backbone(cfg), store.layers):
        assert pools.window.shape == (2, cfg.sliding_window + 3, cfg.head_dim)        # one slot + trash
        assert pools.window[slot].abs().sum(-1).gt(0).all()                         # every ring row filled
        if layer.attention == "swa":
            assert pools.comp is None and pools.index is None
            continue
        m = layer.ratio
        assert pools.comp.kv.shape[1] == (2 * m if layer.attention == "csa" else m) + 3
        written = pools.comp.entries.abs().sum(-1).gt(0)                            # [rows] written entries
        rows = {b // store.factor * store.block_tokens + (b % store.factor) * store.logical_block_tokens + i
                for b in tables[m] for i in range(store.logical_block_tokens)}
        assert int(written.sum()) == 48 // m and all(r in rows for r in written.nonzero().flatten().tolist())
        assert (pools.index is not None) == (layer.attention == "csa")


def test_batch_of_sequences_equals_each_alone(model):
    """Ragged batches (a prefill chunk next to decode steps) give each sequence its own result."""
    vocab = model.cfg.vocab_size
    a, b, c = prompt_ids(30, vocab, 3), prompt_ids(17, vocab, 4), prompt_ids(41, vocab, 5)
    alone = [prefill_logits(model, s) for s in (a, b, c)]
    # prefill a[:29], b[:10], c[:40] together, then one mixed step: a and c decode, b prefills 7
    store = PagedCache.for_lengths(model, [30, 17, 41])
    for s in "abc":
        store.add(s)
    (first,) = paged_step(model, make_batch([a[:29], b[:10], c[:40]]), store, list("abc"))
    (second,) = paged_step(model, make_batch([a[29:], b[10:], c[40:]], [29, 10, 40]), store, list("abc"))
    got_a = torch.cat([first[:29], second[:1]])
    got_b = torch.cat([first[29:39], second[1:8]])
    got_c = torch.cat([first[39:], second[8:]])
    for got, want in zip((got_a, got_b, got_c), alone):
        assert (got - want).abs().max().item() <= TOL


def test_a_rewound_step_leaves_no_trace(model):
    """Positions written but not committed (a rejected verify) change nothing: the same step
    after rewinding gives the same result, and so does a different one (§3.12)."""
    ids = prompt_ids(40, model.cfg.vocab_size, 6)
    store = PagedCache.for_lengths(model, [40], slack=6)
    store.add(0)
    paged_step(model, make_batch([ids[:25]]), store, [0])
    (once,) = paged_step(model, make_batch([ids[25:31]], [25]), store, [0], commit=False)
    store.set_length(0, 25)
    paged_step(model, make_batch([[3, 4, 5, 6, 7, 8]], [25]), store, [0], commit=False)   # other tokens, rejected
    store.set_length(0, 25)
    (again,) = paged_step(model, make_batch([ids[25:31]], [25]), store, [0], commit=False)
    assert torch.equal(once, again)
    with pytest.raises(ValueError, match="slack"):
        store.set_length(0, 24)                 # 7 written positions back: more than the rings keep


def test_indexer_selects_a_strict_subset(model):
    """With index_topk < complete entries the CSA layers attend to a real top-k selection."""
    with rendered("cpu", Rewrite(record_ops=("index_select",)), "test") as code:   # records every selection
        recording = load_model(model.root, "cpu", code=code)
        prefill_logits(recording, prompt_ids(48, recording.cfg.vocab_size))
        seen = [sel for _, _, _, _, sel in code.model.RECORDED]
    assert seen
    for sel in seen:
        last = sel[-1]                          # the query at position 47 sees 12 complete entries
        assert (last >= 0).sum().item() == recording.cfg.index_topk < 48 // 4
