"""Reference partial interleaved RoPE and its inverse (DSV4-REFERENCE §3.5).

Only the trailing `rope_dim` channels rotate; pairs are (x[2i], x[2i+1]) within that slice.
Angles are position * theta in fp32 (as the official and peer implementations compute them);
the rotation itself runs in fp64 and rounds once (backends/cpu/ops/basic.py says why).
"""
from __future__ import annotations

import torch


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rope_dim: int,
         inverse: bool = False) -> torch.Tensor:
    """x [T, D] or [T, H, D]; positions [T]; rotates x[..., D-rope_dim:] by +-position*theta."""
    angles = (positions.float()[:, None] * inv_freq.float()[None, :]).double()   # [T, rope_dim/2]
    if x.dim() == 3:
        angles = angles[:, None, :]
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    nope, rot = x[..., : x.shape[-1] - rope_dim], x[..., x.shape[-1] - rope_dim:]
    pairs = rot.double().unflatten(-1, (rope_dim // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((nope.float(), rotated.float()), dim=-1)
