"""The layer schedule derived from `compress_ratios` and `num_hash_layers` (DSV4-REFERENCE §1.2).

Every block — backbone layer or drafter stage — gets one `LayerInfo`: its official key prefix,
attention kind, routing kind and RoPE table. Nothing else in the project re-derives these rules.
"""
from __future__ import annotations

from typing import Literal, NamedTuple

from spec.config import ModelConfig

# The official code gives a layer the overlapping two-series compressor and the lightning indexer
# exactly when its ratio is 4 (CSA); every other positive ratio is a non-overlapping HCA layer.
CSA_RATIO = 4

# V4.1 (a config with kv_source_layer_ids) names its compressed layers by ratio instead: "csa2"
# (ratio 2) and "csa1" (ratio 1), whose compressor and indexer live on source layers only and are
# shared by the layers after them (V41-REFERENCE §1.4, from the tech report §4.2.1 and the official
# inference/model.py, code-index ids 66669268318 and 70871433627). No V4 config gets these kinds.
Attention = Literal["swa", "csa", "hca", "dspark", "csa2", "csa1"]
# The RoPE table of the layers with a positive ratio (YaRN, compress_rope_theta): the only table whose rotation
# of a step's completed entries a compressor reads.
COMPRESS_TABLE = "compress"
Role = Literal["backbone", "mtp", "dspark"]
KVRole = Literal["swa", "source", "reindex", "reuse", "dspark"]


class LayerInfo(NamedTuple):
    index: int                 # entry of compress_ratios (backbone 0..L-1, then drafter stages)
    prefix: str                # official key prefix: "layers.7" or "mtp.1"
    role: Role
    attention: Attention
    ratio: int                 # compress ratio m (0 for sliding-only)
    routing: Literal["hash", "learned"]
    rope: Literal["main", "compress"]   # RoPE table (§3.5): YaRN "compress" only when ratio > 0
    stage: int | None          # drafter stage number, None for backbone layers
    last_stage: bool
    # Which compressed-attention parts this block owns. V4: every compressed layer owns its
    # compressor (kv_source) and every CSA layer its indexer (index_source). V4.1: only the layers of
    # kv_source_layer_ids / index_source_layer_ids do; the others reuse the latest source's.
    kv_source: bool = False
    index_source: bool = False
    candidate_source: bool = False     # V4.1: writes the candidate blocks reindex layers search
    engram: bool = False               # V4.1: an Engram table is read before this block

    # V4.1's generated attention and block programs are chosen by these (spec/graph.yaml `variants`)
    @property
    def kv_role(self) -> KVRole:
        """What a layer does with the shared compressed KV: none (swa), makes it and its index keys (source),
        scores it with its own indexer (reindex), or reads what the latest ones chose (reuse); a DSpark stage
        attends its context ring instead."""
        if self.role == "dspark":
            return "dspark"
        if self.ratio == 0:
            return "swa"
        if self.kv_source:
            return "source"
        return "reindex" if self.index_source else "reuse"

    @property
    def engram_kind(self) -> Literal["plain", "engram"]:
        return "engram" if self.engram else "plain"


def attention_kind(ratio: int, role: Role = "backbone", shared_kv: bool = False) -> Attention:
    # A DSpark stage's attention reads its context ring plus the draft block bidirectionally
    # (DSV4-REFERENCE §5.2): its own kind, though its ratio is 0 like a sliding layer's.
    if role == "dspark":
        return "dspark"
    if ratio == 0:
        return "swa"
    if shared_kv:              # V4.1's shared compressed KV (kv_source_layer_ids set)
        return "csa2" if ratio == 2 else "csa1"
    return "csa" if ratio == CSA_RATIO else "hca"


def drafter_kind(cfg: ModelConfig) -> Literal["dspark", "mtp", "none"]:
    stages = len(cfg.compress_ratios) - cfg.num_hidden_layers
    if stages == 0:
        return "none"
    return "dspark" if cfg.dspark_block_size is not None else "mtp"


def schedule(cfg: ModelConfig) -> tuple[LayerInfo, ...]:
    """All blocks in execution order: backbone layers, then drafter stages."""
    kind = drafter_kind(cfg)
    n = cfg.num_hidden_layers
    stages = len(cfg.compress_ratios) - n
    shared_kv = cfg.kv_source_layer_ids is not None
    kv_sources = set(cfg.kv_source_layer_ids or ())
    index_sources = set(cfg.index_source_layer_ids or ())
    engram = set(cfg.engram_layer_ids or ())
    out = []
    for i, ratio in enumerate(cfg.compress_ratios):
        backbone = i < n
        stage = None if backbone else i - n
        attention = attention_kind(ratio, "backbone" if backbone else kind, shared_kv)
        out.append(LayerInfo(
            index=i,
            prefix=f"layers.{i}" if backbone else f"mtp.{stage}",
            role="backbone" if backbone else kind,
            attention=attention,
            ratio=ratio,
            # hash routing only for the first num_hash_layers backbone layers (drafters learn)
            routing="hash" if backbone and i < cfg.num_hash_layers else "learned",
            rope=COMPRESS_TABLE if ratio > 0 else "main",
            stage=stage,
            last_stage=(not backbone) and stage == stages - 1,
            kv_source=backbone and (i in kv_sources if shared_kv else ratio > 0),
            index_source=backbone and (i in index_sources if shared_kv else attention == "csa"),
            candidate_source=backbone and i == cfg.candidate_source_layer_id,
            engram=backbone and i in engram,
        ))
    return tuple(out)


def backbone(cfg: ModelConfig) -> tuple[LayerInfo, ...]:
    return tuple(layer for layer in schedule(cfg) if layer.role == "backbone")


def drafter(cfg: ModelConfig) -> tuple[LayerInfo, ...]:
    return tuple(layer for layer in schedule(cfg) if layer.role != "backbone")
