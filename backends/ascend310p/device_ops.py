"""Ascend 310P (Atlas 300I Duo) device ops. Each function has exactly torch_npu 2.14.0's name and signature
(data/torch_npu-2.14.0-npu-op-schemas.txt) and is the registered torch op dsv4gen::<op>.ascend310p; it calls torch_npu when that imports and an NPU is present, else
the quirk-faithful CPU emulation (lib/emulation/npu_ops.py, soc "310p"; the 310P-only fused W8A8 ops live here).
Must not know the model, tensor names, the planner, or any other chip.
"""
from __future__ import annotations

from types import MappingProxyType

import torch

from lib.emulation import npu_ops as emu
from lib.emulation.npu_ops import F16, F32, I8
from lib.emulation.registered import device_op

CHIP = "ascend310p"   # the overload name of its registered ops: torch.ops.dsv4gen.<op>.ascend310p
SOC = "310p"

# op -> lessons (data/porting-lessons.yaml) whose device behaviour the emulation reproduces
DEVICE_OPS = MappingProxyType({
    "npu_quant_matmul": ("L03",),
    "npu_quant_matmul_dequant": ("L02",),
    "npu_quant_grouped_matmul_dequant": ("L02", "L05", "L07", "L09"),
    "npu_grouped_matmul": ("L02", "L05", "L07", "L09"),
    "npu_moe_init_routing_v2": ("L06", "L07"),
    "npu_moe_token_unpermute": ("L08",),
    "npu_rms_norm": ("L02",),
    "npu_scatter_nd_update_": ("L02",),
})
# torch_npu's docs list npu_moe_init_routing_v2 / npu_moe_token_unpermute for A2/A3 only, yet the 310P field
# port (PORTING-LESSONS report 000) called both and hit L06/L07/L08: the shims follow the field report.


@device_op("npu_quant_matmul", CHIP, SOC)
def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                     x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None,
                     y_scale=None):
    if (real := emu.real_npu_op("npu_quant_matmul")) is not None:
        return emu.forward(real, locals())
    emu.need(x1_dtype in (None, 1, I8) and x2_dtype in (None, 1, I8), "310P npu_quant_matmul: int8 operands only")
    return emu.quant_matmul(x1, x2, scale, offset, pertoken_scale, bias, output_dtype, group_sizes, y_scale, soc=SOC)


@device_op("npu_quant_matmul_dequant", CHIP, SOC)
def npu_quant_matmul_dequant(x, quantized_weight, weight_scale, *, bias=None, x_scale=None, x_offset=None,
                             smooth_scale=None, quant_mode='pertoken'):
    if (real := emu.real_npu_op("npu_quant_matmul_dequant")) is not None:
        return emu.forward(real, locals())
    return _quant_dequant_matmul(x, quantized_weight, weight_scale, None, bias, x_scale, x_offset, smooth_scale,
                                 quant_mode)


@device_op("npu_quant_grouped_matmul_dequant", CHIP, SOC)
def npu_quant_grouped_matmul_dequant(x, quantized_weight, weight_scale, group_list, *, bias=None, x_scale=None,
                                     x_offset=None, smooth_scale=None, quant_mode='pertoken'):
    if (real := emu.real_npu_op("npu_quant_grouped_matmul_dequant")) is not None:
        return emu.forward(real, locals())
    return _quant_dequant_matmul(x, quantized_weight, weight_scale, group_list, bias, x_scale, x_offset,
                                 smooth_scale, quant_mode)


@device_op("npu_grouped_matmul", CHIP, SOC)
def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, tuning_config=None, output_dtype=None, x_dtype=None,
                       weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None):
    if (real := emu.real_npu_op("npu_grouped_matmul")) is not None:
        return emu.forward(real, locals())
    emu.need(activation_input is None and activation_quant_scale is None and activation_quant_offset is None
             and x_dtype in (None, 5, F16), "310P npu_grouped_matmul: fp16 only, no activation_* inputs")
    return emu.grouped_matmul(x, weight, bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale,
                              group_list, split_item, group_type, group_list_type, act_type, output_dtype,
                              weight_dtype, soc=SOC)


@device_op("npu_moe_init_routing_v2", CHIP, SOC)
def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=-1, active_expert_range=(), row_idx_type=0, x_dtype=None):
    if (real := emu.real_npu_op("npu_moe_init_routing_v2")) is not None:
        return emu.forward(real, locals())
    return emu.moe_init_routing(x, expert_idx, scale, offset, active_num, expert_num, drop_pad_mode,
                                expert_tokens_num_type, quant_mode, active_expert_range, row_idx_type, x_dtype,
                                soc=SOC)


