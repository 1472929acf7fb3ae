"""Reference manifold-constrained hyper-connections (DSV4-REFERENCE §3.2-3.4).

State X [T, n, d] carries n residual streams. `hc_pre` computes (pre, post, comb) from X and
collapses it; `hc_post` expands a sub-layer output back and mixes the residual with comb^T;
`hc_head` is the final collapse before the output norm. Computed in fp64, rounded to fp32
(backends/cpu/ops/basic.py says why).
"""
from __future__ import annotations

import torch

from backends.cpu.ops.basic import wide


def hc_expand(e: torch.Tensor, streams: int) -> torch.Tensor:
    """[T, d] -> [T, n, d]: the initial state repeats the embedding in every stream (§3.1)."""
    return e.float().unsqueeze(1).expand(-1, streams, -1).contiguous()


def _mix_logits(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """r * (fn @ vec(X)) with r = 1/RMS over all n*d values (§3.3 steps 1-3), fp64."""
    flat = x.to(wide.dtype).flatten(1)                                       # [T, n*d]
    r = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return (flat * r) @ fn.to(wide.dtype).t()


def _sinkhorn_dims(iters: int) -> list[int]:
    """The dims of Sinkhorn's normalisations in order: columns first, then rows and columns in turn."""
    return [-2] + [-1, -2] * (iters - 1)


def _normalisations(probs: torch.Tensor, iters: int, eps: float):
    """Yields (output, denominator) of each of Sinkhorn's normalisations of softmax probabilities, in order: a caller
    without gradients keeps only the last output, the autograd Function every one."""
    c = probs + eps
    for dim in _sinkhorn_dims(iters):
        den = c.sum(dim=dim, keepdim=True) + eps
        c = c / den
        yield c, den


class _Sinkhorn(torch.autograd.Function):
    """Sinkhorn with its backward written per normalisation: y = c / (sum c + eps) gives
    dc = (dy - sum(dy * y)) / (sum c + eps), four ops where autograd's division backward takes about ten and a
    graph node each; the forward is the same ops as without gradients, so the values are too."""

    @staticmethod
    def forward(ctx, c0: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
        probs = torch.softmax(c0, dim=-1)
        outs, dens = zip(*_normalisations(probs, iters, eps))
        ctx.iters = iters
        ctx.save_for_backward(probs, *outs, *dens)
        return outs[-1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        probs, *saved = ctx.saved_tensors
        steps = len(saved) // 2
        outs, dens = saved[:steps], saved[steps:]
        for dim, out, den in zip(reversed(_sinkhorn_dims(ctx.iters)), reversed(outs), reversed(dens)):
            grad = (grad - (grad * out).sum(dim=dim, keepdim=True)) / den
        return probs * (grad - (grad * probs).sum(dim=-1, keepdim=True)), None, None


def sinkhorn(c0: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[T, n, n] logits -> near doubly-stochastic matrix (§3.3 step 8; `iters` counts the first pass)."""
    if c0.requires_grad and torch.is_grad_enabled():          # training: the hand-written backward
        return _Sinkhorn.apply(c0, iters, eps)
    c = None
    for c, _ in _normalisations(torch.softmax(c0, dim=-1), iters, eps):
        pass
    return c


def hc_coefficients(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                    iters: int, norm_eps: float, hc_eps: float):
    """X [T, n, d] -> (pre [T, n], post [T, n], comb [T, n, n]) in fp64 (§3.3). V4 collapses a sub-layer's input
    with its own pre (hc_pre); V4.1 with the previous sub-layer's."""
    n = x.shape[1]
    m = _mix_logits(x, fn, norm_eps)                                   # [T, (2+n)*n]
    base, scale = base.to(wide.dtype), scale.to(wide.dtype)
    pre = torch.sigmoid(scale[0] * m[:, :n] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(scale[1] * m[:, n:2 * n] + base[n:2 * n])
    comb = sinkhorn((scale[2] * m[:, 2 * n:] + base[2 * n:]).unflatten(-1, (n, n)), iters, hc_eps)
    return pre, post, comb


def hc_pre(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           iters: int, norm_eps: float, hc_eps: float):
    """X [T, n, d] -> (u [T, d], post [T, n], comb [T, n, n])."""
    pre, post, comb = hc_coefficients(x, fn, base, scale, iters, norm_eps, hc_eps)
    u = (pre.unsqueeze(-1) * x.to(wide.dtype)).sum(dim=1)
    return u.float(), post.float(), comb.float()


def hc_mix(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           iters: int, norm_eps: float, hc_eps: float):
    """X [T, n, d] -> (pre [T, n], post [T, n], comb [T, n, n]): V4.1's coefficients, the streams left as they are
    (V41-REFERENCE §3.1: a sub-layer's input is collapsed with the previous sub-layer's pre, hc_collapse)."""
    pre, post, comb = hc_coefficients(x, fn, base, scale, iters, norm_eps, hc_eps)
    return pre.float(), post.float(), comb.float()


def hc_collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_i pre_i X_i: X [T, n, d], pre [T, n] -> [T, d]."""
    return (pre.to(wide.dtype).unsqueeze(-1) * x.to(wide.dtype)).sum(dim=1).float()


def hc_first_pre(x: torch.Tensor) -> torch.Tensor:
    """[T, n]: one-hot on stream 0, what V4.1's layer 0 collapses its streams (all equal there) with."""
    pre = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32)
    pre[:, 0] = 1.0
    return pre


def hc_post(y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X_k <- post_k * y + sum_j comb[j, k] X_j (the residual mix contracts comb's FIRST index)."""
    mixed = torch.einsum("tjk,tjd->tkd", comb.to(wide.dtype), x.to(wide.dtype))
    return (post.to(wide.dtype).unsqueeze(-1) * y.to(wide.dtype).unsqueeze(1) + mixed).float()


def hc_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            norm_eps: float, hc_eps: float) -> torch.Tensor:
    """Final collapse (§3.4): pre_j = sigmoid(s*m_j + b_j) + eps, no Sinkhorn; -> [T, d]."""
    m = _mix_logits(x, fn, norm_eps)                                   # [T, n]
    pre = torch.sigmoid(scale.to(wide.dtype) * m + base.to(wide.dtype)) + hc_eps
    return (pre.unsqueeze(-1) * x.to(wide.dtype)).sum(dim=1).float()
