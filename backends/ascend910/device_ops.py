"""Ascend 910B / 910C (Atlas A2 / A3) device ops. Each function has exactly torch_npu 2.14.0's name and
signature (data/torch_npu-2.14.0-npu-op-schemas.txt; vllm-ascend's DeepSeek-V4 custom ops in
data/vllm_ascend-dsv4-op-schemas.txt) and is the registered torch op dsv4gen::<op>.ascend910; it calls
torch_npu (or torch.ops._C_ascend) when that imports and an NPU is present, else the CPU emulation
(lib/emulation/npu_ops.py, soc "910b", and lib/emulation/vllm_ascend_ops.py; the 910-only ops live here).
Must not know the model, tensor names, the planner, or any other chip.
"""
from __future__ import annotations

from types import MappingProxyType

import torch

from lib.emulation import compressor_kernel
from lib.emulation.int_numerics import pack_int4
from lib.emulation import lightning_indexer as indexer
from lib.emulation import moe_finalize
from lib.emulation import npu_ops as emu
from lib.emulation import sharedkv_attention as sas
from lib.emulation import vllm_ascend_ops as fused
from lib.emulation.npu_ops import BF16, F16, I8, I32, I64, INT4
from lib.emulation.registered import device_op

CHIP = "ascend910"   # the overload name of its registered ops: torch.ops.dsv4gen.<op>.ascend910
SOC = "910b"

# op -> lessons (data/porting-lessons.yaml) whose device behaviour the emulation reproduces. L05 (rows past
# the group list left unwritten) was seen on 310P; nothing documents it as 310P-only, so 910 emulates it too.
DEVICE_OPS = MappingProxyType({
    "npu_dynamic_quant": ("L21",),
    "npu_quant_matmul": ("L21",),
    "npu_grouped_matmul": ("L05", "L21"),
    "npu_moe_init_routing_v2": ("L06",),
    "npu_moe_token_unpermute": (),
    "npu_moe_finalize_routing": (),
    "npu_rms_norm": (),
    "npu_scatter_nd_update_": (),
    "npu_hc_pre_v2": ("L22",),
    "npu_hc_post": ("L22",),
    "moe_gating_top_k_hash": ("L22",),
    "npu_sparse_attn_sharedkv": ("L22",),
    "npu_sparse_attn_sharedkv_metadata": ("L22",),
    "npu_lightning_indexer": ("L22",),
    "compressor": ("L22",),
    "inplace_partial_rotary_mul": ("L22",),
    "npu_dequant_swiglu_quant": ("L21", "L22"),
    "npu_rms_norm_dynamic_quant": ("L22",),
})
_DESCRIPTIVE = (None, 1, 3, 16, 285, I8, I32, INT4)  # *_dtype values that only restate int8 / packed-int4 storage


@device_op("npu_dynamic_quant", CHIP, SOC)
def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None,  # noqa: A002 - schema name
                      quant_mode="pertoken", dst_type_max=0.0):
    if (real := emu.real_npu_op("npu_dynamic_quant")) is not None:
        return emu.forward(real, locals())
    return _dynamic_quant(input, smooth_scales, group_index, dst_type, quant_mode, dst_type_max)


@device_op("npu_quant_matmul", CHIP, SOC)
def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None,
                     x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None,
                     y_scale=None):
    if (real := emu.real_npu_op("npu_quant_matmul")) is not None:
        return emu.forward(real, locals())
    emu.need(x1_dtype in _DESCRIPTIVE and x2_dtype in _DESCRIPTIVE, "910B npu_quant_matmul: only int8 and "
             "int4-in-int32 operands are emulated (fp8 / hifloat8 / fp4 views are not)", NotImplementedError)
    return emu.quant_matmul(x1, x2, scale, offset, pertoken_scale, bias, output_dtype, group_sizes, y_scale, soc=SOC)


