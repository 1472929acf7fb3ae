"""DSpark drafter ops as device composites (DSV4-REFERENCE §5.2; L10: no fused op on any target).

The block attention is one fixed-shape fp32 softmax per sequence over [ring ; block] with the
sink: no mask is needed because every draft query sees everything it is given. Features are
averaged in fp32 (the residual streams are fp32 on every device backend, L02).
"""
from __future__ import annotations

import torch

from lib.records.batch import Batch
from lib.emulation.invariant_matmul import matmul


def stream_mean(x: torch.Tensor) -> torch.Tensor:
    """[T, n, d] fp32 streams -> [T, d] fp32."""
    return x.float().mean(dim=1)


def context_features(taps: list[torch.Tensor]) -> torch.Tensor | None:
    return torch.cat(taps, dim=-1) if taps else None


def dspark_attention(q, kv, batch: Batch, rings: list[torch.Tensor], sink) -> torch.Tensor:
    """q [T, H, D], kv [T, D] (compute dtype), rings[s] [<=W, D] -> o [T, H, D] in kv's dtype."""
    d = q.shape[-1]
    outs = []
    for seg in batch.segments():
        keys = torch.cat((rings[seg.index].to(kv.dtype), kv[seg.lo:seg.hi])).float()     # [r + n, D]
        logits = matmul(q[seg.lo:seg.hi].float(), keys.t()) / d ** 0.5       # [n, H, r + n]: per row (lib/invariant)
        sk = sink.float()[None, :, None]
        top = torch.maximum(logits.amax(-1, keepdim=True), sk)
        e = torch.exp(logits - top)
        outs.append(matmul(e / (e.sum(-1, keepdim=True) + torch.exp(sk - top)), keys).to(kv.dtype))
    return torch.cat(outs)
