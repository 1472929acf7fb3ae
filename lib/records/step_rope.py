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
    cos: torch.Tensor          # [N, rope_dim/2] cos(position * theta_i), N: the token rows (or entries)
    sin: torch.Tensor          # [N, rope_dim/2]
    entries: dict = {}         # ratio m -> StepRope of the entries the step completes, at m * e, in
                               # batch.state.writes[m] order (views of the same product)
    rotation: tuple = ()       # (matrices [N, rope_dim, rope_dim] fp32,): each row's block-diagonal rotation, the
                               # composite's batched product (backends/common/rope.py); () if not made
    rotary: tuple = ()         # the in-place rotary's r1, r2 and -r2 [1, N, 1, rope_dim] bf16 (ascend910); () if not made
    kernel: tuple = ()         # an entries record's (cos, sin) [min(T, T // m + S), rope_dim] bf16 per channel: the
                               # fused compressor's rope rows, these entries then cos 1 / sin 0 (ascend910); () if not made

    def to(self, dtype: torch.dtype) -> "StepRope":
        """The angles in `dtype`, without the forms a backend made of them (the frequencies stay fp32)."""
        return StepRope(self.inv_freq, self.cos.to(dtype), self.sin.to(dtype),
                        {m: e.to(dtype) for m, e in self.entries.items()})

    def rows(self, lo: int, hi: int) -> "StepRope":
        """Rows [lo, hi) of every field (views)."""
        return StepRope(self.inv_freq, self.cos[lo:hi], self.sin[lo:hi], {},
                        tuple(m[lo:hi] for m in self.rotation), tuple(r[:, lo:hi] for r in self.rotary))


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


def split(whole: StepRope, rows: int, spans: dict[int, tuple[int, int]]) -> StepRope:
    """The record of one table over `step_positions`: the token rows, each ratio's entries under them."""
    return whole.rows(0, rows)._replace(entries={m: whole.rows(a, b) for m, (a, b) in spans.items()})