@device_op("npu_grouped_matmul", CHIP, SOC)
def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, tuning_config=None, output_dtype=None, x_dtype=None,
                       weight_dtype=None, scale_dtype=None, per_token_scale_dtype=None):
    if (real := emu.real_npu_op("npu_grouped_matmul")) is not None:
        return emu.forward(real, locals())
    emu.need(activation_input is None and activation_quant_scale is None and activation_quant_offset is None
             and x_dtype in _DESCRIPTIVE, "910B npu_grouped_matmul: activation_* inputs and fp8 / hifloat8 x are "
             "not emulated", NotImplementedError)
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
    # research/torch_npu.md documents no hidden-size multiple for 910 (L08 is a 310P finding)
    if (real := emu.real_npu_op("npu_moe_token_unpermute")) is not None:
        return emu.forward(real, locals())
    return emu.moe_token_unpermute(permuted_tokens, sorted_indices, probs, padded_mode, restore_shape, soc=SOC)


@device_op("npu_moe_finalize_routing", CHIP, SOC)
def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode=0, k=1):
    """The routed rows combined back per token with the shared expert's rows added (skip1), in one kernel
    (lib/emulation/moe_finalize.py)."""
    if (real := emu.real_npu_op("npu_moe_finalize_routing")) is not None:
        return emu.forward(real, locals())
    return moe_finalize.moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales,
                                             expanded_src_to_dst_row, export_for_source_row, drop_pad_mode, k)


@device_op("npu_rms_norm", CHIP, SOC)
def npu_rms_norm(input, gamma, epsilon=1e-06):  # noqa: A002 - the schema's name
    if (real := emu.real_npu_op("npu_rms_norm")) is not None:
        return emu.forward(real, locals())
    return emu.rms_norm(input, gamma, epsilon, soc=SOC)


@device_op("npu_dequant_swiglu_quant", CHIP, SOC)
def npu_dequant_swiglu_quant(x, *, weight_scale=None, activation_scale=None, bias=None, quant_scale=None,
                             quant_offset=None, group_index=None, activate_left=False, quant_mode=0, dst_type=None,
                             round_mode=None, activate_dim=None, swiglu_mode=0, clamp_limit=7.0, glu_alpha=1.702,
                             glu_bias=1.0):
    """aclnnDequantSwigluQuantV2 on A2/A3 (cann/ops-nn quant/dequant_swiglu_quant/docs/aclnnDequantSwigluQuantV2.md):
    x dequantised (int32 x * weight_scale * activation_scale; a bf16 / fp16 x as it is), a SwiGLU in fp32, then
    each row quantised to int8 (quant_mode 1: dynamic per row, scale amax / 127). swiglu_mode 1 is the clipped
    variant on x's even | odd columns: g = min(even, L), y = g sigmoid(alpha g) (clamp(odd, -L, L) + bias), which
    is DeepSeek-V4's clipped SwiGLU at alpha 1, bias 0; the doc requires activate_left true with swiglu_mode 1. Emulated:
    swiglu_mode 1, dynamic quantisation, no bias, smoothing or group_index (the 950-only dst_type / round_mode /
    activate_dim left at their defaults)."""
    if (real := emu.real_npu_op("npu_dequant_swiglu_quant")) is not None:
        return emu.forward(real, locals())
    op = "npu_dequant_swiglu_quant"
    emu.need(swiglu_mode == 1 and quant_mode == 1 and bias is None and quant_scale is None and quant_offset is None
             and group_index is None and dst_type is None and round_mode is None and activate_dim is None,
             f"{op}: only swiglu_mode 1 with dynamic quantisation (quant_mode 1), no bias / quant_scale / "
             "quant_offset / group_index and the 950-only arguments unset are emulated", NotImplementedError)
    emu.need(activate_left, f"{op}: swiglu_mode 1 requires activate_left=True (aclnnDequantSwigluQuantV2.md)")
    emu.need(2 <= x.dim() <= 8 and x.shape[-1] % 2 == 0, f"{op}: x needs 2-8 dims and an even last dim, found "
             f"{tuple(x.shape)}")
    if x.dtype == I32:
        emu.need(weight_scale is not None and activation_scale is not None, f"{op}: an int32 x needs weight_scale "
                 "and activation_scale")
        xf = x.float() * weight_scale.float() * activation_scale.float().unsqueeze(-1)
    else:
        emu.check_float(emu.chip(SOC), op, frozenset({F16, BF16}), x)
        emu.need(weight_scale is None and activation_scale is None, f"{op}: a {x.dtype} x takes no dequant scales")
        xf = x.float()
    g, u = xf.unflatten(-1, (-1, 2)).unbind(-1)
    g = g.clamp(max=clamp_limit)
    y = g * torch.sigmoid(glu_alpha * g) * (u.clamp(-clamp_limit, clamp_limit) + glu_bias)
    q, scale = emu.quantize_symmetric(y, 127)
    return q, scale.squeeze(-1)


