"""Reference partial interleaved RoPE and its inverse (DSV4-REFERENCE §3.5).

Only the trailing `rope_dim` channels rotate; pairs are (x[2i], x[2i+1]) within that slice.
Angles are position * theta in fp32 (as the official and peer implementations compute them), made
once per step for every table (`rope_angles`, lib/records/step_rope.py); their cos / sin and the
rotation itself run in fp64 and round once (backends/cpu/ops/basic.py says why).
"""
from __future__ import annotations

import torch

from backends.cpu.ops.basic import wide

from lib.records.step_rope import StepRope, split, step_positions


def rope_angles(batch, *, tables: dict) -> dict[str, StepRope]:
    """{table: StepRope} at the batch's positions and at m * e of the entries it completes (fp64)."""
    positions, spans = step_positions(batch)
    out = {}
    for name, inv_freq in tables.items():
        angles = (positions.float()[:, None] * inv_freq.float()[None, :]).to(wide.dtype)   # [N, rope_dim/2]
        out[name] = split(StepRope(inv_freq, angles.cos(), angles.sin()), batch.positions.shape[0], spans)
    return out


def rope(x: torch.Tensor, angles, rope_dim: int, inverse: bool = False) -> torch.Tensor:
    """x [T, D] or [T, H, D]; angles: the step's rotation of this table (a StepRope of its rows or of a
    ratio's entries) or a (cos, sin) pair [T, rope_dim/2]; rotates x[..., D-rope_dim:] by +-position*theta."""
    cos, sin = (angles.cos, angles.sin) if isinstance(angles, StepRope) else angles
    cos, sin = cos.to(wide.dtype), sin.to(wide.dtype)
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    if inverse:
        sin = -sin
    nope, rot = x[..., : x.shape[-1] - rope_dim], x[..., x.shape[-1] - rope_dim:]
    pairs = rot.to(wide.dtype).unflatten(-1, (rope_dim // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((nope.float(), rotated.float()), dim=-1)
