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

Attention = Literal["swa", "csa", "hca", "dspark"]
Role = Literal["backbone", "mtp", "dspark"]


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


def attention_kind(ratio: int, role: Role = "backbone") -> Attention:
    # A DSpark stage's attention reads its context ring plus the draft block bidirectionally
    # (DSV4-REFERENCE §5.2): its own kind, though its ratio is 0 like a sliding layer's.
    if role == "dspark":
        return "dspark"
    if ratio == 0:
        return "swa"
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
    out = []
    for i, ratio in enumerate(cfg.compress_ratios):
        backbone = i < n
        stage = None if backbone else i - n
        out.append(LayerInfo(
            index=i,
            prefix=f"layers.{i}" if backbone else f"mtp.{stage}",
            role="backbone" if backbone else kind,
            attention=attention_kind(ratio, "backbone" if backbone else kind),
            ratio=ratio,
            # hash routing only for the first num_hash_layers backbone layers (drafters learn)
            routing="hash" if backbone and i < cfg.num_hash_layers else "learned",
            rope="compress" if ratio > 0 else "main",
            stage=stage,
            last_stage=(not backbone) and stage == stages - 1,
        ))
    return tuple(out)


def backbone(cfg: ModelConfig) -> tuple[LayerInfo, ...]:
    return tuple(layer for layer in schedule(cfg) if layer.role == "backbone")


def drafter(cfg: ModelConfig) -> tuple[LayerInfo, ...]:
    return tuple(layer for layer in schedule(cfg) if layer.role != "backbone")
