"""KV cache of a deployment: bytes per token of every cache kind, and the capacity in tokens.

Sizes come from the engine's own paged layout (lib/engine/cache_sizing.py make_store -> lib/runtime/paged_cache.py) built
at one block, so the planner and the engine cannot disagree on what a position costs. DeepSeek-V4
has one shared KV head (num_key_value_heads = 1): every TP rank holds its sequences' whole cache,
so cache bytes are per device, never divided by TP. Knows no weights and no device speed.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from lib.engine.cache_sizing import make_store
from spec.config import ModelConfig
from spec.profile import load_profile
from lib.runtime.loaded_model import BackendFacts
from spec.schedule import LayerInfo, backbone, drafter

KINDS = ("window_ring", "csa_entries", "hca_entries", "indexer_keys", "compressor_buffers", "draft_rings")
HELD = {"window_ring": "the last sliding_window positions", "compressor_buffers": "positions of unfinished windows",
        "draft_rings": "the last sliding_window positions, per drafter stage",
        "csa_entries": "every context position (one entry per 4)", "hca_entries": "every context position (one per 128)",
        "indexer_keys": "every context position (one key per 4)"}


class CacheModel(NamedTuple):
    """What make_store reads of a model, without loading one."""
    backend: str
    cfg: ModelConfig
    state_dtype: torch.dtype
    facts: BackendFacts
    layers: tuple[LayerInfo, ...]        # backbone schedule
    stages: tuple[LayerInfo, ...]        # drafter stages


def cache_model(backend: str, cfg: ModelConfig) -> CacheModel:
    """The planner reads the profile itself (it plans before anything is built or loaded)."""
    prof = load_profile(backend)
    dtype = getattr(torch, prof.compute_dtype)           # the model's state dtype (lib/runtime/loaded_model.py)
    facts = BackendFacts(dtype, prof.cache.block_tokens, prof.cache.logical_block_tokens, prof.ep_dispatch.mode)
    return CacheModel(backend, cfg, dtype, facts, backbone(cfg), drafter(cfg))


class CacheLayout(NamedTuple):
    block_tokens: int
    horizon: int                    # tokens-group positions below L - horizon are never read again
    per_token: dict[str, float]     # kind -> bytes per token: per position held (rings), per context token (entries)
    tokens_block_bytes: int         # one physical block of the tokens group (every position-keyed pool)
    entry_block_bytes: dict[int, int]   # ratio m -> one physical block of group c{m} (entry-keyed pools)


class Capacity(NamedTuple):
    pool_bytes: int
    engine_tokens: int              # positions the engine as built can hold (its tokens group spans whole contexts)
    engine_blocks: int              # the tokens-group blocks that takes (the engine's num_blocks)
    per_admitted_token: float       # engine: a position's tokens-group row plus its share of every entry group
    windowed_tokens: int            # if the tokens group held live windows only and entries grew alone
    sequence_bytes: int             # windowed: one sequence at max_model_len


def _kind(pool: str, attention: dict[int, str]) -> str:
    if pool.startswith("draft."):
        return "draft_rings"
    layer, _, part = pool.partition(".")
    if part == "kv":
        return "window_ring"
    if part == "index.entries":
        return "indexer_keys"
    if part == "comp.entries":
        return f"{attention[int(layer.removeprefix('layer'))]}_entries"
    return "compressor_buffers"         # comp.kv / comp.gate / index.kv / index.gate: per-position rows


def layout(backend: str, cfg: ModelConfig, speculative: bool) -> CacheLayout:
    model = cache_model(backend, cfg)
    with torch.device("meta"):                                         # shapes only: nothing is allocated
        store = make_store(model, num_blocks=1, max_seqs=1, rings=speculative)
    attention = {layer.index: layer.attention for layer in backbone(cfg)}
    ratios = {g.name: g.ratio for g in store.groups}
    per_token = dict.fromkeys(KINDS, 0.0)
    for pool, (group, row) in store.row_bytes().items():
        ratio = ratios[group]
        per_token[_kind(pool, attention)] += row / ratio if ratio else row
    blocks = store.bytes_per_block()
    return CacheLayout(store.block_tokens, store.horizon, per_token, blocks["tokens"],
                       {g.ratio: blocks[g.name] for g in store.groups if g.ratio})


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _engine_bytes(lay: CacheLayout, blocks: int, seqs: int) -> int:
    # PagedCache sizes group c{m} as cdiv(num_blocks, m) + max_seqs blocks (lib/runtime/paged_cache.py)
    return blocks * lay.tokens_block_bytes + sum((cdiv(blocks, m) + seqs) * b for m, b in lay.entry_block_bytes.items())


def sequence_bytes(lay: CacheLayout, length: int) -> int:
    """One sequence of `length` positions when old tokens blocks are released (PagedCache.release_old)."""
    released = max(0, length - lay.horizon) // lay.block_tokens
    tokens = cdiv(length, lay.block_tokens) - released
    return tokens * lay.tokens_block_bytes + sum(cdiv(length // m, lay.block_tokens) * b
                                                 for m, b in lay.entry_block_bytes.items())


def capacity(lay: CacheLayout, pool_bytes: int, max_model_len: int, max_num_seqs: int) -> Capacity:
    pool_bytes = max(0, int(pool_bytes))
    per_token = (lay.tokens_block_bytes + sum(b / m for m, b in lay.entry_block_bytes.items())) / lay.block_tokens
    blocks = max(0, int((pool_bytes - max_num_seqs * sum(lay.entry_block_bytes.values()))
                        // (per_token * lay.block_tokens)))
    while blocks and _engine_bytes(lay, blocks, max_num_seqs) > pool_bytes:    # rounding of cdiv(blocks, m)
        blocks -= 1
    seq = sequence_bytes(lay, max_model_len)
    return Capacity(pool_bytes, blocks * lay.block_tokens, blocks, per_token,
                    pool_bytes // seq * max_model_len, seq)
