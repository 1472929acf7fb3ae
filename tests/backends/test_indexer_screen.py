"""The cpu indexer's fp32 screen (backends/cpu/ops/indexer.py) selects exactly what fp64 selects.

Unit cases reach every branch (a fitting candidate set, a crowded boundary that falls back to fp64,
rows with fewer visible entries than top-k, exact ties at score 0); the model case runs a chunked
prefill of the tiny checkpoint through the loader and generated forward (B21) with and without the
screen and requires the same logits, bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from backends.cpu.ops import indexer
from helpers import chunked_logits, prompt_ids
from lib.runtime.loaded_model import load_model


def _fp64(q, w, keys, pos, topk, ratio=4, scale=0.1):
    return indexer.top_entries(indexer.index_scores(q, w, keys, pos, ratio=ratio, weight_scale=scale),
                               min(topk, keys.shape[0]))


def _case(seed, n=64, hi=8, di=32, entries=1200, start=None, negative=0.0):
    gen = torch.Generator().manual_seed(seed)
    q, keys = torch.randn(n, hi, di, generator=gen), torch.randn(entries, di, generator=gen)
    w = torch.randn(n, hi, generator=gen) - negative            # negative: most heads weigh down
    start = 4 * entries - n // 2 if start is None else start    # the chunk's last rows see every entry
    return q, w, keys, torch.arange(start, start + n)


@pytest.mark.parametrize("seed,negative", [(0, 0.0), (1, 0.0), (2, 2.5), (3, 4.0)])
def test_screen_selects_the_fp64_top_k(seed, negative):
    q, w, keys, pos = _case(seed, negative=negative)
    ids, visible = indexer.screened_topk(q, w, keys, pos, topk=64, ratio=4, weight_scale=0.1)
    want_ids, want_visible = _fp64(q, w, keys, pos, 64)
    assert torch.equal(visible, want_visible)
    assert torch.equal(torch.where(visible, ids, -1), torch.where(want_visible, want_ids, -1))


def test_ties_at_zero_are_taken_by_entry_id():
    """Two heads weighing down: no score is positive, and about a quarter of the entries (both dots
    negative) score exactly 0, so every row's top-64 is 64 of ~300 zeros: both paths take the
    lowest entry ids, as a stable sort would."""
    q, w, keys, pos = _case(3, hi=2, negative=4.0)
    scores = indexer.index_scores(q, w, keys, pos, ratio=4, weight_scale=0.1)
    stable = scores.sort(dim=-1, descending=True, stable=True)
    want = stable.indices[:, :64].sort(dim=-1).values                       # the set, ascending
    kth = stable.values[:, 63]
    assert ((kth == 0) & (stable.values[:, 64] == 0)).any()                 # a boundary really straddles ties
    for ids, visible in (indexer.top_entries(scores, 64),
                         indexer.screened_topk(q, w, keys, pos, topk=64, ratio=4, weight_scale=0.1)):
        assert visible.all() and torch.equal(ids, want)


def test_crowded_boundary_falls_back_to_fp64(monkeypatch):
    """Near-identical keys put hundreds of entries within fp32 rounding of the k-th score: the
    candidate set cannot hold them and the row is scored in fp64 whole."""
    q, w, _, pos = _case(4)
    keys = torch.randn(1, 32) + 1e-6 * torch.randn(1200, 32, generator=torch.Generator().manual_seed(5))
    calls = []
    for name in ("screen_scores", "index_scores"):
        original = getattr(indexer, name)
        monkeypatch.setattr(indexer, name, lambda *a, _f=original, _n=name, **kw: calls.append(_n) or _f(*a, **kw))
    ids, visible = indexer.screened_topk(q, w.abs(), keys, pos, topk=64, ratio=4, weight_scale=0.1)
    assert calls == ["screen_scores", "index_scores"]             # screened, then the fallback in fp64
    want_ids, want_visible = _fp64(q, w.abs(), keys, pos, 64)
    assert torch.equal(torch.where(visible, ids, -1), torch.where(want_visible, want_ids, -1))


def test_rows_with_fewer_visible_entries_than_top_k():
    q, w, keys, pos = _case(6, n=96, entries=800, start=0)      # rows at positions 0..95: 0-24 entries
    ids, visible = indexer.screened_topk(q, w, keys, pos, topk=64, ratio=4, weight_scale=0.1)
    want_ids, want_visible = _fp64(q, w, keys, pos, 64)
    assert torch.equal(visible.sum(1), (pos + 1) // 4)
    assert torch.equal(torch.where(visible, ids, -1), torch.where(want_visible, want_ids, -1))


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_error_bound_holds(scale):
    q, w, keys, pos = _case(7, n=128, hi=16, di=64, entries=2000)
    q, keys = q * scale, keys / scale ** 0.5
    exact = indexer.index_scores(q, w, keys, pos, ratio=4, weight_scale=0.05)
    fp32 = indexer.screen_scores(q, w, keys, pos, ratio=4, weight_scale=0.05).double()
    err = (fp32 - exact).nan_to_num(0.0).abs().amax(dim=1)      # -inf - -inf = nan: invisible entries
    bound = indexer._error_bound(q, w.double() * 0.05, keys)
    assert (err <= bound).all()
    assert (err > 0).any()                                        # fp32 really rounds here


@pytest.mark.parametrize("entries,width", [(8192, 88), (3000, 88), (1000, 13), (700, 88), (50, 13)])
def test_top_width_gives_topk_values(entries, width):
    """Two-level top-width (strided groups) against torch.topk, on rows with -inf tails and
    repeated values (scores rounded to a few levels, so the boundary falls inside a run of ties)."""
    gen = torch.Generator().manual_seed(entries)
    scores = (torch.randn(40, entries, generator=gen) * 4).round()
    scores[:5, entries // 3:] = float("-inf")                     # rows whose visible entries are few
    scores[5:7, width // 2:] = float("-inf")                      # ... fewer than `width`
    values, ids = indexer.top_width(scores, width)
    assert torch.equal(values, scores.topk(width, dim=-1).values)
    assert ((ids >= 0) & (ids < entries)).all()                   # real entries, never the padding
    assert torch.equal(torch.gather(scores, 1, ids), values)      # the ids hold those values
    finite = ids.masked_fill(values.isneginf(), -1).sort(dim=-1).values
    assert ((finite.diff(dim=-1) > 0) | (finite[:, 1:] == -1)).all()   # distinct wherever finite


def test_screening_is_chosen_by_shape_and_full_fp32_only():
    assert indexer.worth_screening(512, 8192, 64)
    assert not indexer.worth_screening(1, 8192, 64)               # decode: the fp64 path
    assert not indexer.worth_screening(512, 300, 64)              # few entries per candidate slot
    torch.set_float32_matmul_precision("high")                    # may use reduced-precision products
    try:
        assert not indexer.worth_screening(512, 8192, 64)
    finally:
        torch.set_float32_matmul_precision("highest")


def test_chunked_prefill_logits_do_not_change_with_the_screen(tiny_ckpt, monkeypatch):
    """650 tokens in chunks of 65: from the 8th chunk on the CSA layers (top-k 4, 13 candidate
    slots) hold >= 10 x 13 entries, so index_select screens 3 chunks of each; the logits equal those
    of the same chunks scored in fp64 only."""
    model = load_model(tiny_ckpt)
    ids = prompt_ids(650, model.cfg.vocab_size, seed=3)
    screened = []
    original = indexer.screened_topk

    def spy(*args, **kw):
        screened.append(args[0].shape[0])
        return original(*args, **kw)

    monkeypatch.setattr(indexer, "screened_topk", spy)
    fast = chunked_logits(model, ids, [65] * 10)
    assert len(screened) == 3 * 2                                 # the screen really ran
    monkeypatch.setattr(indexer, "worth_screening", lambda *a: False)
    assert torch.equal(fast, chunked_logits(model, ids, [65] * 10))