@device_op("npu_rms_norm_dynamic_quant", CHIP, SOC)
def npu_rms_norm_dynamic_quant(x, gamma, smooth_scale=None, beta=None, epsilon=1e-6):
    """vllm-ascend's fused RMSNorm + per-token int8 quantisation (torch.ops._C_ascend): y = RmsNorm(x) * gamma (+ beta)
    rounded to x's dtype, then cast to fp32 (times smooth_scale) and quantised symmetrically per row, as CANN's
    AddRmsNormDynamicQuant documents the same chain (yFP32 = cast(y)): the composite npu_rms_norm then
    npu_dynamic_quant, bit for bit."""
    if (real := fused.real_op("npu_rms_norm_dynamic_quant")) is not None:
        return emu.forward(real, locals())
    y, _ = emu.rms_norm(x, gamma, epsilon, soc=SOC)
    if beta is not None:
        y = (y.float() + beta.float()).to(x.dtype)
    return _dynamic_quant(y, smooth_scale, None, None, "pertoken", 0.0)


@device_op("npu_scatter_nd_update_", CHIP, SOC)
def npu_scatter_nd_update_(input, indices, updates):  # noqa: A002 - the schema's name
    if (real := emu.real_npu_op("npu_scatter_nd_update_")) is not None:
        return emu.forward(real, locals())
    return emu.scatter_nd_update_(input, indices, updates, soc=SOC)


@device_op("npu_hc_pre_v2", CHIP, SOC)
def npu_hc_pre_v2(x, hc_fn, hc_scale, hc_base, hc_mult, hc_sinkhorn_iters, norm_eps, hc_eps):
    """vllm-ascend's fused mHC pre (torch.ops._C_ascend): mixing, Sinkhorn and collapse in one kernel."""
    if (real := fused.real_op("npu_hc_pre_v2")) is not None:
        return emu.forward(real, locals())
    return fused.hc_pre_v2(x, hc_fn, hc_scale, hc_base, hc_mult, hc_sinkhorn_iters, norm_eps, hc_eps)


@device_op("npu_hc_post", CHIP, SOC)
def npu_hc_post(x, residual, post, comb):
    """vllm-ascend's fused mHC post (torch.ops._C_ascend): the sub-layer output written back into the streams."""
    if (real := fused.real_op("npu_hc_post")) is not None:
        return emu.forward(real, locals())
    return fused.hc_post(x, residual, post, comb)


@device_op("moe_gating_top_k_hash", CHIP, SOC)
def moe_gating_top_k_hash(x, k, bias=None, input_ids=None, tid2eid=None, k_group=1, group_count=1,
                          routed_scaling_factor=1.0, eps=1e-20, group_select_mode=0, renorm=0, norm_type=0,
                          out_flag=False):
    """vllm-ascend's fused router (torch.ops._C_ascend): scores, top-k or hash lookup, renormalised weights."""
    if (real := fused.real_op("moe_gating_top_k_hash")) is not None:
        return emu.forward(real, locals())
    return fused.moe_gating_top_k_hash(x, k, bias, input_ids, tid2eid, k_group, group_count, routed_scaling_factor,
                                       eps, group_select_mode, renorm, norm_type, out_flag)


