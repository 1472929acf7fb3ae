"""A sequence's Engram decode state, and the incremental step over it.

The hash ids of a position read only that token and the max_ngram - 1 before it (hashing.py), so a
sequence keeps just its last engram_max_ngram_size - 1 compressed ids (3 on V4.1), with DEAD (-1)
markers for image-span tokens (V41-REFERENCE §4.8, from the official DeepSeek-V4.1
`inference/engram.py` [EN], code-index id 71212907549, which keeps the whole [B, max_seq_len]
history instead). A fresh sequence's state is all DEAD: a position before the start blocks exactly
as a DEAD does. Prefill in chunks of any size and one-token decode steps give the hash ids of the
whole sequence hashed at once.

`hash_step` hashes new positions without committing them (a verify forward over drafted tokens);
`advance` commits the accepted ones, so a rejected draft never enters the state. Engram does not
run in draft blocks (§4.8). Immutable: a step returns a new state, the engine keeps it per sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lib.engram.hashing import DEAD, HashParams, hash_ids, lookback_window


@dataclass(frozen=True)
class EngramState:
    """The last `window` compressed ids of a sequence, oldest first (DEAD: image span or before the start)."""
    tail: tuple[int, ...]


def initial_state(params: HashParams) -> EngramState:
    return EngramState((DEAD,) * params.window)


def _check(state: EngramState, params: HashParams) -> None:
    if len(state.tail) != params.window:
        raise ValueError(f"Engram state holds {len(state.tail)} ids, the config needs {params.window}")


def hash_step(state: EngramState, ids, params: HashParams) -> np.ndarray:
    """Hash ids [len(ids), Engram layers, columns] of the positions right after the state; commits nothing."""
    _check(state, params)
    return hash_ids(ids, params, history=state.tail)


def advance(state: EngramState, committed, params: HashParams) -> EngramState:
    """The state after the compressed ids `committed` (DEAD for image-span tokens) joined the sequence."""
    _check(state, params)
    full = np.concatenate([np.asarray(state.tail, np.int64), np.asarray(committed, np.int64).reshape(-1)])
    return EngramState(tuple(int(v) for v in lookback_window(full, params)))


def step(state: EngramState, ids, params: HashParams) -> tuple[np.ndarray, EngramState]:
    """Hash `ids` after the state and commit them all: (hash ids of the new positions, the new state)."""
    return hash_step(state, ids, params), advance(state, ids, params)
