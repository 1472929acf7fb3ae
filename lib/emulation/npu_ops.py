"""CPU emulations of the torch_npu ops the Ascend backends call, with each chip's quirks ON (soc "310p" =
Atlas 300I Duo, "910b" = A2/A3): exact int8 numerics (lib/emulation/int_numerics.py; torch.round = round half
to even, the int32 accumulation exact), refusals that name the lesson id (data/porting-lessons.yaml), and rows a kernel
leaves unwritten filled with garbage. Also the lazy torch_npu / ROCm probes the device modules dispatch on.
Must not know the model, tensor names or which backend calls it; holds no mutable state.
"""
from __future__ import annotations

import functools
import importlib.util
import sys
from dataclasses import dataclass
from itertools import accumulate
from types import MappingProxyType

import torch

from lib.emulation.int_numerics import int_matmul, quantize_symmetric, saturate_int8, unpack_int4
from lib.emulation.invariant_matmul import matmul


F16, BF16, F32, I8, I32, I64 = torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.int32, torch.int64
INT4 = torch.quint4x2  # marker for "8 int4 values packed per int32" (torch_npu accepts quint4x2 or its int4 = 285)
# ScalarType numbers torch_npu's `int` dtype arguments use (research/torch_npu.md, Part B.1)
DTYPE_CODES = MappingProxyType({1: I8, 3: I32, 4: I64, 5: F16, 6: F32, 15: BF16, 16: INT4, 285: INT4})


@dataclass(frozen=True)
class Chip:
    """What one chip's ops accept; each refusal below quotes the field's reason."""
    name: str
    float_dtypes: frozenset          # float dtypes of norm / rotary / combine ops (310P: no bf16, L02)
    quant_mm_out: frozenset          # npu_quant_matmul outputs (310P weight-NZ: no INT32, L03)
    quant_mm_bias: frozenset         # npu_quant_matmul bias dtypes (310P: int32 only)
    pertoken_scale: bool             # npu_quant_matmul takes pertoken_scale (not on 310P)
    int4: bool                       # int4 operands packed 8 per int32
    gmm_float_dtypes: frozenset      # npu_grouped_matmul float in/out (310P: fp16 only)
    gmm_quant: bool                  # npu_grouped_matmul has W8A8 / W4A8 variants (not on 310P)
    gmm_n_multiple: int              # npu_grouped_matmul output N must be a multiple of this (310P: 16)
    single_expert_gmm: bool          # a grouped matmul with E == 1 is accepted (310P: rejected, L09)
    routing_quant: bool              # npu_moe_init_routing_v2 quant_mode 1 emulated (910 only)
    routing_honours_range: bool      # npu_moe_init_routing_v2 applies active_expert_range (310P ignores it, L06)
    routing_always_cumsum: bool      # its count output is cumulative whatever was asked (310P, L07)
    unpermute_hidden_multiple: int   # npu_moe_token_unpermute: hidden % this == 0 (310P: 128, L08)
    scatter_dtypes: frozenset        # npu_scatter_nd_update_ dtypes


CHIPS = MappingProxyType({
    "310p": Chip(name="310P", float_dtypes=frozenset({F16, F32}), quant_mm_out=frozenset({F16, I8}),
                 quant_mm_bias=frozenset({I32}), pertoken_scale=False, int4=False, gmm_float_dtypes=frozenset({F16}),
                 gmm_quant=False, gmm_n_multiple=16, single_expert_gmm=False, routing_quant=False,
                 routing_honours_range=False, routing_always_cumsum=True, unpermute_hidden_multiple=128,
                 scatter_dtypes=frozenset({F32, F16, torch.bool})),
    "910b": Chip(name="910B", float_dtypes=frozenset({F16, BF16, F32}), quant_mm_out=frozenset({F16, BF16, I8, I32}),
                 quant_mm_bias=frozenset({I32, BF16, F16, F32}), pertoken_scale=True, int4=True,
                 gmm_float_dtypes=frozenset({F16, BF16}), gmm_quant=True, gmm_n_multiple=1, single_expert_gmm=True,
                 routing_quant=True, routing_honours_range=True, routing_always_cumsum=False,
                 unpermute_hidden_multiple=1, scatter_dtypes=frozenset({F32, F16, torch.bool, BF16, I64, I8})),
})


