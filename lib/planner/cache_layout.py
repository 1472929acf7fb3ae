"""KV cache of a deployment: what a context position and a sequence cost, and how many fit a pool.

The pools are the engine's own: the state declaration the backend's generated package carries
(`STATE`, rendered from spec/state.yaml) turned into shapes by lib/runtime/state_pools.py, the very
function lib/runtime/paged_cache.py allocates from, so the planner and the engine cannot disagree
on a byte. Two kinds of pools: block pools of compressed entries and indexer keys grow with the
context (bytes per position = row bytes / compress ratio); ring slots (windows, compressor
buffers, drafter rings) are a fixed size per sequence, `max_num_seqs` slots plus a trash slot.
DeepSeek-V4 has one shared KV head (num_key_value_heads = 1): every TP rank holds its sequences'
whole cache, so cache bytes are per device, never divided by TP. Knows no weights and no speed.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from lib.runtime.loaded_model import BackendFacts, generated
from lib.runtime.state_pools import PoolShape, entry_ratios, group_blocks, pool_shapes
from spec.config import ModelConfig
from spec.profile import load_profile
from spec.schedule import LayerInfo, backbone, drafter, drafter_kind

PER_POSITION = ("csa_entries", "hca_entries", "indexer_keys")          # block pools, grow with the context
PER_SEQUENCE = ("window_ring", "compressor_buffers", "draft_rings")    # ring slots, fixed per sequence


class CacheModel(NamedTuple):
    """What PagedCache (and so make_store) reads of a model, without loading one."""
    backend: str
    cfg: ModelConfig
    facts: BackendFacts                  # compute dtype and block geometry, from the profile
    state: tuple                         # the decode-state declaration (the generated package's STATE)
    layers: tuple[LayerInfo, ...]        # backbone schedule
    stages: tuple[LayerInfo, ...]        # drafter stages

    @property
    def state_dtype(self) -> torch.dtype:
        return self.facts.compute_dtype


def cache_model(backend: str, cfg: ModelConfig) -> CacheModel:
    """The planner reads the profile itself (it plans before anything is built or loaded)."""
    prof = load_profile(backend)
    facts = BackendFacts(getattr(torch, prof.compute_dtype), prof.cache.block_tokens,
                         prof.cache.logical_block_tokens, prof.ep_dispatch.mode,
                         ring_rows_multiple=prof.cache.ring_rows_multiple)
    return CacheModel(backend, cfg, facts, generated(backend).state, backbone(cfg), drafter(cfg))


def slack_of(cfg: ModelConfig, speculative: bool) -> int:
    """Positions one step may leave uncommitted: a verify writes the anchor and the drafts (a DSpark block,
    or the one draft an MTP layer proposes by default)."""
    if not speculative or drafter_kind(cfg) == "none":
        return 1
    return 1 + (cfg.dspark_block_size if drafter_kind(cfg) == "dspark" else 1)


class CacheLayout(NamedTuple):
    model: CacheModel
    max_seqs: int
    slack: int
    rings: bool                     # drafter rings are allocated (speculative: DSpark's context rings, MTP's window)

    @property
    def block_tokens(self) -> int:
        return self.model.facts.block_tokens

    def pools(self, num_blocks: int) -> list[PoolShape]:
        """Every pool the engine allocates for `num_blocks` blocks of context (PagedCache's shapes)."""
        m = self.model
        return pool_shapes(m.state, m.cfg, m.layers, m.stages if self.rings else (),
                           compute_dtype=m.facts.compute_dtype, block_tokens=self.block_tokens,
                           max_seqs=self.max_seqs, num_blocks=num_blocks, slack=self.slack,
                           ring_multiple=m.facts.ring_rows_multiple)

    def total_bytes(self, num_blocks: int) -> int:
        return sum(s.bytes for s in self.pools(num_blocks))

    def _kind(self, s: PoolShape) -> str:
        if s.owner.startswith("stage"):
            return "draft_rings"
        if s.item == "window":
            return "window_ring"
        if s.item == "index.entries":
            return "indexer_keys"
        if s.lifetime == "entry":
            layer = next(l for l in self.model.layers if f"layer{l.index}" == s.owner)
            return f"{layer.attention}_entries"
        return "compressor_buffers"

    @property
    def per_token(self) -> dict[str, float]:
        """Entry kind -> bytes one context position adds (its share of every entry row)."""
        out = dict.fromkeys(PER_POSITION, 0.0)
        for s in self.pools(1):
            if s.lifetime == "entry":
                out[self._kind(s)] += s.row_bytes / s.ratio
        return out

    @property
    def per_sequence(self) -> dict[str, int]:
        """Ring kind -> bytes of one sequence's slot."""
        out = dict.fromkeys(PER_SEQUENCE, 0)
        for s in self.pools(1):
            if s.lifetime == "sequence":
                out[self._kind(s)] += s.bytes // s.shape[0]
        return out

    @property
    def ring_row(self) -> dict[str, int]:
        """Ring kind -> bytes of one position's rows across its pools (what a step reads per live position)."""
        out = dict.fromkeys(PER_SEQUENCE, 0)
        for s in self.pools(1):
            if s.lifetime == "sequence":
                out[self._kind(s)] += s.row_bytes
        return out

    @property
    def kv_bytes_per_token(self) -> float:
        return sum(self.per_token.values())

    @property
    def kv_fixed_bytes_per_sequence(self) -> int:
        return sum(self.per_sequence.values())

    def held(self, kind: str) -> str:
        """What a kind's pools hold, in this schedule's numbers (the printed table's gloss)."""
        cfg, layers = self.model.cfg, self.model.layers
        csa = [l for l in layers if l.attention == "csa"]
        hca = [l for l in layers if l.attention == "hca"]
        ratio = {"csa": csa[0].ratio if csa else 0, "hca": hca[0].ratio if hca else 0}
        stages = len(self.model.stages) if self.rings else 0
        rows = cfg.sliding_window + self.slack
        held = next((s.shape[1] for s in self.pools(1) if s.item == "window"), rows)
        window = f"{cfg.sliding_window} + {self.slack} rows" + (f" (held as {held})" if held != rows else "")
        return {"csa_entries": f"an entry per {ratio['csa']} positions, {len(csa)} CSA layers",
                "hca_entries": f"an entry per {ratio['hca']} positions, {len(hca)} HCA layers",
                "indexer_keys": f"a key per {ratio['csa']} positions, {len(csa)} CSA layers",
                "window_ring": f"{window} of raw KV, {len(layers)} layers",
                "compressor_buffers": f"fp32 rows of unfinished windows, {len(csa) + len(hca)} CSA/HCA layers",
                "draft_rings": f"{cfg.sliding_window} rows, {stages} drafter stages"}[kind]

    def blocks_for(self, length: int) -> dict[int, int]:
        """Compress ratio -> entry blocks one sequence of `length` positions holds (PagedCache._needed)."""
        return {m: cdiv(length // m, self.block_tokens) for m in entry_ratios(self.pools(1))}


def layout(backend: str, cfg: ModelConfig, speculative: bool, max_seqs: int) -> CacheLayout:
    return CacheLayout(cache_model(backend, cfg), max_seqs, slack_of(cfg, speculative), speculative)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Capacity(NamedTuple):
    pool_bytes: int                 # the KV pool the memory budget leaves
    num_blocks: int                 # the engine's num_blocks: context blocks of block_tokens positions
    tokens: int                     # num_blocks x block_tokens
    allocated_bytes: int            # exact bytes of every pool at num_blocks (<= pool_bytes)
    sequence_length: int            # positions the engine provisions for a sequence of max_model_len
    sequences: int                  # such sequences held at once: min(max_num_seqs, what the blocks allow)
    limited_by: str                 # "blocks" | "max_num_seqs" | "pool" (not even the ring slots fit)


def capacity(lay: CacheLayout, pool_bytes: int, max_model_len: int) -> Capacity:
    """The largest num_blocks whose pools (max_seqs + 1 ring slots, entry groups of cdiv(num_blocks, m)
    + max_seqs blocks) fit `pool_bytes`, and the sequences of max_model_len those blocks hold."""
    pool_bytes = max(0, int(pool_bytes))
    fixed = lay.total_bytes(0)                      # ring slots and each group's max_seqs partial blocks
    length = max_model_len + lay.slack              # the engine provisions max_model_len + 1 + gamma (llm_engine)
    # an upper bound: cdiv(num_blocks, m) only rounds up, so the exact total is at least this estimate's
    blocks = max(0, int((pool_bytes - fixed) // (lay.kv_bytes_per_token * lay.block_tokens)))
    while blocks and lay.total_bytes(blocks) > pool_bytes:
        blocks -= 1
    if not blocks:                                  # not even the ring slots and one block fit
        return Capacity(pool_bytes, 0, 0, 0, length, 0, "pool")
    by_blocks = min((group_blocks(blocks, m, lay.max_seqs) // n for m, n in lay.blocks_for(length).items() if n),
                    default=lay.max_seqs)
    return Capacity(pool_bytes, blocks, blocks * lay.block_tokens, lay.total_bytes(blocks), length,
                    min(lay.max_seqs, by_blocks), "blocks" if by_blocks < lay.max_seqs else "max_num_seqs")
