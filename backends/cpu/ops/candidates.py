"""Reference two-level candidate selection of DeepSeek-V4.1 (V41-REFERENCE §3.7: the tech report's Hierarchical
Sparse Indexer, §2.3.2, and the official `inference/model.py`, code-index ids 66669268318 and 70871433627).

At ratio 1 a query can see one compressed entry per earlier token, so past 2048 x 8 = 16,384 entries the
candidate source layer (candidate_source_layer_id, layer 20) first keeps whole blocks of candidate_block_size
entries: a block scores the best of its entries, the block holding the newest visible entry is always kept,
and the best candidate_topk_blocks blocks whose score is not -inf survive. Its own top-k uses the unmasked
scores; the reindex layers (24, 28, 32, 36) score only inside the kept blocks before their own top-k.
Ties between equal block scores keep the lower block id (the reference's top-k is a kernel's; §8 question 6
leaves its order open, and this is the order the project's indexer uses for entries).
"""
from __future__ import annotations

import torch


def candidate_mask(scores: torch.Tensor, visible: torch.Tensor, block: int, topk_blocks: int) -> torch.Tensor:
    """scores [T, N] fp32, -inf at entries a query cannot see; visible [T] int64, how many entries (from 0) each
    query sees -> [T, N] bool, True at the entries of the blocks kept."""
    t, n = scores.shape
    if block < 1 or topk_blocks < 1:
        raise ValueError(f"candidate_mask: block ({block}) and topk_blocks ({topk_blocks}) must be positive")
    if n == 0:                                  # no entry complete yet: nothing to keep
        return torch.zeros(t, 0, dtype=torch.bool)
    padded = torch.nn.functional.pad(scores.float(), (0, -n % block), value=-torch.inf)
    return kept_entries(padded.view(t, -1, block).amax(-1), visible, block, topk_blocks, n)


def kept_entries(best: torch.Tensor, visible: torch.Tensor, block: int, topk_blocks: int, n: int) -> torch.Tensor:
    """best [T, blocks]: each block's best score (-inf: nothing visible in it) -> [T, n] bool, True at the entries
    of the blocks kept: the newest visible block always, then the best topk_blocks of the rest by score."""
    t, blocks = best.shape
    if blocks == 0:
        return torch.zeros(t, n, dtype=torch.bool)
    newest = ((visible - 1).clamp(min=0) // block).clamp(max=blocks - 1)
    forced = torch.where(visible > 0, torch.inf, -torch.inf).to(best.dtype).unsqueeze(1)
    best = best.scatter(1, newest.unsqueeze(1), forced)
    order = torch.sort(-best, dim=1, stable=True).indices[:, : min(topk_blocks, blocks)]   # best first, lower id at a tie
    kept = torch.zeros(t, blocks, dtype=torch.bool).scatter(1, order, best.gather(1, order) > -torch.inf)
    return kept.repeat_interleave(block, dim=1)[:, :n]


def reindex_scores(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A reindex layer's scores: -inf outside the candidate source's kept blocks."""
    return scores.masked_fill(~mask, -torch.inf)
