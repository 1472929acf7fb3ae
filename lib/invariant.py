"""Matmul whose result for a row does not depend on how many rows come with it (CPU emulation).

CPU BLAS picks kernels and blockings by shape: row 0 of A[:m] @ B changes with m (measured here:
fp32 with K=1024, N=24 differs between m = 3 and m = 43; a single row takes a gemv path that
differs from every m >= 2). A device gives a token the same answer in any batch only if its
kernels do; the emulation models such a device, because the engine's guarantees (a request's
tokens do not depend on its batch; DSpark's verify of six rows equals six one-row decodes) are
tested here and must not fail through an artefact of the host BLAS. So on CPU every row is its
own batch item of one bmm (same kernel, same order, whatever the count); on a real device the
plain matmul runs and batch invariance is the kernels' property.
"""
from __future__ import annotations

import torch


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., K] @ b [K, N] -> [..., N]."""
    if not a.is_cpu:
        return a @ b
    lead = a.shape[:-1]
    rows = a.reshape(-1, 1, a.shape[-1])                                   # [M, 1, K]
    out = torch.bmm(rows, b.unsqueeze(0).expand(rows.shape[0], -1, -1))     # [M, 1, N]
    return out.reshape(*lead, b.shape[-1])


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] -> [B, M, N], where row m of item i does not depend on M either.

    Attention's heads are the M of a per-token product, and tensor parallelism changes how many
    heads a rank holds: measured here, one head's fp32 logits differ between M = 8 and M = 2 (one
    process vs TP=4), which flipped a greedy token on ascend910. On CPU each of the B*M rows is its
    own batch item again, at the cost of B's operand repeated M times (emulation-sized shapes)."""
    if not a.is_cpu:
        return torch.bmm(a, b)
    batch, m = a.shape[:2]
    rows = a.reshape(batch * m, 1, a.shape[-1]).contiguous()                           # [B*M, 1, K]
    # contiguous whatever B is: with B = 1 the reshape is a stride-0 view, and BLAS rounds a
    # strided operand differently (one decoded token against a verify of six broke otherwise)
    shared = b.unsqueeze(1).expand(batch, m, *b.shape[1:]).reshape(batch * m, *b.shape[1:]).contiguous()
    return torch.bmm(rows, shared).reshape(batch, m, b.shape[-1])
