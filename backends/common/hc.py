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
    """X [T, n, d] (fp32) -> (u [T, d] in `dtype`, post [T, n], comb [T, n, n]) (fp32): hc_mix's coefficients, the
    streams collapsed with this sub-layer's own pre (V4)."""
    pre, post, comb = hc_mix(x, fn, base, scale, iters, norm_eps, hc_eps, rms=rms)
    return _collapse(pre, x).to(dtype), post, comb


def hc_mix(x, fn, base, scale, iters: int, norm_eps: float, hc_eps: float, *, rms=dense.rms):
    """X [T, n, d] -> (pre [T, n], post [T, n], comb [T, n, n]) fp32.

    All 2n + n*n mixing logits are one product and one sum: each column's scale (scale[0] over the pre columns,
    scale[1] over the post, scale[2] over the comb) held as a column vector made once per weight, the same fp32
    product per element as the reference's three. The gates are one sigmoid (over every column), and the Sinkhorn
    the rest. The logits keep the reference's separate product and sum: an addcmul there (a fused multiply-add,
    one rounding) changed the last bit of a fifth of them, and through the Sinkhorn that flipped a decisive token
    of the tiny Pro-shaped checkpoint on ascend310p (conformance)."""
    n = x.shape[1]
    m = _mix(x, fn, norm_eps, rms)                                             # [T, 2n + n*n]
    logits = m * _column_scales(scale, n) + base.float()
    gates = torch.sigmoid(logits)          # the comb columns' too: one contiguous kernel (a strided slice's
    pre, post = gates[:, :n] + hc_eps, 2 * gates[:, n:2 * n]                  # sigmoid can round its tails apart)
    comb = _sinkhorn(torch.softmax(logits[:, 2 * n:].unflatten(-1, (n, n)), dim=-1), iters, hc_eps)
    return pre, post, comb


def hc_collapse(x, pre, *, dtype: torch.dtype) -> torch.Tensor:
    """V4.1's collapse of a sub-layer's streams with the previous sub-layer's pre: u [T, d] in `dtype`."""
    return _collapse(pre.float(), x).to(dtype)


def hc_first_pre(x: torch.Tensor) -> torch.Tensor:
    """[T, n] fp32 one-hot on stream 0 (V4.1's layer 0 collapses its equal streams with it): a constant of the row
    count, made once."""
    def make(rows: int) -> torch.Tensor:
        pre = torch.zeros(rows, x.shape[1], device=x.device)
        pre[:, 0] = 1.0
        return pre
    return dense.leading(("hc first pre", x.shape[1], str(x.device)), x.shape[0], make)


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
    column step first, then `iters - 1` (row, column) pairs, each dividing by (sum + eps). Computed on the logs,
    where a step is one log_softmax: three launches per pair (the frame restored, a row step, a column step)
    instead of four (a sum and a divide per step).

    comb sits in a [T, n+1, n+1] frame whose last column and last row hold eps and whose corner holds 1 - n*eps
    (probs padded with zeros plus a constant frame, made once): the eps column adds the reference's + eps to
    each row's sum, the eps row to each column's. On the logs, a row step log_softmax(., -1) subtracts
    log(row sum over all n+1 columns) = log(sum + eps), the reference's divide; but it also shifts the row's
    own eps entry, which the next row step needs intact. The last row sums to one, so a row step leaves it
    as it is, and a column step reads it intact; the column step shifts it in turn. So one select per pair
    (torch.where with the log frame, an out-of-place elementwise kernel, not a strided write) puts both back
    before the row step. Same equations as the reference (DSV4-REFERENCE §3.4); measured against it in fp64 on
    random logits at scales 0.1-200 (tests/backends/test_hc_sinkhorn.py), within the error of the reference's
    own division chain run in fp32."""
    n = probs.shape[-1]
    frame, log_frame, edge = _eps_frame(n, eps, probs.device)
    logs = torch.log(torch.nn.functional.pad(probs, (0, 1, 0, 1)) + frame)
    logs = torch.log_softmax(logs, dim=-2)
    for _ in range(iters - 1):
        logs = torch.log_softmax(torch.where(edge, log_frame, logs), dim=-1)
        logs = torch.log_softmax(logs, dim=-2)
    return logs[:, :n, :n].exp()


def _eps_frame(n: int, eps: float, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The [n+1, n+1] fp32 frame (eps everywhere but the corner, 1 - n*eps there), its logs, and the bool mask
    of its last row and column (made once per (n, eps, device))."""
    def make():
        frame = torch.full((n + 1, n + 1), eps, dtype=torch.float64)
        frame[n, n] = 1.0 - n * eps
        edge = torch.zeros((n + 1, n + 1), dtype=torch.bool)
        edge[n, :] = True
        edge[:, n] = True
        return frame.float().to(device), frame.log().float().to(device), edge.to(device)
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