@device_op("npu_lightning_indexer", CHIP, SOC)
def npu_lightning_indexer(query, key, weights, *, actual_seq_lengths_query=None, actual_seq_lengths_key=None,
                          block_table=None, layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3,
                          pre_tokens=9223372036854775807, next_tokens=9223372036854775807, return_value=False):
    """torch_npu's DSA indexer: per query, the top sparse_count keys by sum_h w_h relu(q_h . k), highest first."""
    if (real := emu.real_npu_op("npu_lightning_indexer")) is not None:
        return emu.forward(real, locals())
    emu.need(pre_tokens == next_tokens == 2 ** 63 - 1, "npu_lightning_indexer: pre_tokens / next_tokens take only "
             "their defaults")
    return indexer.lightning_indexer(query, key, weights, actual_seq_lengths_query=actual_seq_lengths_query,
                                     actual_seq_lengths_key=actual_seq_lengths_key, block_table=block_table,
                                     layout_query=layout_query, layout_key=layout_key, sparse_count=sparse_count,
                                     sparse_mode=sparse_mode, return_value=return_value)


@device_op("npu_sparse_attn_sharedkv", CHIP, SOC)
def npu_sparse_attn_sharedkv(q, *, ori_kv=None, cmp_kv=None, ori_sparse_indices=None, cmp_sparse_indices=None,
                             ori_block_table=None, cmp_block_table=None, cu_seqlens_q=None, cu_seqlens_ori_kv=None,
                             cu_seqlens_cmp_kv=None, seqused_q=None, seqused_kv=None, sinks=None, metadata=None,
                             softmax_scale=0, cmp_ratio=0, ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=128,
                             ori_win_right=0, layout_q="BSND", layout_kv="PA_ND", return_softmax_lse=False):
    """vllm-ascend's DeepSeek-V4 attention (torch.ops._C_ascend): window KV, compressed entries and sinks in one
    softmax over paged pools. The cu_seqlens of the KV are ignored for PA_ND (README.md:77); ori_sparse_indices
    (DSpark drafting) and seqused_q are not used by the V4 layers and are refused here."""
    if (real := fused.real_op("npu_sparse_attn_sharedkv")) is not None:
        return emu.forward(real, locals())
    emu.need(ori_sparse_indices is None and seqused_q is None and cu_seqlens_q is not None and seqused_kv is not None,
             "npu_sparse_attn_sharedkv: the V4 layers pass cu_seqlens_q and seqused_kv, never ori_sparse_indices "
             "or seqused_q")
    return sas.sparse_attn_sharedkv(
        q, ori_kv=ori_kv, cmp_kv=cmp_kv, cmp_sparse_indices=cmp_sparse_indices, ori_block_table=ori_block_table,
        cmp_block_table=cmp_block_table, cu_seqlens_q=cu_seqlens_q, seqused_kv=seqused_kv, sinks=sinks,
        metadata=metadata, softmax_scale=softmax_scale, cmp_ratio=cmp_ratio, ori_mask_mode=ori_mask_mode,
        cmp_mask_mode=cmp_mask_mode, ori_win_left=ori_win_left, ori_win_right=ori_win_right, layout_q=layout_q,
        layout_kv=layout_kv, return_softmax_lse=return_softmax_lse)


@device_op("npu_sparse_attn_sharedkv_metadata", CHIP, SOC)
def npu_sparse_attn_sharedkv_metadata(num_heads_q, num_heads_kv, head_dim, cu_seqlens_q=None, cu_seqlens_ori_kv=None,
                                      cu_seqlens_cmp_kv=None, seqused_q=None, seqused_kv=None, batch_size=0,
                                      max_seqlen_q=0, max_seqlen_kv=0, ori_topk=0, cmp_topk=0, cmp_ratio=4,
                                      ori_mask_mode=4, cmp_mask_mode=3, ori_win_left=128, ori_win_right=0,
                                      layout_q="BSND", layout_kv="PA_ND", has_ori_kv=True, has_cmp_kv=True, device="npu"):
    """The attention kernel's tiling buffer (int32 [1024]) for one layer shape and step."""
    if (real := fused.real_op("npu_sparse_attn_sharedkv_metadata")) is not None:
        return emu.forward(real, locals())
    return sas.metadata(num_heads_q, num_heads_kv, head_dim, batch_size=batch_size, cmp_topk=cmp_topk,
                        cmp_ratio=cmp_ratio, ori_mask_mode=ori_mask_mode, cmp_mask_mode=cmp_mask_mode,
                        ori_win_left=ori_win_left, ori_win_right=ori_win_right, layout_q=layout_q,
                        layout_kv=layout_kv, has_cmp_kv=has_cmp_kv, device=None if device == "npu" else device)


