"""ascend910 lowerings: BF16 compute, W8A8 and W4A8 through the 910B quantised torch_npu ops.

W8A8 linears are `npu_dynamic_quant` + `npu_quant_matmul` with per-token scales; routed experts
are W4A8 grouped matmuls between `npu_moe_init_routing_v2` and `npu_moe_token_unpermute`
(L21). This module must not know whether the device ops are real kernels or the emulation.
"""
from __future__ import annotations

import torch

from backends.ascend910 import device_ops as device
from backends.common import hc, moe
from lib.records.expert_placement import ExpertPlacement
from lib.quant.runtime_formats import W4A8, W8A8

DTYPE = torch.bfloat16
INT4 = torch.quint4x2       # torch_npu's marker for int4 packed 8 per int32


def rms_norm(x, weight, eps: float):
    y, _ = device.npu_rms_norm(x.to(DTYPE), weight, eps)
    return y


def hc_pre(x, fn, base, scale, iters: int, norm_eps: float, hc_eps: float):
    return hc.hc_pre(x, fn, base, scale, iters, norm_eps, hc_eps, dtype=DTYPE)


def hc_head(x, fn, base, scale, norm_eps: float, hc_eps: float):
    return hc.hc_head(x, fn, base, scale, norm_eps, hc_eps, dtype=DTYPE)


def rope(x, positions, inv_freq, rope_dim: int, inverse: bool = False):
    """npu_rotary_mul in interleave mode on the trailing rope_dim channels (4-D BSND view)."""
    angles = positions.float()[:, None] * inv_freq.float()[None, :]
    cos = angles.cos().repeat_interleave(2, dim=-1)                        # [T, rope_dim], per pair
    sin = angles.sin().repeat_interleave(2, dim=-1) * (-1.0 if inverse else 1.0)
    d = x.shape[-1]
    tail = x[..., d - rope_dim:]
    heads = tail.reshape(1, x.shape[0], -1, rope_dim)                     # [1, T, N, rd]
    r1, r2 = (t.to(x.dtype)[None, :, None, :] for t in (cos, sin))
    rotated = device.npu_rotary_mul(heads, r1, r2, rotary_mode="interleave").reshape(tail.shape)
    return torch.cat((x[..., : d - rope_dim], rotated), dim=-1)


def linear_w8a8(x, weight: W8A8):
    """Per-token dynamic int8 activations x int8 weight rows, bf16 out (L21)."""
    xq, xs = device.npu_dynamic_quant(x.to(DTYPE))
    return device.npu_quant_matmul(xq, weight.qweight.t(), weight.scale, pertoken_scale=xs, output_dtype=DTYPE)


def shared_expert_w8a8(x, w1: W8A8, w3: W8A8, w2: W8A8, limit: float):
    act = moe.clipped_swiglu(linear_w8a8(x, w1), linear_w8a8(x, w3), limit)
    return linear_w8a8(act.to(DTYPE), w2)


def _gmm_w4a8(x, w: W4A8, group_list):
    xq, xs = device.npu_dynamic_quant(x.to(DTYPE))
    (y,) = device.npu_grouped_matmul([xq], [w.qweight], scale=[w.scale], per_token_scale=[xs], group_list=group_list,
                                     split_item=2, group_type=0, group_list_type=0, output_dtype=DTYPE,
                                     weight_dtype=INT4)
    return y


def routed_experts(x, weights, ids, w1: W4A8, w3: W4A8, w2: W4A8, placement: ExpertPlacement, limit: float,
                   zero_tail: bool = True):
    return moe.grouped_moe(x, weights, ids, w1, w3, w2, placement, limit, init_routing=device.npu_moe_init_routing_v2,
                           gmm=_gmm_w4a8, unpermute=device.npu_moe_token_unpermute, dtype=DTYPE, zero_tail=zero_tail)