def chip(soc: str) -> Chip:
    need(soc in CHIPS, f"unknown soc {soc!r}; expected one of {sorted(CHIPS)}")
    return CHIPS[soc]


def need(ok: bool, msg: str, exc: type[Exception] = ValueError) -> None:
    """ValueError: the device refuses it; NotImplementedError: the device may take it, the emulation does not."""
    if not ok:
        raise exc(msg)


def as_dtype(v, what: str):
    if v is None or isinstance(v, torch.dtype):
        return v
    need(v in DTYPE_CODES, f"{what}: unknown dtype {v!r} (a torch.dtype or a code in {sorted(DTYPE_CODES)})")
    return DTYPE_CODES[v]


def check_float(c: Chip, op: str, allowed: frozenset, *tensors) -> None:
    for t in tensors:
        if t is not None and t.dtype not in allowed:
            hint = " (L02: 310P has no bf16 at all; cast to fp16 at load)" if t.dtype == BF16 else ""
            raise ValueError(f"{c.name} {op}: dtype {t.dtype} is not supported; accepts "
                             f"{sorted(str(d) for d in allowed)}{hint}")


# ---- dispatch to the real stack ---------------------------------------------------------------------
@functools.lru_cache(maxsize=1)                       # looked up once per process, not per shim call
def _real_stack():
    try:
        if "torch_npu" not in sys.modules and not importlib.util.find_spec("torch_npu"):
            return None
        return mod if (mod := importlib.import_module("torch_npu")) and torch.npu.is_available() else None
    except Exception:  # noqa: BLE001 - missing CANN libraries, no torch.npu: no real stack
        return None


def real_npu_op(name: str):
    """torch_npu.<name> with an NPU present, else None (imported lazily: without CANN it fails, torch_npu.md B.1)."""
    return getattr(_real_stack(), name, None)


def forward(real, shim_locals: dict):
    """Call `real` with the calling shim's own arguments: positional ones by position, keyword-only ones by
    name, in the shim's (= the schema's) order. Pass `locals()` as the shim's first use of it."""
    code = sys._getframe(1).f_code
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    return real(*(shim_locals[n] for n in names[:code.co_argcount]),
                **{n: shim_locals[n] for n in names[code.co_argcount:]})


# ---- rows the kernel never writes (L05) -------------------------------------------------------------
def _digest(*tensors) -> int:
    d = 0
    for t in tensors:
        if t is not None:
            b = t.detach().reshape(-1).contiguous().view(torch.uint8).to(I64)
            d = (d * 1000003 + int((b * (torch.arange(b.numel(), dtype=I64) % 251 + 1)).sum())) % (2 ** 31)
    return d


def fill_unwritten(out: torch.Tensor, first: int, *sources) -> torch.Tensor:
    """Rows `first`.. of `out` are memory the device kernel never writes (L05: garbage / NaN, different every
    call). Emulated without state: row `first` is always NaN (so even a one-row tail poisons whatever reads
    it); each later row is NaN or +-(dtype max / 2), chosen by a digest of `sources` (the op's inputs). The
    garbage therefore changes whenever the batch changes (B10), yet repeats for identical inputs so tests
    stay reproducible. `x * 0` keeps NaN; only `torch.where(valid, x, 0)` clears it. Integer outputs get
    digest-derived integers instead."""
    n = out.shape[0] - first
    if n <= 0:
        return out
    r = torch.arange(n, dtype=I64)
    h = (r * 2654435761 + _digest(*sources)) % (2 ** 31)
    if out.is_floating_point():
        big = torch.where(h % 2 == 0, 1.0, -1.0).double() * (torch.finfo(out.dtype).max / 2)
        vals = torch.where((h % 3 != 0) | (r == 0), torch.full_like(big, float("nan")), big)
    else:
        info = torch.iinfo(out.dtype)
        vals = h % (info.max - info.min + 1) + info.min
    out[first:] = vals.reshape(n, *[1] * (out.dim() - 1)).to(out.dtype)
    return out


