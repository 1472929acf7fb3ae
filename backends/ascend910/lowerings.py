"""ascend910 lowerings: BF16 compute, W8A8 and W4A8 through the 910B quantised torch_npu ops.

W8A8 linears are `npu_dynamic_quant` + `npu_quant_matmul` with per-token scales; routed experts
are W4A8 grouped matmuls between `npu_moe_init_routing_v2` and `npu_moe_finalize_routing`
(L21). This module must not know whether the device ops are real kernels or the emulation.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from backends.ascend910 import device_ops as device
from backends.common import attention, dense, engram, hc, moe, shared_kv
from lib.emulation.invariant_matmul import matmul
from lib.records.expert_placement import ExpertPlacement
from lib.records.step_rope import StepRope, split, step_positions
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


# DeepSeek-V4.1's own ops (shifted mHC, Engram, the shared compressed KV) with this device's RMSNorm kernel bound
hc_mix = functools.partial(hc.hc_mix, rms=_rms)
hc_collapse = functools.partial(hc.hc_collapse, dtype=DTYPE)
engram_inject = functools.partial(engram.engram_inject, rms=_rms)
latent_compress = functools.partial(shared_kv.latent_compress, rms=_rms)


head_rms_norm = functools.partial(dense.head_rms_norm, rms=_rms)       # the op's lowerings with the kernel bound
compress = functools.partial(attention.compress, rms=_rms)


def rope_angles(batch, *, tables: dict) -> dict[str, StepRope]:
    """Every table's angles at one step's positions in one chain of kernels, not a chain per table and form: the
    positions (the token rows', then each ratio's completed entries' at m * e, each ratio's followed by position-0
    rows up to the fused compressor's row count), their fp32 angles for all tables as one [tables, N, rope_dim/2]
    product, cos and sin (the composites' angles, as the reference computes them: backends/common/rope.py), then
    both as the in-place rotary's bf16 per-channel rows ([2, tables, N, rope_dim]: r1 = cos, r2 = sin per pair)
    and -r2 for the inverse. The compressor kernel's rope rows of the table compressors read (spec/schedule.py
    COMPRESS_TABLE) are row ranges of that same product: its entries, then cos 1 / sin 0 (position 0), as
    vllm-ascend's compressor_metadata pads its rows. Twelve launches a step for two tables and two ratios."""
    t = batch.positions.shape[0]
    positions, spans, kernel_rows = _step_positions(batch, padded=COMPRESS_TABLE in tables)
    names = list(tables)
    inv = torch.stack([tables[n].float() for n in names]) if len(names) > 1 else tables[names[0]].float()[None]
    angles = positions.float()[None, :, None] * inv[:, None, :]                 # [tables, N, rope_dim/2] fp32
    cos, sin = angles.cos(), angles.sin()
    rows = torch.stack((cos, sin)).repeat_interleave(2, dim=-1).to(DTYPE)       # [2, tables, N, rope_dim] bf16
    sin_inverse = rows[1].neg()                                                 # [tables, N, rope_dim]
    out = {}
    for i, name in enumerate(names):
        step = split(StepRope(tables[name], cos[i], sin[i]), t, spans)
        entries = step.entries if name != COMPRESS_TABLE else {
            m: e._replace(kernel=(rows[0, i, lo:lo + n], rows[1, i, lo:lo + n]))
            for (m, e), (lo, n) in zip(step.entries.items(), kernel_rows.values())}
        rotary = tuple(r[:t][None, :, None, :] for r in (rows[0, i], rows[1, i], sin_inverse[i]))
        out[name] = step._replace(rotary=rotary, entries=entries)
    return out


def _step_positions(batch, padded: bool):
    """step_positions (lib/records/step_rope.py) with each ratio's entries followed, where `padded`, by position-0
    rows up to the compressor kernel's min(T, T // m + S) rows: (positions, {m: (lo, hi)} of the entries,
    {m: (lo, rows)} of the kernel's rope rows; rows 0 without `padded`)."""
    if not padded or batch.state is None:
        positions, spans = step_positions(batch)
        return positions, spans, {m: (lo, 0) for m, (lo, _) in spans.items()}
    t, s = batch.positions.shape[0], batch.state.seq_slot.shape[0]
    parts, spans, kernel, lo = [batch.positions], {}, {}, t
    for m, w in batch.state.writes.items():
        k, n = w.ids.shape[0], min(t, t // m + s)
        parts.append(w.ids * m)
        if n > k:
            parts.append(dense.constant(n - k, 0, batch.positions.dtype, batch.positions.device))
        spans[m], kernel[m] = (lo, lo + k), (lo, n)
        lo += max(n, k)
    return (torch.cat(parts) if len(parts) > 1 else batch.positions), spans, kernel


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
    `first` holds both weights' rows, `second` a view of its last rows. At one row, one quantised GEMM makes both
    outputs (vLLM's fused_wqa_wkv), each a contiguous view of the one result row; at more, a column range of
    the [T, N1 + N2] product is strided, and the norm and rotary kernels that read the two outputs are not
    documented to take strided rows (CANN's aclnnAddRmsNorm says it takes no non-contiguous tensor; torch_npu
    copies such an input before a kernel that cannot), so the one quantisation feeds two GEMMs, one per row
    range of the stacked weight: two launches where the one GEMM and its two copies would be three. Each output
    column is the same int32 dot product and scaling either way."""
    xq, xs = _quantised(x)
    if not merged:
        return _quant_matmul(xq, xs, first), _quant_matmul(xq, xs, second)
    n = second.qweight.shape[-2]
    if xq.shape[0] == 1:
        y = _quant_matmul(xq, xs, first)
        return y[..., :-n], y[..., -n:]
    return _quant_matmul(xq, xs, W8A8(first.qweight[:-n], first.scale[:-n])), _quant_matmul(xq, xs, second)


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


def routed_experts(x, weights, ids, w1: W4A8, w3: W4A8 | None, w2: W4A8, placement: ExpertPlacement, shared,
                   limit: float, zero_tail: bool = True, shared_weight: float = 1.0):
    """W4A8 routed experts, and the shared expert's output `shared` added. On one EP rank holding every expert:
    npu_moe_init_routing_v2 sorts the (token, expert) pairs and quantises their rows (quant_mode 1, the gate and
    up GEMMs read that one quantisation), and npu_moe_finalize_routing combines the down rows straight from that
    order (drop_pad_mode 2: the index as npu_moe_init_routing_v2 arranges it), weighted by the router's fp32
    weights beside the bf16 rows (A2 / A3 mixed precision) and with the shared rows added (skip1), in one kernel
    where an unpermute, a cast of the weights and an add were three; every row is written (all experts local, no
    pair dropped), so there is no tail to zero. w1 holds gate | up when the profile merges them (w3 None): one
    grouped GEMM, then the clipped SwiGLU and the down GEMM's quantisation in one npu_dequant_swiglu_quant. Under
    EP the shared composite (dummy slot, tail rows zeroed, the exchange: backends/common/moe.py), the pair rows
    that come back combined by the same npu_moe_finalize_routing in fp32 (the identity index, drop_pad_mode 2; a
    rank combines the tokens it was given, which need not be the shared rows' tokens), then the shared rows added
    and rounded once: the one-rank kernel's sum, order and rounding, so an EP layout is exact.
    `zero_tail` and `shared_weight` are fault sites (B10, B09)."""
    t, k = ids.shape
    skip = shared.to(DTYPE) if shared_weight == 1.0 else shared.to(DTYPE) * shared_weight
    if placement.ep_size > 1:
        def finalize(rows, ws):
            order = dense.arange(rows.shape[0], torch.int32, rows.device)
            return device.npu_moe_finalize_routing(rows.float(), None, None, None, ws.float(), order, None,
                                                   drop_pad_mode=2)
        routed = moe.grouped_moe(x, weights, ids, w1, w3, w2, placement, limit,
                                 init_routing=device.npu_moe_init_routing_v2, gmm=_gmm_w4a8,
                                 unpermute=None, dtype=DTYPE, zero_tail=zero_tail,
                                 merged_swiglu=functools.partial(clipped_swiglu_quant, limit=limit),
                                 combine=finalize, out_dtype=torch.float32)
        return (routed + skip.float()).to(DTYPE)
    xq, row_idx, group_list, xs = device.npu_moe_init_routing_v2(
        x.to(DTYPE), ids, active_num=t * k, expert_num=placement.n_experts, expert_tokens_num_type=0,
        expert_tokens_num_flag=True, quant_mode=1)
    if w3 is None:               # gate | up in one grouped GEMM (profile merged_weights), activation and quantisation
        down = _gmm_quantized(*clipped_swiglu_quant(_gmm_quantized(xq, xs, w1, group_list), limit), w2, group_list)
    else:
        act = moe.clipped_swiglu(_gmm_quantized(xq, xs, w1, group_list), _gmm_quantized(xq, xs, w3, group_list),
                                 limit).to(DTYPE)
        down = _gmm_w4a8(act, w2, group_list)                        # [T*k, d] in expert order
    return device.npu_moe_finalize_routing(down, skip, None, None, weights.float(), row_idx, None, drop_pad_mode=2)


# ---- fused mHC (profile `fused: mhc`), chosen where hidden_size and hc_mult meet the kernels' limits ----
def hc_expand_bf16(e, streams: int):
    """The fused mHC kernels take and return bf16 streams: the state starts in bf16 (vllm-ascend's layout)."""
    return e.to(DTYPE).unsqueeze(1).expand(-1, streams, -1).contiguous()


def hc_pre_fused(x, fn, base, scale, iters: int, norm_eps: float, hc_eps: float):
    """npu_hc_pre_v2: the mixing GEMM, pre / post / comb, the whole Sinkhorn and the collapse in one kernel."""
    return device.npu_hc_pre_v2(x, fn, scale, base, x.shape[1], iters, norm_eps, hc_eps)


def hc_head_fused(x, fn, base, scale, norm_eps: float, hc_eps: float):
    """hc_head through npu_hc_pre_v2: the head's reduction, y = sum_j (sigmoid(s m_j + b_j) + eps) X_j with
    m = RMS-scaled fn . vec(X), is the kernel's pre gate and collapse, so the head's 4 mixing rows go in as the
    kernel's pre rows, zeros as its post and comb rows (their gates and one Sinkhorn step are computed and
    dropped). One launch instead of the composite's ten (widening copy, RMS, product, gate chain, collapse)."""
    n = x.shape[1]
    fn_pre, scale_pre, base_pre = _head_as_pre(fn, base, scale, n)
    y, _, _ = device.npu_hc_pre_v2(x.to(DTYPE), fn_pre, scale_pre, base_pre, n, 1, norm_eps, hc_eps)
    return y


def _head_as_pre(fn, base, scale, n: int):
    """The head's (fn, scale, base) as npu_hc_pre_v2's, made once per head weight."""
    rest = n + n * n                                  # the post and comb rows the head has not
    return dense.derived(fn, (base, scale, n), lambda: (
        torch.cat((fn.float(), fn.new_zeros((rest, fn.shape[1]), dtype=torch.float32))),
        torch.cat((scale.float().reshape(1), scale.new_zeros(2, dtype=torch.float32))),
        torch.cat((base.float(), base.new_zeros(rest, dtype=torch.float32)))))


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
