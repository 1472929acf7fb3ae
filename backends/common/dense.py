"""Token-parallel composites in a device compute dtype: embedding, norms, dense linears, heads.

Norms and reductions run in fp32 and cast back once (fp16 overflows above 65504, L02); matmuls
keep the activation dtype, as the device's Cube units do, except where a caller asks for fp32
output (the logits).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

from lib.distributed import process_group as parallel
from lib.emulation.invariant_matmul import group_mm, matmul


def embed(tokens: torch.Tensor, table: torch.Tensor, *, shard: int = 0, shards: int = 1) -> torch.Tensor:
    """[T] ids -> [T, d]; int32 gather indices (int64 gathers fall back to the AI-CPU, L13). With
    `shards` > 1 (vocab split over TP) ids outside this rank's rows give zero rows (a three-argument
    where, no boolean-mask write: L12); a tp_sum completes the lookup."""
    if shards == 1:
        return table.index_select(0, tokens.to(torch.int32))
    n = table.shape[0]
    local = (tokens - shard * n).to(torch.int32)
    mine = (local >= 0) & (local < n)
    rows = table.index_select(0, local.clamp(0, n - 1))
    return torch.where(mine[:, None], rows, torch.zeros((), dtype=rows.dtype))


def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) (* weight) over the last dim, computed in fp32, returned in x's dtype:
    the composite a device's one-kernel RMSNorm replaces (`rms=` of the composites here and in
    backends/common/hc.py, attention.py)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (y if weight is None else y * weight.float()).to(x.dtype)


_ONCE: dict = {}      # key -> a tensor a step reads and no step changes
_LEADING: dict = {}   # key -> such a tensor whose leading dim grows to the largest asked for
# rows a leading constant is made with at least: a step of up to this many rows (token rows, or (token, expert)
# pairs) reads a view, so a decode or verify step launches the same kernels in every layer
LEADING_ROWS = 4096


def once(key, make):
    """make() the first time `key` is asked for, the same tensor after: a constant of fixed shape a step reads,
    made once, so a step launches no fill. Not kept when made while torch.export traces a step (it would be the
    tracer's fake tensor)."""
    if key in _ONCE:
        return _ONCE[key]
    made = _made(make)
    if not torch.compiler.is_exporting():
        _ONCE[key] = made
    return made


def _made(make, *args):
    """make(*args) out of sight of a dispatch mode (the capability guard): a constant is made once per process,
    whichever step first asks for it, so no step's launch count includes it. While torch.export traces a step
    it is made in the trace."""
    if torch.compiler.is_exporting():
        return make(*args)
    with _disable_current_modes():
        return make(*args)


# weight -> (the tensors and ints it was derived with, what was derived): per-weight constants, dropped with it
_DERIVED = WeakIdKeyDictionary()


def derived(weight: torch.Tensor, inputs: tuple, make):
    """make() for `weight` and the other `inputs` it is derived with (tensors compared by identity, anything else by
    value), made once per weight and re-made if those inputs change: a weight's runtime form a step reads (padded,
    broadcast), never made per step. Not kept when made while torch.export traces a step."""
    held = _DERIVED.get(weight)
    if held is not None and len(held[0]) == len(inputs) and all(
            a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(held[0], inputs)):
        return held[1]
    made = make()
    if not torch.compiler.is_exporting():
        _DERIVED[weight] = (inputs, made)
    return made


def leading(key, n: int, make) -> torch.Tensor:
    """make(rows)[:n], a view: constants whose leading size follows a step's (aranges, fills of [T, ...]) are held
    once at the largest size asked for (at least LEADING_ROWS, doubling past it), so a step launches no fill and
    the held memory is bounded by the largest step, not by how many sizes were seen."""
    held = _LEADING.get(key)
    if held is None or held.shape[0] < n:
        held = _made(make, max(n, LEADING_ROWS, 2 * held.shape[0] if held is not None else 0))
        if not torch.compiler.is_exporting():
            _LEADING[key] = held
    return held[:n]


def constant(n: int, value: float, dtype: torch.dtype, device) -> torch.Tensor:
    """full(n, value) (a view of a held constant)."""
    return leading(("full", value, dtype, str(device)), n,
                   lambda rows: torch.full((rows,), value, dtype=dtype, device=device))


def arange(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """arange(n) (a view of a held constant)."""
    return leading(("arange", dtype, str(device)), n, lambda rows: torch.arange(rows, dtype=dtype, device=device))


def unit_weight(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """ones(n): the gamma of an unweighted RMS through a kernel that requires one."""
    return constant(n, 1.0, dtype, device)


def gamma_rms(npu_rms_norm):
    """`rms` as one call of torch_npu's `npu_rms_norm(x, gamma, epsilon) -> (y, rstd)`, whose gamma must
    have x's dtype: the weight cast to it (a no-op where it has it), ones where there is none."""
    def rms_kernel(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        gamma = unit_weight(x.shape[-1], x.dtype, x.device) if weight is None else weight.to(x.dtype)
        return npu_rms_norm(x, gamma, eps)[0]
    return rms_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, rms=rms) -> torch.Tensor:
    """weight * x / RMS(x) computed in fp32, returned in the weight's (compute) dtype; an x of another dtype
    (fp32 streams) is normalised before it is rounded."""
    return rms(x, weight, eps) if x.dtype == weight.dtype else rms(x.float(), weight, eps).to(weight.dtype)


def head_rms_norm(x: torch.Tensor, heads: int, eps: float, *, rms=rms) -> torch.Tensor:
    """[T, H*D] -> [T, H, D], unweighted RMS per head in fp32, back in x's dtype."""
    return rms(x.unflatten(-1, (heads, -1)), None, eps)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Unquantised y = x W^T in the weight's dtype (LM head, embeddings and projections kept dense, B06)."""
    return matmul(x.to(weight.dtype), weight.t())


def linear_fp32_out(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y = x W^T accumulated and returned in fp32 (logits: fp16 cannot resolve top-1 margins)."""
    return matmul(x.float(), weight.float().t())


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.unflatten(-1, (heads, -1))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped wo_a with a dense weight [G*R, H/G*D]: x [T, H, D] -> [T, G, R], a view of the one batched
    product's group-major [G, T, R] (o_proj reads it group by group: no copy at any T)."""
    t = x.shape[0]
    xg = x.to(weight.dtype).reshape(t, groups, -1)
    wg = weight.reshape(groups, -1, xg.shape[-1])
    return group_mm(xg.transpose(0, 1), wg.transpose(1, 2)).transpose(0, 1)   # one batched product


def o_proj(x: torch.Tensor, weight: torch.Tensor, groups: int, group=None) -> torch.Tensor:
    """wo_b with a dense weight [d, G*R]: each group's product in the weight's dtype (rounded as a
    TP rank holding that one group would round it), the products summed in fp32 over the groups
    and the TP ranks, rounded once. An fp32 sum of at most o_groups bf16/fp16 values is exact
    unless they span more than ~13 binades, so the TP split does not change the result."""
    t = x.shape[0]
    xg = x.to(weight.dtype).reshape(t, groups, -1)                       # [T, G, R] (a view of grouped_linear's)
    wg = weight.reshape(weight.shape[0], groups, -1)                     # [d, G, R]
    # [G, T, d] products, one launch; summed in fp32 by the reduction itself (each term widened exactly, the same
    # adds in the same order as widening first), not after a separate cast
    total = group_mm(xg.transpose(0, 1), wg.permute(1, 2, 0)).sum(0, dtype=torch.float32)
    return parallel.all_reduce(total, group).to(weight.dtype)


def take_rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return x if rows is None else x.index_select(0, rows.to(torch.int32))
