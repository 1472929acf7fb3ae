"""hip936 lowerings: BF16 composites plus routed experts requantised FP4 -> INT8 on the fly and
multiplied with `_int_mm` (L28, L29).

There is no hardware FP8 (L27): attention and shared-expert weights are dequantised to BF16 once
at load (runtime format dense_bf16). Routed experts stay packed MXFP4; each step requantises only
the experts tokens were routed to and pads `_int_mm` rows to 17 (the DCU refuses M <= 16). This
module must not know whether `_int_mm` is the real ROCm kernel or the CPU emulation.
"""
from __future__ import annotations

import functools

import torch

from backends.common import attention, dense, engram, hc, moe, shared_kv
from backends.hip936 import device_ops as device
from lib.distributed import expert_exchange as ep
from lib.emulation.invariant_matmul import matmul
from lib.records.expert_placement import ExpertPlacement, local_ids, rank_experts
from lib.quant import bit_codecs as codecs
from lib.quant.runtime_formats import W8A8, PackedFP4, quantize_rows

DTYPE = torch.bfloat16


def _rms(x, weight, eps: float):
    """dense.rms as one `_fused_rms_norm` (fp32 statistics; the weight cast to x's dtype, a no-op where it has it)."""
    return device._fused_rms_norm(x, [x.shape[-1]], None if weight is None else weight.to(x.dtype), eps)[0]


rms_norm = functools.partial(dense.rms_norm, rms=_rms)                 # the ops' lowerings with the kernel bound
head_rms_norm = functools.partial(dense.head_rms_norm, rms=_rms)
compress = functools.partial(attention.compress, rms=_rms)


def hc_pre(x, fn, base, scale, iters: int, norm_eps: float, hc_eps: float):
    return hc.hc_pre(x, fn, base, scale, iters, norm_eps, hc_eps, dtype=DTYPE, rms=_rms)


def hc_head(x, fn, base, scale, norm_eps: float, hc_eps: float):
    return hc.hc_head(x, fn, base, scale, norm_eps, hc_eps, dtype=DTYPE, rms=_rms)


# DeepSeek-V4.1's own ops (shifted mHC, Engram, the shared compressed KV) with this device's RMSNorm kernel bound
hc_mix = functools.partial(hc.hc_mix, rms=_rms)
hc_collapse = functools.partial(hc.hc_collapse, dtype=DTYPE)
engram_inject = functools.partial(engram.engram_inject, rms=_rms)
latent_compress = functools.partial(shared_kv.latent_compress, rms=_rms)


def shared_expert(x, w1, w3, w2, limit: float):
    """The shared expert with BF16 weights (dequantised once at load, L27, L29). w3 None: w1 holds gate | up
    (profile merged_weights, halves), one GEMM whose output is widened once."""
    x = x.to(DTYPE)
    return matmul(moe.gate_up_swiglu(lambda w: matmul(x, w.t()), w1, w3, limit).to(DTYPE), w2.t())


_E2M1_PAIRS: dict = {}       # device -> the table below


def _e2m1_pairs(device) -> torch.Tensor:
    """[256, 2] fp32: the two e2m1 values of every packed MXFP4 byte (low nibble first, B01), decoded
    once per device by the codec itself, so a table read gives exactly what the bit decode gives. Not kept
    when made while torch.export traces a step: it would be the tracer's fake tensor."""
    if device in _E2M1_PAIRS:
        return _E2M1_PAIRS[device]
    table = codecs._e2m1_value(codecs.unpack_e2m1(torch.arange(256, dtype=torch.uint8))).view(256, 2).to(device)
    if not torch.compiler.is_exporting():
        _E2M1_PAIRS[device] = table
    return table


