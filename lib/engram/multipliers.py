"""Engram hash multipliers: per Engram layer, one odd int64 multiplier per look-back s = 0 .. max_ngram - 1.

From the official DeepSeek-V4.1 `inference/engram.py` ([EN], code-index id 71212907549; the V4.1
values also extracted in a Rust V4.1 config module [RCF], id 68298598583, and TensorFold's CUDA
spec [TFS], id 71186709713):

  B = max(1, floor((2**63 - 1) / compressed_vocab) // 2)      (46,539,438,283,891 for 99,092)
  v = numpy.random.default_rng(10007 * layer_id).integers(0, B, size=max_ngram, dtype=int64)
  m = 2 * v + 1

m is odd and m * id < 2**63 for every compressed id < compressed_vocab, so the hash products fit in
int64. The draw is numpy's own PCG64 generator and bounded sampling (never re-implemented): the
values depend on numpy's documented default_rng stream. The bound, and so every multiplier, depends
on the compressed vocabulary size (99,092 on V4.1; the tokenizer decides it, see token_map.py).
"""
from __future__ import annotations

import numpy as np

SEED_STRIDE = 10007      # [EN] PRIME_1: the generator of layer l is seeded 10007 * l
INT64_MAX = 2**63 - 1


def multiplier_bound(compressed_vocab: int) -> int:
    """B: the draws are uniform in [0, B), so m = 2v + 1 < 2B <= INT64_MAX // compressed_vocab."""
    if compressed_vocab < 1:
        raise ValueError(f"compressed_vocab must be >= 1, got {compressed_vocab}")
    return max(1, (INT64_MAX // compressed_vocab) // 2)


def layer_multipliers(layer_id: int, compressed_vocab: int, max_ngram: int) -> tuple[int, ...]:
    """The `max_ngram` multipliers of Engram layer `layer_id` (index s: the look-back s)."""
    rng = np.random.default_rng(SEED_STRIDE * int(layer_id))
    draws = rng.integers(0, multiplier_bound(compressed_vocab), size=max_ngram, dtype=np.int64)
    return tuple(2 * int(v) + 1 for v in draws)


def multipliers(layer_ids, compressed_vocab: int, max_ngram: int) -> tuple[tuple[int, ...], ...]:
    """[layer][s] for every Engram layer, in `layer_ids` order."""
    return tuple(layer_multipliers(i, compressed_vocab, max_ngram) for i in layer_ids)
