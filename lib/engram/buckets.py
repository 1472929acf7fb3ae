"""Engram bucket layout: each layer's 24 bucket primes, column offsets and table rows.

From the official DeepSeek-V4.1 `inference/engram.py` ([EN], code-index id 71212907549; the same
layout in torchtitan-npu's Engram tests [TT], ids 69332611211 and 68299168060, and TensorFold's CUDA
spec [TFS], id 71186709713):

  n-gram orders n = 2 .. engram_max_ngram_size, engram_n_heads heads each: column c = (n - 2) * heads + h.
  For each Engram layer in engram_layer_ids order, for each order n, the search starts again at
  engram_vocab_size - 1; each head takes the next prime above the running value that has never been
  handed out (the "seen" set spans all layers), and the running value becomes that prime. So V4.1's
  48 primes are the 48 consecutive primes above 16,000,000.
  offset[layer][c] = sum of the layer's primes of the columns before c (from 0); the layer's table
  has sum(primes) rows, which must equal its engram_num_embeddings entry.

Computed from the config (never a table of primes), and checked against engram_num_embeddings.
"""
from __future__ import annotations

from dataclasses import dataclass

from spec.config import ModelConfig

# Deterministic Miller-Rabin witnesses: exact for every n < 3.3e24 (far above any bucket size).
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def is_prime(n: int) -> bool:
    """Exact primality for n < 3.3e24 ([EN] uses sympy.isprime; any exact test gives the same primes)."""
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(after: int, seen: set[int] | frozenset[int] = frozenset()) -> int:
    """The smallest prime > `after` that is not in `seen` ([EN] find_next_prime)."""
    candidate = after + 1
    while not is_prime(candidate) or candidate in seen:
        candidate += 1
    return candidate


def bucket_primes(n_layers: int, max_ngram: int, n_heads: int, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """[layer][column] primes, column = (n - 2) * n_heads + h, handed out in layer, order, head order."""
    if max_ngram < 2 or n_heads < 1 or vocab_size < 1:
        raise ValueError(f"Engram needs max_ngram >= 2, n_heads >= 1 and vocab_size >= 1 "
                         f"(got {max_ngram}, {n_heads}, {vocab_size})")
    seen: set[int] = set()
    out = []
    for _ in range(n_layers):
        layer: list[int] = []
        for _n in range(2, max_ngram + 1):
            running = vocab_size - 1           # every order restarts the search here
            for _h in range(n_heads):
                running = next_prime(running, seen)
                seen.add(running)
                layer.append(running)
        out.append(tuple(layer))
    return tuple(out)


@dataclass(frozen=True)
class BucketLayout:
    """The bucket layout of every Engram layer; index i follows `layer_ids`."""
    layer_ids: tuple[int, ...]
    max_ngram: int                           # engram_max_ngram_size: orders 2 .. max_ngram
    n_heads: int                             # engram_n_heads: heads (primes) per order
    primes: tuple[tuple[int, ...], ...]      # [layer][column]
    offsets: tuple[tuple[int, ...], ...]     # [layer][column]: first table row of the column

    @property
    def n_columns(self) -> int:
        """Hash columns per layer: (max_ngram - 1) orders x n_heads (24 on V4.1)."""
        return (self.max_ngram - 1) * self.n_heads

    @property
    def rows(self) -> tuple[int, ...]:
        """Table rows of each layer: the sum of its primes (engram_num_embeddings)."""
        return tuple(sum(p) for p in self.primes)

    def column(self, n: int, head: int) -> int:
        if not (2 <= n <= self.max_ngram and 0 <= head < self.n_heads):
            raise ValueError(f"no Engram column for order {n}, head {head} "
                             f"(orders 2..{self.max_ngram}, heads 0..{self.n_heads - 1})")
        return (n - 2) * self.n_heads + head


def layout(layer_ids, max_ngram: int, n_heads: int, vocab_size: int) -> BucketLayout:
    layer_ids = tuple(int(i) for i in layer_ids)
    primes = bucket_primes(len(layer_ids), max_ngram, n_heads, vocab_size)
    offsets = []
    for layer in primes:
        acc, offs = 0, []
        for p in layer:
            offs.append(acc)
            acc += p
        offsets.append(tuple(offs))
    return BucketLayout(layer_ids, max_ngram, n_heads, primes, tuple(offsets))


_ENGRAM_KEYS = ("engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size", "engram_vocab_size",
                "engram_n_heads")


def layout_from_config(cfg: ModelConfig) -> BucketLayout:
    """The layout of a config with Engram (V4.1), checked against its engram_num_embeddings."""
    missing = [k for k in _ENGRAM_KEYS if getattr(cfg, k) is None]
    if missing:
        raise ValueError(f"the config has no Engram: {', '.join(missing)} unset")
    out = layout(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_vocab_size)
    if out.rows != tuple(cfg.engram_num_embeddings):
        raise ValueError(f"Engram bucket primes sum to {list(out.rows)} rows per layer, but the config's "
                         f"engram_num_embeddings is {list(cfg.engram_num_embeddings)}")
    return out