def _requant_fp4(p: PackedFP4, quantize) -> W8A8:
    """Stacked MXFP4 [..., N, K/2] -> W8A8 rows in a few kernels: one gather of the byte table (a gather
    runs on the DCU itself; L14's AI-CPU fallback is a 310P fact), the E8M0 scales, one multiply, then
    `quantize` (the fault site every requantising converter has); the values packed_fp4_to_w8a8 gives."""
    lead, half = p.weight.shape[:-1], p.weight.shape[-1]
    pairs = _e2m1_pairs(p.weight.device).index_select(0, p.weight.view(torch.uint8).reshape(-1).to(torch.int64))
    values = pairs.view(*lead, (2 * half) // 32, 32) * codecs.e8m0_decode(p.scale).unsqueeze(-1)
    return quantize(values.view(*lead, 2 * half))


# the routers' picked scores in one gather (a gather runs on the DCU; the one-hot contraction is for 310P's AI-CPU, L14)
route_hash = functools.partial(moe.route_hash, pick=moe.pick_gathered)
route_learned = functools.partial(moe.route_learned, pick=moe.pick_gathered)


def _quant_tokens(x: torch.Tensor):
    """Per-token symmetric int8 (round half to even): x [M, K] -> (int8 [M, K], fp32 scale [M]). The row's amax is
    one max-norm kernel; the scale floor (the smallest normal fp32) only touches a row whose amax is below about
    1.5e-36: an all-zero row (codes zero whatever its scale) or one of subnormal values."""
    xf = x.float()
    s = (torch.linalg.vector_norm(xf, ord=float("inf"), dim=-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.round(xf / s[:, None]).clamp(-127, 127).to(torch.int8), s


def _int_matmul(xq, xs, wq, ws):
    """One token's int8 row through one expert's int8 weight [N, K]: rows padded to 17 (L28)."""
    acc = device._int_mm(device.pad_rows_to(xq), wq.t().contiguous())[: xq.shape[0]]
    return acc.float() * xs[:, None] * ws[None, :]


def _gather(w: PackedFP4 | W8A8, experts: torch.Tensor, dummy: bool = True) -> PackedFP4 | W8A8:
    """The weights of the given experts (one per token pair); with `dummy`, a zero expert sits at the end for the
    pairs routed to another rank (E8M0 127 = 2^0 / an int8 scale of 1 beside zero values). A rank that holds
    every expert has no such pair and gathers its weights as they are."""
    values, scale = w
    if dummy:
        fill = 127 if isinstance(w, PackedFP4) else 1.0
        values, scale = torch.cat((values, torch.zeros_like(values[:1]))), torch.cat((scale, torch.full_like(scale[:1], fill)))
    return type(w)(values.index_select(0, experts), scale.index_select(0, experts))


def _int8_experts(w: PackedFP4 | W8A8, quantize, experts: torch.Tensor | None = None, dummy: bool = True) -> W8A8:
    """Int8 expert rows: resident experts (expert mode `resident`) are int8 since load and only gathered;
    streaming ones (MXFP4 kept as stored) are gathered and requantised now (L29). `experts`: one per
    token pair (None: all of them); `dummy`: a zero expert appended for pairs held by another rank."""
    picked = w if experts is None else _gather(w, experts, dummy)
    return picked if isinstance(picked, W8A8) else _requant_fp4(picked, quantize)


def _expert(xq, xs, w1, w3, w2, e: int, limit: float):
    """Clipped SwiGLU of int8 tokens through expert `e` of int8 weights (each [E, N, K]; w3 None: w1 is gate | up)."""
    act = moe.gate_up_swiglu(lambda w: _int_matmul(xq, xs, w.qweight[e], w.scale[e]), w1, w3, limit)
    aq, as_ = _quant_tokens(act)
    return _int_matmul(aq, as_, w2.qweight[e], w2.scale[e])


def _pair_matmul(xq, xs, w) -> torch.Tensor:
    """Pair i's int8 row through its own int8 weight w.qweight[i] [N, K], for every pair at once:
    one `_int_mm` against all the pairs' weights side by side ([K, P*N]), keeping each pair's own
    block (P x the products of P separate calls, but one launch whatever P is). The rows are
    always padded (by zero rows when there are 17 or more already), so the launches do not depend
    on how many pairs a step has."""
    p, n, k = w.qweight.shape
    acc = device._int_mm(device.pad_rows_to(xq, always=True), w.qweight.reshape(p * n, k).t().contiguous())[:p]  # [P, P*N]
    own = torch.diagonal(acc.view(p, p, n), dim1=0, dim2=1).t()                                     # [P, N]
    return own.float() * xs[:, None] * w.scale


# Up to this many tokens (decode batches), run each (token, expert slot) pair on its own
# requantised expert, every pair of the step in one product; above it, requantise the rank's
# experts once, run every expert over all tokens and keep its rows where routed (prefill). Both
# have fixed shapes, so neither needs a host sync; the pairwise path's kernels are the same at any batch, and
# from two tokens on flattening the [T, k] pairs is a copy (one token's k pairs are a stride-0 view).
PAIRWISE_MAX_TOKENS = 16


def routed_experts(x, weights, ids, w1, w3, w2, placement: ExpertPlacement, shared, limit: float,
                   quantize=quantize_rows, shared_weight: float = 1.0):
    """Routed experts as int8 (resident: converted at load; streaming: MXFP4 requantised FP4 -> INT8
    when they run, L29), multiplied with `_int_mm` (L28),
    exchanged over the EP group when there is one (lib/distributed/expert_exchange.py), then the shared
    expert's output added. `quantize` and `shared_weight` are fault sites: conformance renders B03 / B09
    through them."""
    routed = ep.exchange(placement, x, weights, ids, ep.Experts(
        lambda xs, es: _routed_rows(xs, es, w1, w3, w2, placement, limit, quantize),
        functools.partial(ep.weighted_sum, out_dtype=DTYPE), torch.float32, DTYPE))
    return moe.add_shared(routed, shared, shared_weight)


def _routed_rows(x, ids, w1, w3, w2, placement: ExpertPlacement, limit: float, quantize) -> torch.Tensor:
    """fp32 [T*k, d] expert rows of the (token, expert) pairs held by the EP ranks this process runs
    (zero elsewhere: other ranks' experts map to the dummy zero expert, L06)."""
    t, k = ids.shape
    xq, xs = _quant_tokens(x)
    rows = None           # the ranks' rows summed (a pair held elsewhere reads the dummy expert's zero row)
    for rank in placement.ranks:
        local = local_ids(ids, placement.local_of[rank])
        mats = [None if w is None else rank_experts(w, placement, rank) for w in (w1, w3, w2)]
        if t <= PAIRWISE_MAX_TOKENS:      # the T*k (token, slot) pairs, token-major, through one chain
            pq = xq.unsqueeze(1).expand(t, k, xq.shape[-1]).reshape(t * k, -1)
            ps = xs.unsqueeze(1).expand(t, k).reshape(-1)
            remote = placement.n_local < placement.n_experts      # some pairs route to the dummy expert
            g1, g3, g2 = (None if w is None else _int8_experts(w, quantize, local.reshape(-1), remote) for w in mats)
            act = moe.gate_up_swiglu(lambda w: _pair_matmul(pq, ps, w), g1, g3, limit)
            aq, as_ = _quant_tokens(act)
            part = _pair_matmul(aq, as_, g2).view(t, k, -1)
            rows = part if rows is None else rows + part
            continue
        if rows is None:
            rows = torch.zeros(t, k, x.shape[-1], dtype=torch.float32)
        g1, g3, g2 = (None if w is None else _int8_experts(w, quantize) for w in mats)
        for e in range(placement.n_local):
            y = _expert(xq, xs, g1, g3, g2, e, limit)                                   # [T, d]
            rows = torch.where((local == e).unsqueeze(-1), y.unsqueeze(1), rows)
    return rows.reshape(t * k, -1)
