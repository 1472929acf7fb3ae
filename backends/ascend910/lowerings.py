"""ascend910 lowerings: BF16 compute, W8A8 and W4A8 through the 910B quantised torch_npu ops.

W8A8 linears are `npu_dynamic_quant` + `npu_quant_matmul` with per-token scales; routed experts
are W4A8 grouped matmuls between `npu_moe_init_routing_v2` and `npu_moe_token_unpermute`
(L21). This module must not know whether the device ops are real kernels or the emulation.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from backends.ascend910 import device_ops as device
from backends.common import attention, dense, hc, moe, rope as common_rope
from lib.emulation.invariant_matmul import matmul
from lib.records.expert_placement import ExpertPlacement
from lib.records.step_rope import StepRope
from lib.quant.runtime_formats import W4A8, W8A8
from spec.schedule import COMPRESS_TABLE

DTYPE = torch.bfloat16
INT4 = torch.quint4x2       # torch_npu's marker for int4 packed 8 per int32


def rms_norm(x, weight, eps: float):
    y, _ = device.npu_rms_norm(x.to(DTYPE), weight, eps)
    return y


_rms = dense.gamma_rms(device.npu_rms_norm)     # the unweighted and fp32 RMSs too, one npu_rms_norm each


def hc_pre(x, fn, base, scale, iters: int, norm_eps: float, hc_eps: float):
    return hc.hc_pre(x, fn, base, scale, iters, norm_eps, hc_eps, dtype=DTYPE, rms=_rms)


def hc_head(x, fn, base, scale, norm_eps: float, hc_eps: float):
    return hc.hc_head(x, fn, base, scale, norm_eps, hc_eps, dtype=DTYPE, rms=_rms)


head_rms_norm = functools.partial(dense.head_rms_norm, rms=_rms)       # the op's lowerings with the kernel bound
compress = functools.partial(attention.compress, rms=_rms)


def rope_angles(batch, *, tables: dict) -> dict[str, StepRope]:
    """The common angles of every table (cos and sin only: the composites that run where a fused kernel's limits
    fail make the rotation matrices of the rows they rotate), and for the token rows the in-place rotary's r1 = cos and r2 = sin per pair in bf16
    ([1, T, 1, rope_dim]) and -r2 for the inverse, and for each ratio's entries the fused compressor's
    rope rows (StepRope.kernel) of the table compressors read (spec/schedule.py COMPRESS_TABLE): made once per
    step, not in each rope or compress call."""
    out = {}
    for name, step in common_rope.rope_angles(batch, tables=tables, rotation=False).items():
        r1, r2 = (t.repeat_interleave(2, dim=-1).to(DTYPE)[None, :, None, :] for t in (step.cos, step.sin))
        entries = step.entries if name != COMPRESS_TABLE else {
            m: e._replace(kernel=_compressor_rows(e, batch, m)) for m, e in step.entries.items()}
        out[name] = step._replace(rotary=(r1, r2, -r2), entries=entries)
    return out


def _compressor_rows(entries: StepRope, batch, ratio: int) -> tuple:
    """The compressor kernel's rope_cos / rope_sin [min(T, T // m + S), rope_dim] (bf16, per channel): these
    entries' (as many as fit: a bucketed step's padded writes go past them), then cos 1 / sin 0, as vllm-ascend's
    compressor_metadata pads its rows."""
    t, s = batch.positions.shape[0], batch.state.seq_slot.shape[0]
    n = min(t, t // ratio + s)
    k = min(n, entries.cos.shape[0])
    return tuple(torch.nn.functional.pad(v[:k], (0, 0, 0, n - k), value=pad).repeat_interleave(2, dim=-1).to(DTYPE)
                 for v, pad in ((entries.cos, 1.0), (entries.sin, 0.0)))


def rope(x, angles, rope_dim: int, inverse: bool = False):
    """vllm-ascend's inplace_partial_rotary_mul (interleave) on the trailing rope_dim channels of x [T, D] or
    [T, H, D], viewed [T, 1, N, D]: x is overwritten (the profile declares the op `consumes: [x]`, and the
    build checks no later step reads it). angles: the step's rotation of this table (rope_angles), or a
    (cos, sin) pair [T, rope_dim/2]."""
    if isinstance(angles, StepRope) and angles.rotary:
        r1, r2, r2_inverse = angles.rotary
        r2 = r2_inverse if inverse else r2
    else:
        cos, sin = (angles.cos, angles.sin) if isinstance(angles, StepRope) else angles
        r1, r2 = (t.float().repeat_interleave(2, dim=-1).to(x.dtype)[None, :, None, :] for t in (cos, sin))
        r2 = -r2 if inverse else r2
    t, d = x.shape[0], x.shape[-1]
    heads = x.reshape(t, 1, -1, d)                                       # a view of x (a copy only if x is strided)
    device.inplace_partial_rotary_mul(heads, r1.view(t, 1, 1, rope_dim), r2.view(t, 1, 1, rope_dim), "interleave",
                                      [d - rope_dim, d])
    return heads.view(x.shape)


class QuantisedRows(NamedTuple):
    """Rows already quantised for W8A8 linears (profile quantised_norms): what npu_dynamic_quant would return."""
    values: torch.Tensor        # [T, K] int8
    scale: torch.Tensor         # [T] fp32, per token


def rms_norm_quant(x, weight, eps: float) -> QuantisedRows:
    """RMSNorm and the per-token int8 quantisation of its bf16 output in one npu_rms_norm_dynamic_quant, for a norm
    only W8A8 linears read (vllm-ascend's DeepSeek-V4 attention normalises and quantises its q latent this way)."""
    return QuantisedRows(*device.npu_rms_norm_dynamic_quant(x.to(DTYPE), weight, epsilon=eps))


def _quantised(x) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(x) if isinstance(x, QuantisedRows) else device.npu_dynamic_quant(x.to(DTYPE))


def linear_w8a8(x, weight: W8A8):
    """Per-token dynamic int8 activations x int8 weight rows, bf16 out (L21); x bf16 rows or QuantisedRows."""
    return _quant_matmul(*_quantised(x), weight)


def linear_w8a8_pair(x, first: W8A8, second: W8A8, merged: bool = False):
    """Two W8A8 linears of one input (profile shared_inputs): x quantised once, as vllm-ascend's DeepSeek-V4
    attention shares the hidden state's quantisation between wq_a and wkv. `merged` (shared_inputs one_gemm):
    `first` holds both weights' rows, `second` a view of its last rows, and one quantised GEMM makes both outputs
    (vLLM's fused_wqa_wkv); each output column is the same int32 dot product and scaling as the separate GEMM's.
    The two column ranges of the [T, N1 + N2] result are strided once T > 1, and the norm and rotary kernels that
    read them are not documented to take strided rows (CANN's aclnnAddRmsNorm says it takes no non-contiguous
    tensor; torch_npu copies such an input before a kernel that cannot): each is made contiguous here, a view at
    one row, a counted copy at more."""
    xq, xs = _quantised(x)
    if merged:
        y, n = _quant_matmul(xq, xs, first), second.qweight.shape[-2]
        return y[..., :-n].contiguous(), y[..., -n:].contiguous()
    return _quant_matmul(xq, xs, first), _quant_matmul(xq, xs, second)


def _quant_matmul(xq, xs, weight: W8A8):
    return device.npu_quant_matmul(xq, weight.qweight.t(), weight.scale, pertoken_scale=xs, output_dtype=DTYPE)


def clipped_swiglu_quant(gate_up, limit: float) -> QuantisedRows:
    """DeepSeek-V4's clipped SwiGLU on the merged gate | up GEMM output [..., 2I] (interleaved: profile merged_weights
    puts gate j at column 2j and up j at 2j + 1, the even | odd columns swiglu_mode 1 reads) and the per-token int8 quantisation
    of the result, for the down projection, in one npu_dequant_swiglu_quant (swiglu_mode 1: min(gate, L),
    clamp(up, -L, L), alpha 1, bias 0; quant_mode 1: dynamic per row), as vllm-ascend's W8A8 MLPs fuse the
    activation and the down projection's quantisation."""
    return QuantisedRows(*device.npu_dequant_swiglu_quant(gate_up.to(DTYPE), activate_left=True, quant_mode=1,
                                                          swiglu_mode=1, clamp_limit=limit, glu_alpha=1.0, glu_bias=0.0))


def shared_expert_w8a8(x, w1: W8A8, w3: W8A8 | None, w2: W8A8, limit: float):
    """The gate and up projections as one W8A8 GEMM (w1 holds both, interleaved: profile merged_weights; w3 is
    None), the activation and its quantisation in one kernel, the down GEMM: vllm-ascend's W8A8 MLP."""
    if w3 is not None:
        xq, xs = device.npu_dynamic_quant(x.to(DTYPE))
        act = moe.clipped_swiglu(_quant_matmul(xq, xs, w1), _quant_matmul(xq, xs, w3), limit).to(DTYPE)
        return linear_w8a8(act, w2)
    return linear_w8a8(clipped_swiglu_quant(linear_w8a8(x, w1), limit), w2)


def _gmm_w4a8(x, w: W4A8, group_list):
    """x bf16 rows (quantised here) or QuantisedRows."""
    return _gmm_quantized(*_quantised(x), w, group_list)


def _gmm_quantized(xq, xs, w: W4A8, group_list):
    (y,) = device.npu_grouped_matmul([xq], [w.qweight], scale=[w.scale], per_token_scale=[xs], group_list=group_list,
                                     split_item=2, group_type=0, group_list_type=0, output_dtype=DTYPE,
                                     weight_dtype=INT4)
    return y


def routed_experts(x, weights, ids, w1: W4A8, w3: W4A8 | None, w2: W4A8, placement: ExpertPlacement, limit: float,
                   zero_tail: bool = True):
    """W4A8 routed experts. On one EP rank holding every expert: npu_moe_init_routing_v2 sorts the (token, expert)
    pairs and quantises their rows (quant_mode 1, the gate and up GEMMs read that one quantisation), and
    npu_moe_token_unpermute combines the down rows straight from that order; every row is written (all experts
    local, no pair dropped), so there is no tail to zero. w1 holds gate | up when the profile merges them (w3 None):
    one grouped GEMM, then the clipped SwiGLU and the down GEMM's quantisation in one npu_dequant_swiglu_quant. Under EP the shared composite (dummy slot, tail rows zeroed, the
    exchange: backends/common/moe.py)."""
    if placement.ep_size > 1:
        return moe.grouped_moe(x, weights, ids, w1, w3, w2, placement, limit,
                               init_routing=device.npu_moe_init_routing_v2, gmm=_gmm_w4a8,
                               unpermute=device.npu_moe_token_unpermute, dtype=DTYPE, zero_tail=zero_tail,
                               merged_swiglu=functools.partial(clipped_swiglu_quant, limit=limit))
    t, k = ids.shape
    xq, row_idx, group_list, xs = device.npu_moe_init_routing_v2(
        x.to(DTYPE), ids, active_num=t * k, expert_num=placement.n_experts, expert_tokens_num_type=0,
        expert_tokens_num_flag=True, quant_mode=1)
    if w3 is None:               # gate | up in one grouped GEMM (profile merged_weights), activation and quantisation
        down = _gmm_quantized(*clipped_swiglu_quant(_gmm_quantized(xq, xs, w1, group_list), limit), w2, group_list)
    else:
        act = moe.clipped_swiglu(_gmm_quantized(xq, xs, w1, group_list), _gmm_quantized(xq, xs, w3, group_list),
                                 limit).to(DTYPE)
        down = _gmm_w4a8(act, w2, group_list)                        # [T*k, d] in expert order
    return device.npu_moe_token_unpermute(down, row_idx, weights.to(DTYPE))


# ---- fused mHC (profile `fused: mhc`), chosen where hidden_size and hc_mult meet the kernels' limits ----
def hc_expand_bf16(e, streams: int):
    """The fused mHC kernels take and return bf16 streams: the state starts in bf16 (vllm-ascend's layout)."""
    return e.to(DTYPE).unsqueeze(1).expand(-1, streams, -1).contiguous()


def hc_pre_fused(x, fn, base, scale, iters: int, norm_eps: float, hc_eps: float):
    """npu_hc_pre_v2: the mixing GEMM, pre / post / comb, the whole Sinkhorn and the collapse in one kernel."""
    return device.npu_hc_pre_v2(x, fn, scale, base, x.shape[1], iters, norm_eps, hc_eps)


def hc_post_fused(y, x, post, comb):
    """npu_hc_post on the [1, T, ...] layout its callers give it: bf16 streams back. post / comb come fp32
    from npu_hc_pre_v2 (the casts do nothing then: no launch); x is the bf16 stream state."""
    out = device.npu_hc_post(y.to(DTYPE).unsqueeze(0), x.to(DTYPE).unsqueeze(0), post.float().unsqueeze(0),
                             comb.float().unsqueeze(0))
    return out.squeeze(0)


# ---- fused routing (profile `fused: gating`): moe_gating_top_k_hash with sqrt(softplus) scores (norm_type 2) ----
GATING = {"k_group": 1, "group_count": 1, "eps": 1e-20, "group_select_mode": 1, "renorm": 0, "norm_type": 2}


def _router_logits(x, gate):
    return matmul(x.float(), gate.float().t())          # [T, E] fp32: the gate is held fp32 (router class)


def route_hash_fused(x, gate, tid2eid, tokens, route_scale: float):
    """Hash layers: the kernel looks the experts up in tid2eid by token id and weights them (B07)."""
    weights, ids, _ = device.moe_gating_top_k_hash(_router_logits(x, gate), tid2eid.shape[1], input_ids=tokens,
                                                   tid2eid=tid2eid, routed_scaling_factor=route_scale, **GATING)
    return weights, ids


def route_learned_fused(x, gate, bias, topk: int, route_scale: float):
    weights, ids, _ = device.moe_gating_top_k_hash(_router_logits(x, gate), topk, bias=bias.float(),
                                                   routed_scaling_factor=route_scale, **GATING)
    return weights, ids
