"""DeepSeek-V4.1's KV cache as the planner sizes it: shared compressed KV in the release's cache formats.

V4.1 compresses on its KV-source layers only (kv_source_layer_ids: 2, 8, 14 at ratio 2, 20 at
ratio 1; the layers after a source read its cache, V41-REFERENCE §1.4 from [MP] and [TR §4.2.1]).
Each source keeps one FP4 main entry and one FP4 index key per `ratio` positions, in the formats of
spec/shared_kv.yaml; the windows (FP8), the ratio-2 sources' fp32 compressor buffers, the drafter
stages' windows and Engram's last ids are fixed per sequence. The runtime's pools hold the same values
simulated in a wider dtype (the reference's fp32, a device's compute dtype: spec/state.yaml), not packed FP4 /
FP8, so a running engine holds fewer tokens than this plan: the plan is the formats the field's kernels keep.
The pools are laid out as lib/planner/cache_layout.py lays out V4's (an
entry group per compress ratio, cdiv(num_blocks, m) + max_seqs blocks of block_tokens rows; ring
slots for max_seqs + 1 sequences) and `capacity` there sizes both. One shared KV head: every TP rank
holds its sequences' whole cache.
"""
from __future__ import annotations

from typing import NamedTuple

from lib.runtime.state_pools import group_blocks
from spec.config import ModelConfig
from spec.profile import load_profile
from spec.schedule import LayerInfo, backbone, drafter
from spec.shared_kv import load_shared_kv, size

PER_SEQUENCE = ("window_ring", "compressor_buffers", "draft_rings", "engram_ids")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SharedKVLayout(NamedTuple):
    cfg: ModelConfig
    block_tokens: int
    max_seqs: int
    slack: int
    rings: bool                     # the drafter stages' window rings are allocated (speculative)

    @property
    def sources(self) -> tuple[LayerInfo, ...]:
        return tuple(layer for layer in backbone(self.cfg) if layer.kv_source)

    @property
    def entry_row(self) -> dict[str, int]:
        """Entry kind -> bytes of one row: the main compressed entry and the index key."""
        f = load_shared_kv().entries
        return {"entries": size(f.main.bytes, self.cfg), "index_keys": size(f.index.bytes, self.cfg)}

    def group_row(self, ratio: int) -> int:
        """Bytes of one entry row of the group of `ratio`: every source's main entry and index key."""
        return sum(self.entry_row.values()) * sum(1 for s in self.sources if s.ratio == ratio)

    @property
    def ratios(self) -> list[int]:
        return sorted({s.ratio for s in self.sources}, reverse=True)

    @property
    def per_token(self) -> dict[str, float]:
        """`<kind>_r<ratio>` -> bytes one context position adds (its share of every source's rows)."""
        row = self.entry_row
        out = {}
        for m in self.ratios:
            n = sum(1 for s in self.sources if s.ratio == m)
            for kind in ("entries", "index_keys"):
                out[f"{kind}_r{m}"] = n * row[kind] / m
        return out

    @property
    def window_rows(self) -> int:
        return size(load_shared_kv().rings.window.rows, self.cfg)

    @property
    def ring_row(self) -> dict[str, int]:
        """Ring kind -> bytes of one position's rows across its layers."""
        row = size(load_shared_kv().rings.window.row_bytes, self.cfg)
        return {"window_ring": row * len(backbone(self.cfg)),
                "draft_rings": row * len(drafter(self.cfg)) if self.rings else 0}

    @property
    def per_sequence(self) -> dict[str, int]:
        f = load_shared_kv().rings
        ring = self.ring_row
        return {"window_ring": self.window_rows * ring["window_ring"],
                "compressor_buffers": sum(size(f.compressor.bytes, self.cfg, ratio=s.ratio) for s in self.sources
                                          if s.ratio >= f.compressor.min_ratio),
                "draft_rings": self.window_rows * ring["draft_rings"],
                "engram_ids": size(f.engram_ids.bytes, self.cfg) if self.cfg.engram_layer_ids else 0}

    @property
    def kv_bytes_per_token(self) -> float:
        return sum(self.per_token.values())

    @property
    def kv_fixed_bytes_per_sequence(self) -> int:
        return sum(self.per_sequence.values())

    def total_bytes(self, num_blocks: int) -> int:
        """Every pool for `num_blocks` blocks of context: entry groups and max_seqs + 1 ring slots."""
        entries = sum(group_blocks(num_blocks, m, self.max_seqs) * self.block_tokens * self.group_row(m)
                      for m in self.ratios)
        return entries + (self.max_seqs + 1) * self.kv_fixed_bytes_per_sequence

    def blocks_for(self, length: int) -> dict[int, int]:
        """Compress ratio -> entry blocks one sequence of `length` positions holds."""
        return {m: cdiv(length // m, self.block_tokens) for m in self.ratios}

    def held(self, kind: str) -> str:
        """What a kind holds, in this schedule's numbers (the printed table's gloss)."""
        cfg, row = self.cfg, self.entry_row
        if kind.startswith(("entries_r", "index_keys_r")):
            what, m = kind.rsplit("_r", 1)
            layers = [s.index for s in self.sources if s.ratio == int(m)]
            name = "an FP4 main entry" if what == "entries" else "an FP4 index key"
            per = "every position" if int(m) == 1 else f"per {m} positions"
            return (f"{name} of {row[what]} B {per}, KV-source "
                    f"layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, layers))}")
        f = load_shared_kv().rings
        window = size(f.window.row_bytes, cfg)
        if kind == "window_ring":
            return f"{self.window_rows} FP8 rows of {window} B (512 + 16 UE8M0 scale bytes), {len(backbone(cfg))} layers"
        if kind == "draft_rings":
            stages = len(drafter(cfg)) if self.rings else 0
            return f"{self.window_rows} FP8 rows of {window} B, {stages} drafter stages"
        if kind == "compressor_buffers":
            layers = [s.index for s in self.sources if s.ratio >= f.compressor.min_ratio]
            return f"fp32 K and G rows of unfinished groups, layers {', '.join(map(str, layers))}"
        return f"last {cfg.engram_max_ngram_size - 1} compressed token ids, int32"


def shared_kv_layout(backend: str, cfg: ModelConfig, speculative: bool, max_seqs: int, slack: int) -> SharedKVLayout:
    return SharedKVLayout(cfg, load_profile(backend).cache.block_tokens, max_seqs, slack, speculative)
