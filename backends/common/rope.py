"""Interleaved partial RoPE from plain tensor ops (L11: the 310P rotary op has no interleaved mode).

Angles are position * theta in fp32 (as the reference), the rotation is done in fp32 and the
result returned in x's dtype; the inverse rotation negates the sine.
"""
from __future__ import annotations

import torch


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rope_dim: int,
         inverse: bool = False) -> torch.Tensor:
    """x [T, D] or [T, H, D]: rotate pairs (x[2i], x[2i+1]) of the trailing rope_dim channels."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]          # [T, rope_dim/2]
    if x.dim() == 3:
        angles = angles[:, None, :]
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    d = x.shape[-1]
    pairs = x[..., d - rope_dim:].float().unflatten(-1, (rope_dim // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., : d - rope_dim], rotated.to(x.dtype)), dim=-1)
