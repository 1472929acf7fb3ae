"""Interleaved partial RoPE from plain tensor ops (L11: the 310P rotary op has no interleaved mode).

Angles are position * theta in fp32 (as the reference), the rotation is done in fp32 and the
result returned in x's dtype; the inverse rotation negates the sine.
"""
from __future__ import annotations

import torch


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rope_dim: int,
         inverse: bool = False) -> torch.Tensor:
    """x [T, D] or [T, H, D]: rotate pairs (a, b) = (x[2i], x[2i+1]) of the trailing rope_dim channels to
    (a cos - b sin, b cos + a sin): pairs * cos + (-b, a) * sin in one addcmul (the sine's sign carries
    the inverse), eleven kernels where the pair-by-pair products took sixteen."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]          # [T, rope_dim/2]
    if x.dim() == 3:
        angles = angles[:, None, :]
    cos, sin = angles.cos().unsqueeze(-1), angles.sin().unsqueeze(-1)         # [..., rope_dim/2, 1]
    d = x.shape[-1]
    pairs = x[..., d - rope_dim:].float().unflatten(-1, (rope_dim // 2, 2))
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1)              # (-b, a)
    rotated = torch.addcmul(pairs * cos, turned, sin, value=-1.0 if inverse else 1.0).flatten(-2)
    return torch.cat((x[..., : d - rope_dim], rotated.to(x.dtype)), dim=-1)