def group_bounds(group_list, e: int, rows: int, list_type: int, op: str, dtypes=(I64,)) -> list:
    """[(start, end)] per group from a cumulative list (type 0: row ends, L07) or per-group counts (type 1)."""
    need(isinstance(group_list, torch.Tensor) and group_list.dim() == 1 and group_list.dtype in dtypes,
         f"{op}: group_list must be a 1-D {'/'.join(map(str, dtypes))} tensor")
    need(list_type in (0, 1), f"{op}: group_list_type {list_type} not emulated (0 cumsum, 1 counts)",
         NotImplementedError)
    g = group_list.tolist()
    need(len(g) == e, f"{op}: group_list has {len(g)} entries for {e} experts")
    need(list_type == 0 or min(g) >= 0, f"{op}: negative counts in group_list {g}")
    ends = g if list_type == 0 else list(accumulate(g))
    starts = [0] + ends[:-1]
    need(all(0 <= s <= t for s, t in zip(starts, ends)) and ends[-1] <= rows,
         f"{op}: group_list {g} (type {list_type}) must be non-decreasing and end at or before row {rows}")
    return list(zip(starts, ends))


def check_experts(c: Chip, op: str, e: int) -> None:
    need(e > 1 or c.single_expert_gmm, f"{c.name} {op}: a single-expert grouped matmul is rejected (L09: "
         "E == 1 collapses the weight's storage dims); pad to two experts")


# ---- ops --------------------------------------------------------------------------------------------
def quant_matmul(x1, x2, scale, offset, pertoken_scale, bias, output_dtype, group_sizes, y_scale, *, soc):
    """y = (x1 @ x2 [+ int32 bias]) * scale [* pertoken_scale[m]] [+ float bias]; int8 out: saturate(round(y + offset)).
    int32 out is the raw accumulator (+ int32 bias): scale is not applied (emulation's reading)."""
    c, op = chip(soc), "npu_quant_matmul"
    out = as_dtype(output_dtype, op) or I8  # torch_npu: None means int8
    need(group_sizes is None and y_scale is None, f"{op}: group_sizes / y_scale not emulated", NotImplementedError)
    need(c.int4 or I32 not in (x1.dtype, x2.dtype), f"{c.name} {op}: int32 (8 x int4) operands: int8 only")
    a = unpack_int4(x1) if x1.dtype == I32 else x1
    b = unpack_int4(x2) if x2.dtype == I32 else x2
    need(a.dtype == I8 and b.dtype == I8, f"{c.name} {op}: x1/x2 must be int8, found {x1.dtype}/{x2.dtype}")
    need(2 <= a.dim() <= 6 and 2 <= b.dim() <= 6 and a.shape[-1] == b.shape[-2],
         f"{op}: x1 {tuple(x1.shape)} @ x2 {tuple(x2.shape)} (x2 is (k, n) or a (n, k).t() view)")
    hint = {I32: " (L03: the weight-NZ quantised matmul cannot output INT32; emit FP16)",
            BF16: " (L02: no bf16 on 310P)"}.get(out, "")
    need(out in c.quant_mm_out, f"{c.name} {op}: output_dtype {out} not supported; accepts "
         f"{sorted(map(str, c.quant_mm_out))}{hint}")
    need(pertoken_scale is None or c.pertoken_scale, f"{c.name} {op}: pertoken_scale is not supported on "
         "310P; apply the per-token scale afterwards, or use npu_quant_matmul_dequant")
    need(bias is None or bias.dtype in c.quant_mm_bias, f"{c.name} {op}: bias dtype must be in "
         f"{sorted(map(str, c.quant_mm_bias))}")
    need(scale.dtype != I64, f"{op}: int64 scales (npu_trans_quant_param) are not emulated; pass the float32 "
         "scale", NotImplementedError)
    check_float(c, op, c.float_dtypes - {F16}, scale)  # fp32, and bf16 where the chip has bf16
    acc = int_matmul(a, b)
    if bias is not None and bias.dtype == I32:
        acc = (acc.to(I64) + bias.to(I64)).to(I32)
    if out == I32:
        return acc
    y = acc.float() * scale.float()
    if pertoken_scale is not None:
        y = y * pertoken_scale.float().unsqueeze(-1)
    if bias is not None and bias.dtype != I32:
        y = y + bias.float()
    if out == I8:
        return saturate_int8(y if offset is None else y + offset.float())
    need(offset is None, f"{op}: offset applies to an int8 output only")
    return y.to(out)


