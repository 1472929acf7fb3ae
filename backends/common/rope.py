"""Interleaved partial RoPE from plain tensor ops (L11: the 310P rotary op has no interleaved mode).

Angles are position * theta in fp32 (as the reference), made once per step for every table
(`rope_angles`, lib/records/step_rope.py: one product, cos and sin over the token rows and the
entries the step completes, instead of three kernels in each of a layer's 4-6 rope calls); the
rotation is done in fp32 and the result returned in x's dtype; the inverse rotation negates the sine.
The rows' sine is also kept per pair with its signs, so a call swaps the pair (one flip) instead of
negating and stacking it.
"""
from __future__ import annotations

import torch

from lib.records.step_rope import StepRope, split, step_positions


def rope_angles(batch, *, tables: dict) -> dict[str, StepRope]:
    """{table: StepRope} at the batch's positions and at m * e of the entries it completes (fp32), with
    the paired sine the rotation multiplies the swapped pair (b, a) by: (-sin, sin), and (sin, -sin)
    for the inverse (one product and one stack over the rows and entries together)."""
    positions, spans = step_positions(batch)
    p = positions.float()[:, None]
    out = {}
    for name, inv_freq in tables.items():
        angles = p * inv_freq.float()[None, :]                                 # [N, rope_dim/2]
        sin = angles.sin()
        paired = torch.stack((-sin, sin), dim=-1)                              # [N, rope_dim/2, 2]
        whole = StepRope(inv_freq, angles.cos(), sin, paired=(paired, -paired))
        out[name] = split(whole, batch.positions.shape[0], spans)
    return out


def rope(x: torch.Tensor, angles, rope_dim: int, inverse: bool = False) -> torch.Tensor:
    """x [T, D] or [T, H, D]; angles: the step's rotation of this table (a StepRope of its rows or of a
    ratio's entries) or a (cos, sin) pair [T, rope_dim/2]: rotate pairs (a, b) = (x[2i], x[2i+1]) of the
    trailing rope_dim channels to (a cos - b sin, b cos + a sin) = pairs * cos + (b, a) * (-sin, sin)
    in one addcmul (the paired sine's signs carry the inverse)."""
    if isinstance(angles, StepRope) and angles.paired:
        cos, paired = angles.cos, angles.paired[1 if inverse else 0]
    else:
        cos, sin = (angles.cos, angles.sin) if isinstance(angles, StepRope) else angles
        paired = torch.stack((sin, -sin) if inverse else (-sin, sin), dim=-1).float()
    cos = cos.float().unsqueeze(-1)                                            # [T, rope_dim/2, 1]
    if x.dim() == 3:
        cos, paired = cos[:, None], paired[:, None]
    d = x.shape[-1]
    pairs = x[..., d - rope_dim:].float().unflatten(-1, (rope_dim // 2, 2))
    rotated = torch.addcmul(pairs * cos, pairs.flip(-1), paired).flatten(-2)
    return torch.cat((x[..., : d - rope_dim], rotated.to(x.dtype)), dim=-1)
