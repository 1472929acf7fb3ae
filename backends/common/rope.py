"""Interleaved partial RoPE from plain tensor ops (L11: the 310P rotary op has no interleaved mode).

Angles are position * theta in fp32 (as the reference), made once per step for every table
(`rope_angles`, lib/records/step_rope.py: one product, cos and sin over the token rows and the
entries the step completes, instead of three kernels in each of a layer's 4-6 rope calls), and so is
each row's rotation as a [rope_dim, rope_dim] block-diagonal matrix: a rope call is then one batched
product of the rope channels with their rows' matrices (the inverse with the transposed matrices, a
view) written back into those channels of x in place. The rotation is done in fp32 and the result
rounded to x's dtype.
"""
from __future__ import annotations

import torch

from lib.records.step_rope import StepRope, split, step_positions


def rope_angles(batch, *, tables: dict, rotation: bool = True) -> dict[str, StepRope]:
    """{table: StepRope} at the batch's positions and at m * e of the entries it completes (fp32), with
    every row's rotation matrix (one product, cos, sin and the matrices over the rows and entries together);
    `rotation=False` for a backend that rotates with a kernel of its own (its composites then make the
    matrices of the rows they rotate)."""
    positions, spans = step_positions(batch)
    p = positions.float()[:, None]
    out = {}
    for name, inv_freq in tables.items():
        angles = p * inv_freq.float()[None, :]                                 # [N, rope_dim/2]
        cos, sin = angles.cos(), angles.sin()
        whole = StepRope(inv_freq, cos, sin, rotation=(rotation_matrices(cos, sin),) if rotation else ())
        out[name] = split(whole, batch.positions.shape[0], spans)
    return out


def rotation_matrices(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[N, rope_dim, rope_dim] fp32, block-diagonal: pair i of a row vector, (a, b) @ [[cos_i, sin_i],
    [-sin_i, cos_i]] = (a cos_i - b sin_i, a sin_i + b cos_i), DeepSeek-V4's interleaved rotation; every other
    entry an exact zero, so a product with it adds nothing to a rotated pair."""
    n, half = cos.shape
    blocks = torch.stack((cos, sin, -sin, cos), dim=-1).unflatten(-1, (2, 2))    # [N, half, 2, 2]
    diagonal = torch.diag_embed(blocks.permute(0, 2, 3, 1))                      # [N, 2, 2, half, half]
    return diagonal.permute(0, 3, 1, 4, 2).reshape(n, 2 * half, 2 * half)


def rope(x: torch.Tensor, angles, rope_dim: int, inverse: bool = False) -> torch.Tensor:
    """x [T, D] or [T, H, D]; angles: the step's rotation of this table (a StepRope of its rows or of a
    ratio's entries) or a (cos, sin) pair [T, rope_dim/2]: the trailing rope_dim channels of each row times
    its rotation matrix (transposed for the inverse) in one batched product, written back into x's own rope
    channels (the copy rounds to x's dtype): x is overwritten and returned (the profiles declare the op
    `consumes: [x]`, and the build checks no later step reads it)."""
    if isinstance(angles, StepRope) and angles.rotation:
        (matrices,) = angles.rotation
    else:
        cos, sin = (angles.cos, angles.sin) if isinstance(angles, StepRope) else angles
        matrices = rotation_matrices(cos.float(), sin.float())
    if inverse:
        matrices = matrices.transpose(-1, -2)                                  # the inverse rotation: a view
    tail = x[..., x.shape[-1] - rope_dim:]
    wide = tail.float()
    rotated = torch.bmm(wide if x.dim() == 3 else wide.unsqueeze(1), matrices)
    tail.copy_(rotated.view(tail.shape))
    return x
