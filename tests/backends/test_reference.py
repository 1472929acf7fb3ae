"""The cpu reference backend's decode state: prefill + decode == long prefill, batching, purity.

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
from lib.runtime.loaded_model import load_model, step
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


def test_decode_state_holds_what_the_reference_says(model):
    """After 48 tokens: a W-entry window, n/m compressed entries, n mod m buffered tokens (§3.12)."""
    cfg = model.cfg
    _, caches = step(model, make_batch([prompt_ids(45, cfg.vocab_size)]), [model.new_cache()])
    _, caches = step(model, make_batch([prompt_ids(3, cfg.vocab_size, seed=5)], [45]), caches)
    cache = caches[0]
    assert cache.length == 48
    for layer, lc in zip(backbone(cfg), cache.layers):
        assert lc.window.shape == (cfg.sliding_window, cfg.head_dim)
        if layer.attention == "swa":
            assert lc.comp is None and lc.index is None
            continue
        assert lc.comp.entries.shape == (48 // layer.ratio, cfg.head_dim)
        assert lc.comp.buf_kv.shape[0] == 48 % layer.ratio
        if layer.attention == "csa":
            assert lc.index.entries.shape == (48 // layer.ratio, cfg.index_head_dim)
            assert lc.comp.prev_kv.shape == (layer.ratio, cfg.head_dim)   # overlap "a" half kept
        else:
            assert lc.index is None


def test_batch_of_sequences_equals_each_alone(model):
    """Ragged batches (a prefill chunk next to decode steps) give each sequence its own result."""
    vocab = model.cfg.vocab_size
    a, b, c = prompt_ids(30, vocab, 3), prompt_ids(17, vocab, 4), prompt_ids(41, vocab, 5)
    alone = [prefill_logits(model, s) for s in (a, b, c)]
    # prefill a[:29], b[:10], c[:40] together, then one mixed step: a and c decode, b prefills 7
    caches = [model.new_cache() for _ in range(3)]
    first, caches = step(model, make_batch([a[:29], b[:10], c[:40]]), caches)
    second, caches = step(model, make_batch([a[29:], b[10:], c[40:]], [29, 10, 40]), caches)
    got_a = torch.cat([first[:29], second[:1]])
    got_b = torch.cat([first[29:39], second[1:8]])
    got_c = torch.cat([first[39:], second[8:]])
    for got, want in zip((got_a, got_b, got_c), alone):
        assert (got - want).abs().max().item() <= TOL


def test_step_leaves_input_state_untouched(model):
    """Functional runtime: the same state stepped twice gives the same result."""
    ids = prompt_ids(30, model.cfg.vocab_size, 6)
    _, caches = step(model, make_batch([ids[:25]]), [model.new_cache()])
    once, _ = step(model, make_batch([ids[25:]], [25]), caches)
    again, _ = step(model, make_batch([ids[25:]], [25]), caches)
    assert torch.equal(once, again)


def test_indexer_selects_a_strict_subset(model):
    """With index_topk < complete entries the CSA layers attend to a real top-k selection."""
    with rendered("cpu", Rewrite(record_ops=("index_select",)), "test") as code:   # records every selection
        recording = load_model(model.root, "cpu", code=code)
        prefill_logits(recording, prompt_ids(48, recording.cfg.vocab_size))
        seen = [(sel, [k.shape[0] for k in args[3]]) for _, _, args, _, sel in code.model.RECORDED]
    assert seen
    for sel, sizes in seen:
        last = sel[-1]
        assert (last >= 0).sum().item() == recording.cfg.index_topk < sizes[0]