def grouped_matmul(x, weight, bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale, group_list,
                   split_item, group_type, group_list_type, act_type, output_dtype, weight_dtype, *, soc):
    """MoE form only: x [x_sorted (M, K)], weight [W (E, K, N)], group_type 0, split_item 2/3 -> [y (M, N)].
    Float: y = x @ W[g] (+ bias[g]) in fp32, cast. W8A8 / W4A8 (910): y = (x_q @ W_q[g]) * scale[g] *
    per_token_scale[m]; int4 weights are int32 [E, K, N//8] packed as pack_int4. Rows past the group list
    are never written (L05: reported on 310P; nothing documents it as 310P-only, so both chips do it)."""
    c, op = chip(soc), "npu_grouped_matmul"
    need(len(x) == 1 and len(weight) == 1, f"{op}: only the MoE form (one x, one 3-D weight) is emulated",
         NotImplementedError)
    need(group_type == 0 and split_item in (2, 3), f"{c.name} {op}: group_type must be 0 and split_item 2 or 3 "
         f"(single x / weight / y), found {group_type}/{split_item}")
    need(act_type == 0 and antiquant_scale is None and antiquant_offset is None and offset is None,
         f"{c.name} {op}: act_type != 0 / antiquant / offset: not on 310P, not emulated",
         NotImplementedError if c.gmm_quant else ValueError)
    xt, w = x[0], weight[0]
    need(xt.dim() == 2 and w.dim() == 3, f"{op}: x [M, K], weight [E, K, N]: {tuple(xt.shape)} {tuple(w.shape)}")
    check_experts(c, op, w.shape[0])
    need(w.dtype != I32 or (c.int4 and as_dtype(weight_dtype, op) == INT4), f"{c.name} {op}: int32 weights "
         f"mean packed int4 (weight_dtype quint4x2); found weight_dtype {weight_dtype!r}")
    wq = unpack_int4(w) if w.dtype == I32 else w
    m, k, e, n = xt.shape[0], xt.shape[1], wq.shape[0], wq.shape[2]
    need(wq.shape[1] == k, f"{op}: weight K {wq.shape[1]} != x K {k}")
    need(n % c.gmm_n_multiple == 0, f"{c.name} {op}: output N={n} must be a multiple of {c.gmm_n_multiple}")
    bounds = group_bounds(group_list, e, m, group_list_type, op)
    b0 = None if bias is None else bias[0]
    if xt.dtype != I8:
        check_float(c, op, c.gmm_float_dtypes, xt, w)
        need(w.dtype == xt.dtype and scale is None and per_token_scale is None, f"{c.name} {op}: float grouped "
             "matmul takes weight of x's dtype and no scale / per_token_scale (310P: use "
             "npu_quant_grouped_matmul_dequant for W8A8)")
        od = as_dtype(output_dtype, op) or xt.dtype
        need(od == xt.dtype, f"{c.name} {op}: output_dtype {od} must equal x's dtype {xt.dtype}")
        def part(g, a, b):
            return matmul(xt[a:b].float(), w[g].float()) + (0 if b0 is None else b0[g].float())
    else:
        need(c.gmm_quant, f"{c.name} {op}: no quantised grouped matmul on 310P (fp16 only); use "
             "npu_quant_grouped_matmul_dequant")
        need(wq.dtype == I8 and scale is not None and len(scale) == 1, f"{op}: int8 x needs an int8 / int4 "
             "weight and scale=[[E, N]]")
        sc, pts = scale[0], None if per_token_scale is None else per_token_scale[0]
        need(sc.dtype != I64, f"{op}: int64 scales are not emulated; pass float32 / bf16", NotImplementedError)
        need(sc.dtype in (F32, BF16) and tuple(sc.shape) == (e, n), f"{op}: scale must be float32/bf16 [E, N]")
        need(pts is None or (pts.dtype == F32 and tuple(pts.shape) == (m,)), f"{op}: per_token_scale: float32 [M]")
        od = as_dtype(output_dtype, op) or I8
        need(od in ((F16, BF16) if pts is not None else (I8, F16, BF16)), f"{op}: output_dtype {od} not supported")
        def part(g, a, b):
            y = int_matmul(xt[a:b], wq[g]).float() * sc[g].float()
            y = y if pts is None else y * pts[a:b].unsqueeze(-1)
            return y if b0 is None else y + b0[g].float()
    out = torch.empty(m, n, dtype=od)
    for g, (a, b) in enumerate(bounds):
        y = part(g, a, b)
        out[a:b] = saturate_int8(y) if od == I8 else y.to(od)
    return [fill_unwritten(out, bounds[-1][1], xt, w, group_list)]


