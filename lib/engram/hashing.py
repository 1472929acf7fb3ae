"""Engram hash ids: compressed ids -> [positions, Engram layers, columns] int64 table rows, on the host.

From the official DeepSeek-V4.1 `inference/engram.py` ([EN], code-index id 71212907549), with the
image-span rule of torchtitan-npu's Engram tests ([TT], ids 69332611211 and 68299168060) and
TensorFold's CUDA spec ([TFS], id 71186709713). c[q] is the compressed id at position q, DEAD (-1)
for an image-span token. For position p and look-back s = 0 .. max_ngram - 1 (s = 0: the token itself):

  blocked_s = blocked_{s-1} or (p < s) or (c[p - s] == DEAD)        (sticky; blocked_{-1} = false)
  tok_s     = pad if blocked_s else c[p - s]
  P_s = tok_s * m[layer][s];  R_1 = P_0 ^ P_1;  R_k = R_{k-1} ^ P_k  (^: bitwise XOR, all values >= 0)
  hash[layer][(n - 2) * heads + h] = (R_{n-1} mod prime[layer][(n - 2) * heads + h]) + offset[...]

for n = 2 .. max_ngram. The heads of one order share R and differ only in the prime. A position
before the start blocks exactly as a DEAD does (both are sticky from that look-back on), so the
look-back window is read from the history left-padded with DEADs; tokens after an image span hash
as if the sequence restarted there. pad is the compressed id of engram_pad_token_id (token_map.py),
not the token id itself. Every product fits in int64 by construction of m (multipliers.py), checked
here by bounding the ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lib.engram.buckets import BucketLayout, layout_from_config
from lib.engram.multipliers import multipliers
from spec.config import ModelConfig

DEAD = -1       # an image-span token (and, equivalently, a position before the start)


@dataclass(frozen=True)
class HashParams:
    """What hashing needs: the bucket layout, the multipliers, the pad id and the compressed vocab size."""
    layout: BucketLayout
    multipliers: tuple[tuple[int, ...], ...]    # [layer][s], s = 0 .. max_ngram - 1
    pad: int                                    # a compressed id
    compressed_vocab: int

    def __post_init__(self):
        if not 0 <= self.pad < self.compressed_vocab:
            raise ValueError(f"Engram pad {self.pad} is not a compressed id (0 .. {self.compressed_vocab - 1})")
        if len(self.multipliers) != len(self.layout.layer_ids) or \
                any(len(m) != self.layout.max_ngram for m in self.multipliers):
            raise ValueError("Engram multipliers must be [layers][max_ngram]")

    @property
    def window(self) -> int:
        """Look-back positions a step needs from before it: max_ngram - 1 (3 on V4.1)."""
        return self.layout.max_ngram - 1

    @property
    def shape_tail(self) -> tuple[int, int]:
        """The hash ids of one position: (Engram layers, columns)."""
        return len(self.layout.layer_ids), self.layout.n_columns


def hash_params(cfg: ModelConfig, pad: int, compressed_vocab: int | None = None) -> HashParams:
    """A config's hashing parameters. `compressed_vocab`: the token map's size (default: the config's
    engram_compressed_vocab_size, 99,092 on V4.1); the multipliers depend on it."""
    vocab = int(compressed_vocab if compressed_vocab is not None else cfg.engram_compressed_vocab_size or 0)
    lay = layout_from_config(cfg)
    return HashParams(lay, multipliers(lay.layer_ids, vocab, lay.max_ngram), int(pad), vocab)


def _as_ids(ids, params: HashParams, what: str) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    bad = (arr < DEAD) | (arr >= params.compressed_vocab)
    if bad.any():
        raise ValueError(f"Engram {what}: {int(arr[bad][0])} is neither a compressed id "
                         f"(0 .. {params.compressed_vocab - 1}) nor DEAD ({DEAD})")
    return arr


def lookback_window(history, params: HashParams) -> np.ndarray:
    """The last `params.window` ids of `history` (oldest first), left-padded with DEAD."""
    hist = _as_ids(history, params, "history")[-params.window:] if params.window else np.zeros(0, np.int64)
    return np.concatenate([np.full(params.window - len(hist), DEAD, np.int64), hist])


def hash_ids(ids, params: HashParams, history=()) -> np.ndarray:
    """Hash ids [len(ids), Engram layers, columns] (int64 table rows) of the compressed ids `ids`.

    `history`: the compressed ids just before ids[0] (most recent last; only the last max_ngram - 1
    are read; shorter, or empty, means the sequence starts there). DEAD (-1) marks image-span tokens.
    """
    new = _as_ids(ids, params, "ids")
    k, n_pos = params.window, len(new)
    full = np.concatenate([lookback_window(history, params), new])
    blocked = np.zeros(n_pos, dtype=bool)
    toks = []
    for s in range(params.layout.max_ngram):
        c_s = full[k - s: k - s + n_pos]           # c[p - s] for every new position p
        blocked |= c_s == DEAD
        toks.append(np.where(blocked, np.int64(params.pad), c_s))
    lay, heads = params.layout, params.layout.n_heads
    out = np.empty((n_pos, *params.shape_tail), dtype=np.int64)
    for li, mult in enumerate(params.multipliers):
        primes = np.asarray(lay.primes[li], dtype=np.int64)
        offsets = np.asarray(lay.offsets[li], dtype=np.int64)
        mix = toks[0] * np.int64(mult[0])
        for s in range(1, lay.max_ngram):
            mix = mix ^ (toks[s] * np.int64(mult[s]))   # R_s: the (s + 1)-gram's mix
            cols = slice((s - 1) * heads, s * heads)
            out[:, li, cols] = mix[:, None] % primes[cols] + offsets[cols]
    return out