@device_op("npu_moe_token_unpermute", CHIP, SOC)
def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    if (real := emu.real_npu_op("npu_moe_token_unpermute")) is not None:
        return emu.forward(real, locals())
    return emu.moe_token_unpermute(permuted_tokens, sorted_indices, probs, padded_mode, restore_shape, soc=SOC)


@device_op("npu_rms_norm", CHIP, SOC)
def npu_rms_norm(input, gamma, epsilon=1e-06):  # noqa: A002 - the schema's name
    if (real := emu.real_npu_op("npu_rms_norm")) is not None:
        return emu.forward(real, locals())
    return emu.rms_norm(input, gamma, epsilon, soc=SOC)


@device_op("npu_scatter_nd_update_", CHIP, SOC)
def npu_scatter_nd_update_(input, indices, updates):  # noqa: A002 - the schema's name
    if (real := emu.real_npu_op("npu_scatter_nd_update_")) is not None:
        return emu.forward(real, locals())
    return emu.scatter_nd_update_(input, indices, updates, soc=SOC)


def _quant_dequant_matmul(x, w, w_scale, group_list, bias, x_scale, x_offset, smooth_scale, quant_mode):
    """Fused W8A8 (CANN aclnnQuantGroupedMatmulDequant, listed for 310P only): out = (x_q @ W^T) * w_scale * s_x
    (+ bias), fp16 [M, N]. x_scale None: dynamic per-token quantisation, s_x = rowmax|x * smooth| / 127 and
    x_q = round(x * smooth / s_x) (half to even) clamped to [-127, 127] (symmetric; the clamp only catches fp32
    rounding above 127). A given x_scale quantises statically, saturating to [-128, 127]. Grouped: group_list
    int64 [E] cumulative row ends (L07); rows [gl[g-1], gl[g]) use expert g; rows past gl[-1] are never
    written (L05); E == 1 is rejected (L09)."""
    c = emu.chip(SOC)
    op = "npu_quant_matmul_dequant" if group_list is None else "npu_quant_grouped_matmul_dequant"
    emu.check_float(c, op, frozenset({F16}), x)
    emu.need(x.dim() == 2, f"{op}: x must be fp16 [M, K], found {tuple(x.shape)}")
    wdim = 2 if group_list is None else 3
    emu.need(w.dtype == I8 and w.dim() == wdim and w.shape[-1] == x.shape[1], f"{op}: quantized_weight must be "
             f"int8 {'[N, K]' if wdim == 2 else '[E, N, K]'} with K={x.shape[1]}, found {w.dtype} {tuple(w.shape)}")
    emu.need(w_scale.dtype == F32 and w_scale.shape == w.shape[:-1], f"{op}: weight_scale must be float32 "
             f"{list(w.shape[:-1])}, found {w_scale.dtype} {tuple(w_scale.shape)}")
    emu.need(x_offset is None, f"{op}: x_offset (asymmetric static quantisation) is not emulated",
             NotImplementedError)
    emu.need(quant_mode in ("pertoken", "pertensor"), f"{op}: quant_mode {quant_mode!r} (pertoken / pertensor)")
    xf = x.float() if smooth_scale is None else x.float() * smooth_scale.float()
    if x_scale is None:
        q, s = emu.quantize_symmetric(xf, 127, (-1,) if quant_mode == "pertoken" else (0, 1))
    else:
        s = x_scale.float().reshape(-1, 1)
        emu.need(s.shape[0] in (1, x.shape[0]), f"{op}: x_scale must be [M] or [1], found {tuple(x_scale.shape)}")
        q = emu.saturate_int8(xf / s)

    def dequant(rows, wg, sg, bg):
        y = emu.int_matmul(q[rows], wg.t()).float() * sg.float() * (s if s.shape[0] == 1 else s[rows])
        return (y if bg is None else y + bg.float()).to(F16)

    if group_list is None:
        return dequant(slice(None), w, w_scale, bias)
    emu.check_experts(c, op, w.shape[0])
    bounds = emu.group_bounds(group_list, w.shape[0], x.shape[0], 0, op)
    out = torch.empty(x.shape[0], w.shape[1], dtype=F16)
    for g, (a, b) in enumerate(bounds):
        out[a:b] = dequant(slice(a, b), w[g], w_scale[g], None if bias is None else bias[g])
    return emu.fill_unwritten(out, bounds[-1][1], x, w, group_list)
