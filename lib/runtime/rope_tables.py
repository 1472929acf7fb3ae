"""RoPE frequency tables of DeepSeek-V4 (DSV4-REFERENCE §3.5): `main` and YaRN `compress`.

Only the frequencies live here (config math every backend shares); applying the rotation is an
op with a reference in `backends/cpu/ops/rope.py` and device lowerings elsewhere.
"""
from __future__ import annotations

import math

import torch

from spec.config import ModelConfig


def _base_inv_freq(base: float, rope_dim: int) -> torch.Tensor:
    # theta_i = base^(-2i/rope_dim), computed in fp32 the way the peer implementation does
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.int64).float() / rope_dim
    return 1.0 / (base ** exponents)


def _yarn_inv_freq(base: float, rope_dim: int, factor: float, original_max: int,
                   beta_fast: float, beta_slow: float) -> torch.Tensor:
    """YaRN frequency interpolation without the attention (mscale) factor, which V4 does not apply."""
    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo = max(math.floor(correction_dim(beta_fast)), 0)
    hi = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if lo == hi:
        hi += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    theta = _base_inv_freq(base, rope_dim)
    return theta / factor * ramp + theta * (1 - ramp)


def inv_freq(cfg: ModelConfig, table: str) -> torch.Tensor:
    """[qk_rope_head_dim / 2] fp32 frequencies of the `main` (ratio-0 layers) or `compress` table."""
    if table == "main":
        return _base_inv_freq(cfg.rope_theta, cfg.qk_rope_head_dim)
    if table == "compress":
        rs = cfg.rope_scaling
        return _yarn_inv_freq(cfg.compress_rope_theta, cfg.qk_rope_head_dim, rs.factor,
                              rs.original_max_position_embeddings, rs.beta_fast, rs.beta_slow)
    raise ValueError(f"unknown RoPE table '{table}' (accepted: main, compress)")


def rope_tables(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return {"main": inv_freq(cfg, "main"), "compress": inv_freq(cfg, "compress")}
