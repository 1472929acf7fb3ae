"""Reference token-parallel ops: embedding, norms, linears, grouped output projection (§3.1, §3.6).

Tensors are fp32 between ops; inside an op everything is computed in fp64 and rounded to fp32
once on the way out. BLAS and reduction kernels pick different blockings and summation orders
for different row counts (a decode step's M=1 gemv and a prefill gemm differ by ~1e-6 relative),
and the oracle must give the same answer for a token whatever batch or chunk it arrives in
(prefill(n) + decode == prefill(n+k), L24). fp64 inside makes that hold to the last fp32 bit in
practice; the results are still the fp32 values of the exact equations. `computing_in` lowers that inner dtype
for a scope: training (lib/training) needs gradients, not last-bit stability, and fp32 halves the memory traffic
of every op at the tiny widths, where that traffic and not arithmetic is the cost.
"""
from __future__ import annotations

import contextlib

import torch

from lib.distributed import process_group as parallel


class _Wide:
    dtype = torch.float64     # what every op here computes in before rounding to fp32


wide = _Wide()


@contextlib.contextmanager
def computing_in(dtype: torch.dtype):
    """Run the reference ops in `dtype` inside (torch.float64 outside any such scope)."""
    saved, wide.dtype = wide.dtype, dtype
    try:
        yield
    finally:
        wide.dtype = saved


def gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """table[index] for an integer index of any shape -> [*index.shape, *table.shape[1:]], through index_select:
    the same values, and its backward is an index_add (advanced indexing's is a sorted index_put, several times
    slower on CPU when thousands of rows read a few hundred pool rows)."""
    return table.index_select(0, index.reshape(-1)).view(*index.shape, *table.shape[1:])


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp64, rounded to fp32."""
    return (a.to(wide.dtype) @ b.to(wide.dtype)).float()


def embed(tokens: torch.Tensor, table: torch.Tensor, *, shard: int = 0, shards: int = 1) -> torch.Tensor:
    """[T] ids -> [T, d] rows of the embedding table (no scaling, §3.1). With `shards` > 1 the table
    holds rows [shard*n, (shard+1)*n): ids elsewhere give zero rows, completed by a tp_sum."""
    if shards == 1:
        return table.index_select(0, tokens).float()
    n = table.shape[0]
    local = tokens - shard * n
    mine = (local >= 0) & (local < n)
    rows = table.index_select(0, local.clamp(0, n - 1)).float()
    return torch.where(mine[:, None], rows, 0.0)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.to(wide.dtype)
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim (§2)."""
    return (weight.to(wide.dtype) * _rms(x, eps)).float()


def head_rms_norm(x: torch.Tensor, heads: int, eps: float) -> torch.Tensor:
    """[T, heads*D] -> [T, heads, D] with an unweighted RMS norm per head (§3.6 step 2)."""
    return _rms(x.unflatten(-1, (heads, -1)), eps).float()


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x W^T with W stored [out, in] (§2)."""
    return matmul(x, weight.t())


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[T, heads*D] -> [T, heads, D]."""
    return x.unflatten(-1, (heads, -1))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped low-rank projection wo_a (§3.6 step 7).

    x [T, H, D] -> heads split into `groups` contiguous groups; group g's [H/G*D] vector goes
    through rows [g*R, (g+1)*R) of weight [G*R, H/G*D]; result [T, G, R].
    """
    t = x.shape[0]
    xg = x.to(wide.dtype).reshape(t, groups, -1)                         # [T, G, H/G*D]
    wg = weight.to(wide.dtype).reshape(groups, -1, xg.shape[-1])         # [G, R, H/G*D]
    return torch.einsum("tgi,gri->tgr", xg, wg).float()                  # [T, G, R]


def o_proj(x: torch.Tensor, weight: torch.Tensor, groups: int, group=None) -> torch.Tensor:
    """wo_b (§3.6 step 8): x [T, G, R] -> [T, d], summed over this rank's G groups in fp64 and then
    over the TP group (all-reduce in fp64) before the one rounding to fp32."""
    t = x.shape[0]
    xg = x.to(wide.dtype).reshape(t, groups, -1)                            # [T, G, R]
    wg = weight.to(wide.dtype).reshape(weight.shape[0], groups, -1)         # [d, G, R]
    return parallel.all_reduce(torch.einsum("tgr,dgr->td", xg, wg), group).float()


def take_rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """x [T, d] -> x[rows] [R, d]; all rows when `rows` is None."""
    return x if rows is None else x.index_select(0, rows)
