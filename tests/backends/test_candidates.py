"""Two-level candidate selection (backends/cpu/ops/candidates.py) against V41-REFERENCE §3.7 worked by hand."""
from __future__ import annotations

import pytest
import torch

from backends.cpu.ops.candidates import candidate_mask, reindex_scores

NEG = -float("inf")


def test_candidate_blocks_keep_the_newest_block_and_the_best_others():
    scores = torch.tensor([
        [0.1, 0.9, -0.5, 0.2, 0.3, 0.8, 0.05],       # blocks of 2 score 0.9, 0.2, 0.8, 0.05 (+ a -inf pad)
        [0.4, 0.1, 0.7, NEG, NEG, NEG, NEG],         # sees 3 entries: blocks 0.4, 0.7, -inf, -inf
        [NEG] * 7,                                   # sees none
        [0.5] * 7,                                   # equal scores: the lower block ids win
    ])
    visible = torch.tensor([7, 3, 0, 7])
    mask = candidate_mask(scores, visible, block=2, topk_blocks=2)
    # row 0: the newest visible entry 6 is in block 3 (kept at +inf although it scores 0.05), then block 0 (0.9)
    assert mask[0].tolist() == [True, True, False, False, False, False, True]
    # row 1: newest entry 2 -> block 1 forced; block 0 next; the -inf blocks are never picks
    assert mask[1].tolist() == [True, True, True, True, False, False, False]
    assert not mask[2].any()
    assert mask[3].tolist() == [True, True, False, False, False, False, True]
    # 3 blocks allowed: row 1 still keeps only the two blocks whose score is not -inf
    assert candidate_mask(scores, visible, block=2, topk_blocks=3)[1].tolist() == [True] * 4 + [False] * 3
    # every block fits in the budget: every visible block is kept
    assert candidate_mask(scores, visible, block=2, topk_blocks=8)[0].all()


def test_reindex_scores_only_inside_the_kept_blocks():
    scores = torch.tensor([[0.1, 0.9, -0.5, 0.2, 0.3, 0.8, 0.05]])
    mask = candidate_mask(scores, torch.tensor([7]), block=2, topk_blocks=2)
    masked = reindex_scores(scores, mask)
    assert torch.equal(masked[0, :2], scores[0, :2]) and masked[0, 6] == scores[0, 6]
    assert bool(torch.isinf(masked[0, 2:6]).all())
    with pytest.raises(ValueError, match="block \\(0\\) and topk_blocks \\(2\\) must be positive"):
        candidate_mask(scores, torch.tensor([7]), block=0, topk_blocks=2)


def test_the_reference_selection_is_the_same_in_any_tiling(v41_tiny_ckpt, monkeypatch):
    """The reference's shared_index_select scores one tile of whole candidate blocks at a time: with tiles of 2
    entries (one candidate block) instead of one tile of every entry, a 40-token prefill's logits are the same
    bit for bit (selections and candidate blocks alike)."""
    from backends.cpu.ops import indexer
    from lib.runtime.loaded_model import load_model
    from lib.runtime.paged_step import prefill_logits

    model = load_model(v41_tiny_ckpt, "cpu")
    ids = torch.randint(0, model.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    whole = prefill_logits(model, ids)
    monkeypatch.setattr(indexer, "block_size", lambda *args, **kwargs: 1)        # rounded up to one block (2)
    assert torch.equal(prefill_logits(model, ids), whole)
