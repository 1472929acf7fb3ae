"""Fake (meta) kernels of the device ops: each output's shape and dtype from the inputs' alone,
as the emulation (lib/emulation/npu_ops.py) and the device produce them, without touching data.

torch calls these under FakeTensorMode and on meta tensors (torch.export, graph capture, the
planner's meta-device pools); tests/backends/test_registered_ops.py checks every one against its
CPU kernel on the inputs a real decode step passes. Arguments come as the op's schema names them
(positional ones by position, keyword-only ones by name); those a shape does not depend on are
taken as **unused.
"""
from __future__ import annotations

import torch

from lib.emulation.npu_ops import F16, F32, I8, I32, I64, as_dtype, chip

PACK = 8            # int4 values per int32 (npu_ops.pack_int4)


def _unpacked_last(t: torch.Tensor) -> int:
    return t.shape[-1] * PACK if t.dtype == I32 else t.shape[-1]


def npu_quant_matmul(x1, x2, scale, *, output_dtype=None, **unused):
    batch = torch.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    out = as_dtype(output_dtype, "npu_quant_matmul") or I8
    return x1.new_empty((*batch, x1.shape[-2], _unpacked_last(x2)), dtype=out)


def npu_quant_matmul_dequant(x, quantized_weight, weight_scale, **unused):
    return x.new_empty((x.shape[0], quantized_weight.shape[-2]), dtype=F16)


def npu_quant_grouped_matmul_dequant(x, quantized_weight, weight_scale, group_list, **unused):
    return x.new_empty((x.shape[0], quantized_weight.shape[-2]), dtype=F16)


def npu_grouped_matmul(x, weight, *, output_dtype=None, **unused):
    xt, w = x[0], weight[0]
    default = I8 if xt.dtype == I8 else xt.dtype
    out = as_dtype(output_dtype, "npu_grouped_matmul") or default
    return [xt.new_empty((xt.shape[0], _unpacked_last(w)), dtype=out)]


def npu_moe_init_routing_v2(x, expert_idx, *, active_num=-1, expert_num=-1, quant_mode=-1, active_expert_range=(),
                            soc: str, **unused):
    pairs = expert_idx.shape[0] * expert_idx.shape[1]
    rows = pairs if active_num <= 0 else min(active_num, pairs)
    honour = chip(soc).routing_honours_range and len(active_expert_range) > 0     # L06: 310P ignores the range
    experts = active_expert_range[1] - active_expert_range[0] if honour else expert_num
    return (x.new_empty((rows, x.shape[1]), dtype=x.dtype if quant_mode == -1 else I8),
            x.new_empty((pairs,), dtype=I32), x.new_empty((experts,), dtype=I64), x.new_empty((rows,), dtype=F32))


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, **unused):
    k = 1 if probs is None else probs.shape[1]
    return permuted_tokens.new_empty((sorted_indices.shape[0] // k, permuted_tokens.shape[1]))


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode=0, k=1):
    rows = expanded_src_to_dst_row.shape[0] // (scales.shape[1] if scales is not None else (k or 1))
    return expanded_permuted_rows.new_empty((rows, expanded_permuted_rows.shape[1]))


def npu_rms_norm(input, gamma, epsilon=1e-06):  # noqa: A002 - the schema's name
    g = gamma.dim()
    return torch.empty_like(input), input.new_empty((*input.shape[:input.dim() - g], *[1] * g), dtype=F32)


def npu_scatter_nd_update_(input, indices, updates):  # noqa: A002 - the schema's name
    return input                                        # in place: the schema's Tensor(a!) is its input


def npu_dynamic_quant(input, *, dst_type=None, quant_mode="pertoken", **unused):  # noqa: A002
    packed = (as_dtype(dst_type, "npu_dynamic_quant") or I8) != I8
    q = input.new_empty((*input.shape[:-1], input.shape[-1] // PACK if packed else input.shape[-1]),
                        dtype=I32 if packed else I8)
    shape = {"pertoken": input.shape[:-1], "pertensor": (1,), "perchannel": (input.shape[-1],)}[quant_mode]
    return q, input.new_empty(shape, dtype=F32)


def npu_rms_norm_dynamic_quant(x, gamma, smooth_scale=None, beta=None, epsilon=1e-6):
    return x.new_empty(x.shape, dtype=I8), x.new_empty(x.shape[:-1], dtype=F32)


def _int_mm(self, mat2):
    return self.new_empty((self.shape[0], mat2.shape[1]), dtype=I32)


def _fused_rms_norm(input, normalized_shape, weight, eps):  # noqa: A002 - torch's name
    kept = input.shape[:input.dim() - len(normalized_shape)]
    return input.new_empty(input.shape), input.new_empty((*kept, *[1] * len(normalized_shape)), dtype=F32)


def npu_hc_pre_v2(x, hc_fn, hc_scale, hc_base, hc_mult, hc_sinkhorn_iters, norm_eps, hc_eps):
    t, n, d = x.shape
    return (x.new_empty((t, d), dtype=x.dtype), x.new_empty((t, n), dtype=F32), x.new_empty((t, n, n), dtype=F32))


def npu_hc_post(x, residual, post, comb):
    return residual.new_empty(residual.shape)


def moe_gating_top_k_hash(x, k, bias=None, input_ids=None, tid2eid=None, *unused, **unused_kw):
    rows, experts = x.shape
    return (x.new_empty((rows, k)), x.new_empty((rows, k), dtype=I32), x.new_empty((rows, experts), dtype=F32))


def npu_lightning_indexer(query, key, weights, *, sparse_count=2048, **unused):
    return query.new_empty((query.shape[0], key.shape[2], sparse_count), dtype=I32), query.new_empty(0)


def npu_sparse_attn_sharedkv(q, **unused):
    return q.new_empty(q.shape), q.new_empty((*q.shape[:-1], 1), dtype=F32)


def npu_sparse_attn_sharedkv_metadata(num_heads_q, num_heads_kv, head_dim, cu_seqlens_q=None, *unused, **unused_kw):
    return torch.empty(1024, dtype=I32, device=None if cu_seqlens_q is None else cu_seqlens_q.device)


def compressor(x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, *unused, **unused_kw):
    return x.new_empty((rope_sin.shape[0], norm_weight.shape[0]))       # the state is written in place


def inplace_partial_rotary_mul(x, r1, r2, rotary_mode, partial_slice):
    return None                                                          # x is rotated in place


def npu_dequant_swiglu_quant(x, **unused):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=I8), x.new_empty(x.shape[:-1], dtype=F32)


FAKES = {f.__name__: f for f in (npu_dequant_swiglu_quant, npu_rms_norm_dynamic_quant, compressor, inplace_partial_rotary_mul, npu_lightning_indexer, npu_sparse_attn_sharedkv, npu_sparse_attn_sharedkv_metadata, npu_hc_pre_v2, npu_hc_post, moe_gating_top_k_hash, npu_quant_matmul, npu_quant_matmul_dequant, npu_quant_grouped_matmul_dequant,
                                 npu_grouped_matmul, npu_moe_init_routing_v2, npu_moe_token_unpermute, npu_moe_finalize_routing,
                                 npu_rms_norm,
                                 npu_scatter_nd_update_, npu_dynamic_quant, _int_mm,
                                 _fused_rms_norm)}
NEEDS_SOC = frozenset({"npu_moe_init_routing_v2"})     # fakes whose shapes follow a chip quirk