def moe_init_routing(x, expert_idx, scale, offset, active_num, expert_num, drop_pad_mode, expert_tokens_num_type,
                     quant_mode, active_expert_range, row_idx_type, x_dtype, *, soc):
    """Sort the N*K (token, expert) pairs (pair id t*K+k) by expert id, stable; expanded_x[i] = x[pair_i // K].
    expanded_row_idx: type 0 (gather) [pair] -> its row in expanded_x, -1 when dropped; type 1 (scatter)
    [row] -> its pair. Rows not filled (dropped pairs, active_num) are never written. 910 keeps only experts
    in active_expert_range; 310P ignores it and needs every id in [0, expert_num) (L06), and its count output
    is always cumulative (L07). expanded_scale is written only with quant_mode 1."""
    c, op = chip(soc), "npu_moe_init_routing_v2"
    need(x.dim() == 2 and expert_idx.dim() == 2 and expert_idx.shape[0] == x.shape[0] and expert_idx.dtype == I32,
         f"{op}: x must be [N, H] and expert_idx int32 [N, K]")
    need(drop_pad_mode == 0 and offset is None and x_dtype is None and quant_mode in ((-1, 1) if c.routing_quant
         else (-1,)), f"{c.name} {op}: emulated: drop_pad_mode 0, quant_mode -1 (910 also 1), no offset / x_dtype",
         NotImplementedError)
    need(row_idx_type in (0, 1), f"{op}: row_idx_type must be 0 (gather) or 1 (scatter)")
    check_float(c, op, c.float_dtypes | {I8}, x)
    n_tok, k = expert_idx.shape
    ids = expert_idx.reshape(-1).to(I64)
    honour = c.routing_honours_range and len(active_expert_range) > 0  # L06: 310P ignores the range
    start, end = (int(v) for v in active_expert_range) if honour else (0, expert_num)
    need(0 <= start < end, f"{c.name} {op}: expert range [{start}, {end}) is empty; give expert_num > 0 or "
         "active_expert_range")
    if not c.routing_honours_range:
        bad = (ids < 0) | (ids >= expert_num)
        need(not bool(bad.any()), f"{c.name} {op}: expert ids {ids[bad][:4].tolist()} outside [0, expert_num="
             f"{expert_num}) (L06: 310P ignores active_expert_range and needs expert_num == the local expert "
             "count; remap global ids to local ids, non-local routes to a dummy expert with weight 0)")
    keep = (ids >= start) & (ids < end)
    order = torch.argsort(torch.where(keep, ids, end), stable=True)
    rows = n_tok * k if active_num <= 0 else min(active_num, n_tok * k)
    src = order[:min(int(keep.sum()), rows)]
    valid = src.numel()
    expanded_x = torch.empty(rows, x.shape[1], dtype=x.dtype if quant_mode == -1 else I8)
    expanded_scale = torch.empty(rows, dtype=F32)
    if quant_mode == 1:
        smooth = None if scale is None else (scale[ids[src] - start] if scale.shape[0] > 1 else scale)
        q, s = quantize_symmetric(x[src // k], 127, smooth=smooth)
        expanded_x[:valid], expanded_scale[:valid] = q, s.squeeze(-1)
    else:
        expanded_x[:valid] = x[src // k]
    fill_unwritten(expanded_x, valid, x, expert_idx)
    fill_unwritten(expanded_scale, valid if quant_mode == 1 else 0, x, expert_idx)
    row_idx = torch.full((n_tok * k,), -1, dtype=I32)
    if row_idx_type == 0:  # gather index: pair -> its row
        row_idx[src] = torch.arange(valid, dtype=I32)
    else:                  # scatter index: row -> its pair
        row_idx[:valid] = src.to(I32)
    counts = torch.bincount(ids[src] - start, minlength=end - start)
    cumulative = c.routing_always_cumsum or expert_tokens_num_type == 0  # L07: 310P ignores the type
    need(cumulative or expert_tokens_num_type == 1, f"{op}: expert_tokens_num_type 2 (key-value) is not emulated",
         NotImplementedError)
    tokens = counts.cumsum(0) if cumulative else counts
    return expanded_x, row_idx, tokens.to(I64), expanded_scale


def moe_token_unpermute(permuted_tokens, sorted_indices, probs, padded_mode, restore_shape, *, soc):
    """out[t] = sum_k probs[t, k] * permuted_tokens[sorted_indices[t*K + k]], accumulated in fp32, cast back.
    restore_shape only matters with padded_mode, which must be False."""
    c, op = chip(soc), "npu_moe_token_unpermute"
    check_float(c, op, c.float_dtypes, permuted_tokens, probs)
    need(permuted_tokens.dim() == 2 and not padded_mode, f"{op}: permuted_tokens must be [N*K, H], padded_mode False")
    h = permuted_tokens.shape[1]
    need(h % c.unpermute_hidden_multiple == 0, f"{c.name} {op}: hidden size {h} must be a multiple of "
         f"{c.unpermute_hidden_multiple} (L08)")
    need(sorted_indices.dim() == 1 and sorted_indices.dtype == I32, f"{op}: sorted_indices must be 1-D int32")
    k = 1 if probs is None else probs.shape[1]
    t = sorted_indices.numel() // k
    need(t * k == sorted_indices.numel() and (probs is None or tuple(probs.shape) == (t, k)),
         f"{op}: {sorted_indices.numel()} indices do not match probs {None if probs is None else tuple(probs.shape)}")
    idx = sorted_indices.to(I64)
    need(bool(((idx >= 0) & (idx < permuted_tokens.shape[0])).all()), f"{op}: sorted_indices must lie in "
         f"[0, {permuted_tokens.shape[0]}); -1 (dropped pairs) is not documented for this op: mask before combine")
    rows = permuted_tokens.float()[idx].reshape(t, k, h)
    w = torch.ones(t, 1) if probs is None else probs.float()
    return (rows * w.unsqueeze(-1)).sum(1).to(permuted_tokens.dtype)


def rms_norm(x, gamma, epsilon, *, soc):
    """rstd = rsqrt(mean(x^2 over gamma's dims) + eps), fp32 [x.shape[:-g] + 1s]; y = x * rstd * gamma, x's dtype."""
    c, op = chip(soc), "npu_rms_norm"
    check_float(c, op, c.float_dtypes, x, gamma)
    need(gamma.dtype == x.dtype and tuple(x.shape[x.dim() - gamma.dim():]) == tuple(gamma.shape),
         f"{op}: gamma {gamma.dtype} {tuple(gamma.shape)} must match x's dtype and trailing dims {tuple(x.shape)}")
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(tuple(range(-gamma.dim(), 0)), keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def scatter_nd_update_(x, indices, updates, *, soc):
    """TF ScatterNd in place: x[indices[j]] = updates[j], indices (..., a), updates indices.shape[:-1] + x.shape[a:].
    The device does not range-check (it would write stray memory); the emulation raises IndexError instead."""
    c, op = chip(soc), "npu_scatter_nd_update_"
    check_float(c, op, c.scatter_dtypes, x)
    need(indices.dtype in (I32, I64) and 1 <= indices.shape[-1] <= x.dim(), f"{op}: indices must be int32/int64 "
         f"(..., a) with 1 <= a <= {x.dim()}")
    a = indices.shape[-1]
    need(updates.dtype == x.dtype and tuple(updates.shape) == tuple(indices.shape[:-1]) + tuple(x.shape[a:]),
         f"{op}: updates {updates.dtype} {tuple(updates.shape)} must be {x.dtype} "
         f"{tuple(indices.shape[:-1]) + tuple(x.shape[a:])}")
    flat = indices.reshape(-1, a).to(I64)
    x[tuple(flat.t())] = updates.reshape(-1, *x.shape[a:])
    return x
