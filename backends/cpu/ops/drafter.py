"""Reference DSpark drafter ops (DSV4-REFERENCE §5.2): context features and block attention.

The drafter reads the target through `main_hidden` (mean over streams of the tapped layers'
outputs) and attends, per stage, over a ring of the target's committed positions plus its own
draft block with no causal mask. fp64 inside, fp32 out, as every reference op
(backends/cpu/ops/basic.py says why).
"""
from __future__ import annotations

import torch

from backends.cpu.ops.attention import _softmax_with_sink
from lib.records.batch import Batch


def stream_mean(x: torch.Tensor) -> torch.Tensor:
    """[T, n, d] -> [T, d]: the plain mean over the hyper-connection streams."""
    return x.double().mean(dim=1).float()


def context_features(taps: list[torch.Tensor]) -> torch.Tensor | None:
    """Tapped features [T, d] each, in tap order -> main_hidden [T, k*d]; None without taps."""
    return torch.cat(taps, dim=-1) if taps else None


def dspark_attention(q: torch.Tensor, kv: torch.Tensor, batch: Batch, rings: list[torch.Tensor],
                     sink: torch.Tensor) -> torch.Tensor:
    """q [T, H, D], kv [T, D] of the draft blocks; rings[s] [<=W, D] (RoPE applied) -> o [T, H, D].

    Every query of a block sees its whole ring and its whole block: the drafts are predicted
    jointly, so there is no mask at all (filled ring slots only are passed in)."""
    d = q.shape[-1]
    out = torch.empty(q.shape, dtype=torch.float32)
    for seg in batch.segments():
        keys = torch.cat((rings[seg.index].double(), kv[seg.lo:seg.hi].double()))        # [r + n, D]
        logits = torch.einsum("thd,kd->thk", q[seg.lo:seg.hi].double(), keys) / d ** 0.5
        out[seg.lo:seg.hi] = (_softmax_with_sink(logits, sink.double()) @ keys).float()
    return out
