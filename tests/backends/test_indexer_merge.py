"""The reference indexer's running top-k (backends/cpu/ops/indexer.py merge_top) against one sort of all scores."""
from __future__ import annotations

import pytest
import torch

from backends.cpu.ops.indexer import merge_top


def _running(scores: torch.Tensor, k: int, width: int) -> torch.Tensor:
    """The selection as select() builds it: k empty slots, blocks of `width` merged in, then id order."""
    t, e = scores.shape
    best, best_ids = torch.full((t, k), float("-inf"), dtype=scores.dtype), (torch.arange(k) - k).expand(t, k)
    for lo in range(0, e, width):
        ids = torch.arange(lo, min(lo + width, e))
        best, best_ids = merge_top(best, best_ids, scores[:, lo:lo + width], ids.expand(t, -1), k)
    return torch.where(torch.isfinite(best), best_ids, e).sort(dim=1).values


@pytest.mark.parametrize("width", [1, 3, 8, 50])
def test_the_running_top_k_is_the_whole_sort_at_any_block_width(width):
    # scores with many exact ties (ReLU zeroes, repeated values) and unseen entries (-inf)
    gen = torch.Generator().manual_seed(3)
    scores = torch.randint(-3, 4, (6, 50), generator=gen).clamp(min=0).to(torch.float64)
    scores[1, 20:] = float("-inf")                          # sees 20 entries
    scores[2] = float("-inf")                               # sees none
    k = 7
    whole = torch.sort(scores, dim=1, descending=True, stable=True)       # ties: the lower ids first
    want = torch.where(torch.isfinite(whole.values[:, :k]), whole.indices[:, :k], 50).sort(dim=1).values
    assert torch.equal(_running(scores, k, width), want)
    assert (want[2] == 50).all() and (want[1] < 20).all()
