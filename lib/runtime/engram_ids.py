"""Engram hash ids of a step's tokens, made on the host from token ids (V41-REFERENCE §4.4, §4.8).

A position's ids read its token and the engram_max_ngram_size - 1 before it, so a sequence keeps only the
compressed ids of its last few written positions: the look-back plus the uncommitted ones a verify may take
back (the cache's `slack`). A step continuing at the committed length hashes from what precedes it, so a
rejected draft never enters a later step's hashes. No device op, no sync: the ids go to the device with the
batch (`Batch.engram_ids`).
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from lib.engram.hashing import DEAD, HashParams, hash_params
from lib.engram.state import EngramState, hash_step
from lib.engram.token_map import TokenMap, build_token_map


class EngramHashing(NamedTuple):
    """What a model with Engram layers needs to hash its tokens."""
    token_map: TokenMap
    params: HashParams


def engram_hashing(cfg, checkpoint_dir: Path) -> EngramHashing | None:
    """The hashing of a config with Engram layers, its token map from the checkpoint's tokenizer; None without."""
    if not cfg.engram_layer_ids:
        return None
    from lib.text.tokenizer import Tokenizer

    token_map = build_token_map(Tokenizer.from_dir(checkpoint_dir), cfg.engram_pad_token_id,
                                cfg.engram_compressed_vocab_size)
    return EngramHashing(token_map, hash_params(cfg, token_map.pad))


class Tail(NamedTuple):
    """The compressed ids of a sequence's positions [start, start + len(ids))."""
    start: int
    ids: tuple[int, ...]


def step_ids(hashing: EngramHashing, tail: Tail, start: int, tokens: list[int], keep: int) -> tuple[np.ndarray, Tail]:
    """(hash ids [len(tokens), Engram layers, columns] int64 of positions [start, start + n), the tail to keep: the
    compressed ids of the last `keep` written positions). `tail` must hold the positions just before `start`."""
    window = hashing.params.window
    before = [tail.ids[p - tail.start] if tail.start <= p < tail.start + len(tail.ids) else DEAD
              for p in range(start - window, start)]
    if any(v == DEAD for p, v in zip(range(start - window, start), before) if p >= 0):
        raise ValueError(f"Engram: the ids of positions [{start - window}, {start}) are no longer kept "
                         f"(kept: [{tail.start}, {tail.start + len(tail.ids)}))")
    new = hashing.token_map.compress(tokens)
    ids = hash_step(EngramState(tuple(before)), new, hashing.params)
    written = [int(v) for v in before] + [int(v) for v in new]
    end = start + len(tokens)
    return ids, Tail(end - min(keep, len(written)), tuple(written[len(written) - min(keep, len(written)):]))


def as_tensor(parts: list[np.ndarray], pad_rows: int, shape_tail: tuple[int, int]) -> torch.Tensor:
    """The batch's ids [T, Engram layers, columns] int64, `pad_rows` rows of id 0 after the sequences' own."""
    rows = parts + ([np.zeros((pad_rows, *shape_tail), np.int64)] if pad_rows else [])
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(rows))) if rows else \
        torch.zeros(0, *shape_tail, dtype=torch.int64)