@device_op("compressor", CHIP, SOC)
def compressor(x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos, state_block_table, cu_seqlens, seqused,
               start_pos, rope_head_dim, cmp_ratio, coff, norm_eps, rotary_mode, cache_mode):
    """vllm-ascend's DeepSeek-V4 compressor (torch.ops._C_ascend): projections into the paged state, then every
    entry the step completes pooled, normalised and rotated, packed in batch order."""
    if (real := fused.real_op("compressor")) is not None:
        return emu.forward(real, locals())
    return compressor_kernel.compressor(x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos,
                                        state_block_table, cu_seqlens, seqused, start_pos, rope_head_dim, cmp_ratio,
                                        coff, norm_eps, rotary_mode, cache_mode)


@device_op("inplace_partial_rotary_mul", CHIP, SOC)
def inplace_partial_rotary_mul(x, r1, r2, rotary_mode, partial_slice):
    """vllm-ascend's in-place rotary on a channel slice (torch.ops._C_ascend): DeepSeek-V4's trailing rope channels
    of q, kv and the attention output rotated where they are, no concatenation."""
    if (real := fused.real_op("inplace_partial_rotary_mul")) is not None:
        return emu.forward(real, locals())
    return fused.inplace_partial_rotary_mul(x, r1, r2, rotary_mode, partial_slice)


def _dynamic_quant(x, smooth_scales, group_index, dst_type, quant_mode, dst_type_max):
    """Symmetric dynamic quantisation: scale = amax|x * smooth| / DTYPE_MAX (127 int8, 7 int4) over the token
    (pertoken, scale shape x.shape[:-1]), the tensor ([1]) or the channel ([H]); y = round(x * smooth / scale),
    half to even, clamped symmetric. int4 (dst_type quint4x2) packs 8 per int32 along the last dim, element 8j+i
    in bits 4i..4i+3 (int_numerics.pack_int4) - the same order npu_grouped_matmul's W4A8 weights use here."""
    c, op = emu.chip(SOC), "npu_dynamic_quant"
    emu.check_float(c, op, frozenset({F16, BF16}), x)
    emu.need(x.dim() >= 2, f"{op}: input needs >= 2 dims, found {tuple(x.shape)}")
    dt = emu.as_dtype(dst_type, op) or I8
    emu.need(dt in (I8, INT4) and dst_type_max == 0.0, f"{op}: only int8 / int4 outputs are emulated "
             "(dst_type_max is for fp8 / hifloat8)", NotImplementedError)
    h, smooth = x.shape[-1], smooth_scales
    if smooth_scales is not None and group_index is not None:  # MoE: smooth_scales [E, H] per group of rows
        rows = x.numel() // h
        bounds = emu.group_bounds(group_index, smooth_scales.shape[0], rows, 0, op, (I32, I64))
        emu.need(bounds[-1][1] == rows, f"{op}: group_index must cover all {rows} rows")
        per_row = torch.repeat_interleave(torch.arange(len(bounds)), torch.tensor([b - a for a, b in bounds]))
        smooth = smooth_scales[per_row].reshape(x.shape)
    dims = {"pertoken": (-1,), "pertensor": tuple(range(x.dim())), "perchannel": tuple(range(x.dim() - 1))}
    emu.need(quant_mode in dims, f"{op}: quant_mode {quant_mode!r} not in {sorted(dims)}")
    q, s = emu.quantize_symmetric(x, 127 if dt == I8 else 7, dims[quant_mode], smooth)
    shape = {"pertoken": x.shape[:-1], "pertensor": (1,), "perchannel": (h,)}[quant_mode]
    return (pack_int4(q) if dt == INT4 else q), s.reshape(shape)
