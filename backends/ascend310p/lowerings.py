"""ascend310p lowerings: the shared composites bound to fp16 and to the 310P device ops.

Every function has its graph op's port signature (profile.yaml names it). Device ops come only
from backends/ascend310p/device_ops.py, so on a real 310P they are torch_npu kernels and on a CPU
they are the quirk-faithful emulation; this module must not know which.
"""
from __future__ import annotations

import functools

import torch

from backends.ascend310p import device_ops as device
from backends.common import attention, dense, engram, hc, moe, shared_kv
from lib.distributed import process_group as parallel
from lib.records.expert_placement import ExpertPlacement
from lib.quant.runtime_formats import W8A8, PackedFP4, packed_fp4_to_w8a8, quantize_rows

DTYPE = torch.float16
UNPERMUTE_HIDDEN_MULTIPLE = 128     # npu_moe_token_unpermute needs hidden % 128 == 0 (L08)


def rms_norm(x, weight, eps: float):
    y, _ = device.npu_rms_norm(x.to(DTYPE), weight, eps)
    return y


_rms = dense.gamma_rms(device.npu_rms_norm)     # the unweighted and fp32 RMSs too, one npu_rms_norm each


def hc_pre(x, fn, base, scale, iters: int, norm_eps: float, hc_eps: float):
    return hc.hc_pre(x, fn, base, scale, iters, norm_eps, hc_eps, dtype=DTYPE, rms=_rms)


def hc_head(x, fn, base, scale, norm_eps: float, hc_eps: float):
    return hc.hc_head(x, fn, base, scale, norm_eps, hc_eps, dtype=DTYPE, rms=_rms)


# DeepSeek-V4.1's own ops (shifted mHC, Engram, the shared compressed KV) with this device's RMSNorm kernel bound
hc_mix = functools.partial(hc.hc_mix, rms=_rms)
hc_collapse = functools.partial(hc.hc_collapse, dtype=DTYPE)
engram_inject = functools.partial(engram.engram_inject, rms=_rms)
latent_compress = functools.partial(shared_kv.latent_compress, rms=_rms)


head_rms_norm = functools.partial(dense.head_rms_norm, rms=_rms)       # the op's lowerings with the kernel bound
compress = functools.partial(attention.compress, rms=_rms)


def linear_w8a8(x, weight: W8A8):
    """Dynamic per-token int8 quant + int8 GEMM + dequant, one fused 310P op (fp16 out)."""
    return device.npu_quant_matmul_dequant(x.to(DTYPE), weight.qweight, weight.scale)


def _grouped(x, weight: W8A8, group_list):
    """Grouped W8A8 GEMM; a single group is padded with a zero second group (L09)."""
    q, s = weight.qweight, weight.scale
    if q.shape[0] == 1:
        q = torch.cat((q, torch.zeros_like(q)))
        s = torch.cat((s, torch.ones_like(s)))
        group_list = torch.cat((group_list, group_list[-1:]))
    return device.npu_quant_grouped_matmul_dequant(x.to(DTYPE), q, s, group_list)


def grouped_linear_w8a8(x, weight: W8A8, groups: int):
    """wo_a: head group g [T, H/G*D] through rows [gR, (g+1)R) as a grouped GEMM over G groups -> [T, G, R]."""
    t = x.shape[0]
    xg = x.reshape(t, groups, -1).transpose(0, 1).reshape(groups * t, -1)          # rows grouped by g
    wg = W8A8(weight.qweight.reshape(groups, -1, weight.qweight.shape[-1]), weight.scale.reshape(groups, -1))
    group_list = _cumulative_groups(groups, t)                                     # cumulative (L07)
    y = _grouped(xg, wg, group_list)                                               # [G*T, R]
    return y.reshape(groups, t, -1).transpose(0, 1)             # [T, G, R], a view: o_proj reads group-major rows


def _cumulative_groups(groups: int, rows: int) -> torch.Tensor:
    """[groups] int64 cumulative group list of `groups` groups of `rows` rows each (L07), in one kernel."""
    if rows == 0:
        return torch.zeros(groups, dtype=torch.int64)
    return torch.arange(rows, (groups + 1) * rows, rows, dtype=torch.int64)


def o_proj_w8a8(x, weight: W8A8, groups: int, group=None):
    """wo_b as one grouped W8A8 GEMM over its o_groups (weight: w8a8_group, [G, d, R] + [G, d]).
    Rows are (group, token), so the op's per-row dynamic quantisation scales each group's vector
    alone, as the field's TP=8 ranks (one group each) did; the fp16 group products are summed in
    fp32 (exact unless they span more than ~10 binades) over the groups and the TP ranks, rounded
    to fp16 once."""
    t = x.shape[0]
    xg = x.to(DTYPE).reshape(t, groups, -1).transpose(0, 1).reshape(groups * t, -1)    # rows grouped by g
    group_list = _cumulative_groups(groups, t)                                         # cumulative (L07)
    y = _grouped(xg, weight, group_list)                                               # [G*T, d] fp16
    # summed in fp32 by the reduction itself (each term widened exactly, the same adds in the same order as
    # widening first), not after a separate widening copy
    return parallel.all_reduce(y.reshape(groups, t, -1).sum(0, dtype=torch.float32), group).to(DTYPE)


def shared_expert_w8a8(x, w1: W8A8, w3: W8A8 | None, w2: W8A8, limit: float):
    """gate/up with fp16 output (INT32 output is refused on 310P, L03), clipped SwiGLU in fp32,
    then the down projection requantises the activation per token. w3 None: w1 holds gate | up (profile
    merged_weights, halves), one GEMM whose output is widened once."""
    return linear_w8a8(moe.gate_up_swiglu(lambda w: linear_w8a8(x, w), w1, w3, limit).to(DTYPE), w2)


def _as_w8a8(w: W8A8 | PackedFP4, quantize) -> W8A8:
    """Resident/preconverted experts are W8A8 already; streaming ones are requantised now (L18)."""
    return packed_fp4_to_w8a8(w, quantize) if isinstance(w, PackedFP4) else w


def routed_experts(x, weights, ids, w1, w3, w2, placement: ExpertPlacement, shared, limit: float,
                   zero_tail: bool = True, quantize=quantize_rows, shared_weight: float = 1.0):
    """The combined routed rows plus the shared expert's output (one add: 310P's combine kernel takes no
    shared rows, aclnnMoeFinalizeRoutingV2 on Atlas inference products). `zero_tail`, `quantize` and
    `shared_weight` are fault sites: conformance renders B10 / B03 / B09 through them."""
    w1, w3, w2 = (_as_w8a8(w, quantize) for w in (w1, w3, w2))
    routed = moe.grouped_moe(x, weights, ids, w1, w3, w2, placement, limit, init_routing=device.npu_moe_init_routing_v2,
                             gmm=_grouped, unpermute=device.npu_moe_token_unpermute, dtype=DTYPE,
                             unpermute_multiple=UNPERMUTE_HIDDEN_MULTIPLE, zero_tail=zero_tail)
    return moe.add_shared(routed, shared, shared_weight)
