"""A RoPE table's rotation at one step's positions, made once per step (the `rope_angles` op).

Every rope of a step rotates by the same positions (the batch's), and the compressors rotate the
entries the step completes at m * e: 4-6 rope calls a layer recomputed the same cos and sin before.
The model and drafter programs make one record per table at their start and every layer reads it,
as vllm-ascend's `compressor_metadata` makes the compressor's cos / sin once per step.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class StepRope(NamedTuple):
    inv_freq: torch.Tensor     # [rope_dim/2] fp32 frequencies theta_i (for positions the step did not make)
    cos: torch.Tensor          # [T, rope_dim/2] cos(position * theta_i) of each token row
    sin: torch.Tensor          # [T, rope_dim/2]
    entries: dict              # ratio m -> (cos, sin) [K_m, rope_dim/2] at m * e of the entries the step
                               # completes, in batch.state.writes[m] order (views of one product)
    device: tuple = ()         # the rows' rotation in the form a backend's rotary kernel takes, made with
                               # the angles (ascend910: npu_rotary_mul's r1, r2 and -r2); () where none

    def to(self, dtype: torch.dtype) -> "StepRope":
        """The angles in `dtype` (the frequencies stay fp32; no device form: it is the maker's)."""
        return StepRope(self.inv_freq, self.cos.to(dtype), self.sin.to(dtype),
                        {m: (c.to(dtype), s.to(dtype)) for m, (c, s) in self.entries.items()})


def step_positions(batch) -> tuple[torch.Tensor, dict[int, tuple[int, int]]]:
    """[T + sum K_m] int64: the token rows' positions, then m * e of each ratio's completed entries;
    and where each ratio's entries sit in it (lo, hi). One product per table covers all of them."""
    writes = batch.state.writes if batch.state is not None else {}
    parts, spans, lo = [batch.positions], {}, batch.positions.shape[0]
    for m, w in writes.items():
        parts.append(w.ids * m)
        spans[m] = (lo, lo + w.ids.shape[0])
        lo += w.ids.shape[0]
    return (torch.cat(parts) if len(parts) > 1 else batch.positions), spans


def split(inv_freq: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: int,
          spans: dict[int, tuple[int, int]]) -> StepRope:
    """The record of one table from its cos / sin over `step_positions` (views, no copies)."""
    return StepRope(inv_freq, cos[:rows], sin[:rows], {m: (cos[a:b], sin[a:b]) for m, (a, b) in spans.items()})
