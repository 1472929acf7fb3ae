"""Hyper-connections as composites in fp32 (L10: no fused mHC op on 310P; the vllm-ascend fused
hc_pre accepts only D in {4096, 7168}).

The residual-stream state X stays fp32 on every device backend (fp16 streams overflow, L02);
the collapsed sub-layer input `u` is returned in the backend's compute dtype (`dtype`).
"""
from __future__ import annotations

import torch

from backends.common import dense
from lib.emulation.invariant_matmul import matmul


def hc_expand(e: torch.Tensor, streams: int) -> torch.Tensor:
    return e.float().unsqueeze(1).expand(-1, streams, -1).contiguous()


def _mix(x: torch.Tensor, fn: torch.Tensor, norm_eps: float, rms=dense.rms) -> torch.Tensor:
    """The unweighted RMS of the flattened streams (fp32, `rms`: a device's RMSNorm kernel or the composite), times fn^T."""
    return matmul(rms(x.float().flatten(1), None, norm_eps), fn.float().t())


def hc_pre(x, fn, base, scale, iters: int, norm_eps: float, hc_eps: float, *, dtype: torch.dtype, rms=dense.rms):
    """X [T, n, d] (fp32) -> (u [T, d] in `dtype`, post [T, n], comb [T, n, n]) (fp32).

    All 2n + n*n mixing logits are one product and one sum: each column's scale (scale[0] over the pre columns,
    scale[1] over the post, scale[2] over the comb) held as a column vector made once per weight, the same fp32
    product per element as the reference's three. The gates are one sigmoid (over every column), and the collapse sum_j pre_j X_j one
    batched product (the Sinkhorn is the rest). The logits keep the reference's separate product and sum: an
    addcmul there (a fused multiply-add, one rounding) changed the last bit of a fifth of them, and through the
    Sinkhorn that flipped a decisive token of the tiny Pro-shaped checkpoint on ascend310p (conformance). The
    collapse's batched product and hc_post's addcmul measured within the same conformance budgets."""
    n = x.shape[1]
    m = _mix(x, fn, norm_eps, rms)                                             # [T, 2n + n*n]
    logits = m * _column_scales(scale, n) + base.float()
    gates = torch.sigmoid(logits)          # the comb columns' too: one contiguous kernel (a strided slice's
    pre, post = gates[:, :n] + hc_eps, 2 * gates[:, n:2 * n]                  # sigmoid can round its tails apart)
    comb = _sinkhorn(torch.softmax(logits[:, 2 * n:].unflatten(-1, (n, n)), dim=-1), iters, hc_eps)
    return _collapse(pre, x).to(dtype), post, comb


def _column_scales(scale: torch.Tensor, n: int) -> torch.Tensor:
    """[2n + n*n] fp32: scale[0] over the pre columns, scale[1] over the post, scale[2] over the comb (made once per
    weight)."""
    def make():
        s = scale.float()
        return torch.cat((s[0:1].expand(n), s[1:2].expand(n), s[2:3].expand(n * n)))     # fixed shapes (L12)
    return dense.derived(scale, (n,), make)


def _collapse(pre: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """u = sum_j pre_j X_j in fp32 [T, d]: one batched [1, n] x [n, d] product per token."""
    return torch.bmm(pre.unsqueeze(1), x.float()).squeeze(1)


def _sinkhorn(probs: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """probs [T, n, n] fp32 (each row's softmax) -> the reference's normalisation of comb = probs + eps: a
    column step first, then `iters - 1` (row, column) pairs, each dividing by (sum + eps): two launches per step,
    not three.

    comb sits in a [T, n+1, n+1] frame whose last column and last row hold eps and whose corner holds 1 - n*eps:
    probs padded with zeros plus a constant frame (eps everywhere, 1 - n*eps in the corner; made once), which
    adds the reference's + eps to every entry of comb in the same sum. A row step sums each row over all n+1
    columns (the sum and the + eps in one reduction) and divides the first n columns in place; the eps column is
    never divided, and the last row sums to one, so dividing it changes nothing. A column step is the same along
    the other axis. Same equations as the reference (DSV4-REFERENCE §3.4); the sums differ from
    sum-then-add-eps by fp32 rounding order only."""
    n = probs.shape[-1]
    frame = torch.nn.functional.pad(probs, (0, 1, 0, 1)) + _eps_frame(n, eps, probs.device)
    inner_rows, inner_cols = frame[:, :, :n], frame[:, :n, :]
    inner_cols.div_(frame.sum(dim=-2, keepdim=True))
    for _ in range(iters - 1):
        inner_rows.div_(frame.sum(dim=-1, keepdim=True))
        inner_cols.div_(frame.sum(dim=-2, keepdim=True))
    return frame[:, :n, :n]


def _eps_frame(n: int, eps: float, device) -> torch.Tensor:
    """[n+1, n+1] fp32: eps everywhere but the corner, 1 - n*eps there (made once per (n, eps, device))."""
    def make():
        frame = torch.full((n + 1, n + 1), eps, dtype=torch.float32, device=device)
        frame[n, n] = 1.0 - n * eps
        return frame
    return dense.once(("hc eps frame", n, eps, str(device)), make)


def hc_post(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X_k <- post_k * y + sum_j comb[j, k] X_j, in fp32 (comb's FIRST index contracts): the mix, then the
    sub-layer output added in one addcmul."""
    mixed = torch.einsum("tjk,tjd->tkd", comb.float(), x.float())
    return torch.addcmul(mixed, post.float().unsqueeze(-1), y.float().unsqueeze(1))


def hc_head(x, fn, base, scale, norm_eps: float, hc_eps: float, *, dtype: torch.dtype, rms=dense.rms) -> torch.Tensor:
    m = _mix(x, fn, norm_eps, rms)
    pre = torch.sigmoid(scale.float() * m + base.float()) + hc_eps
    return _collapse(pre, x).to(dtype)
