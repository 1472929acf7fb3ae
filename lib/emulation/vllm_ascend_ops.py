"""CPU kernels of vllm-ascend's DeepSeek-V4 custom ops (torch.ops._C_ascend; schemas in
data/vllm_ascend-dsv4-op-schemas.txt): the math each kernel computes, its inputs' layouts and dtypes,
and its shape limits as vllm-ascend checks them (commit 182b75ea84): for mHC, its callers' checks before
choosing the kernel (the DeepSeek-V4 DSpark model file's `_dspark_mhc_pre_custom_op_supported` /
`_dspark_mhc_post_custom_op_supported`: hc 4, D in {4096, 7168}, bf16 residual streams, fp32 mixing
parameters); for routing, the binding's TORCH_CHECKs (csrc/torch_binding.cpp moe_gating_top_k_hash:
E <= 2048, renorm 0). Width limits yield to lib.emulation.relaxed; nothing else does. Must not know the model or which backend calls it.
"""
from __future__ import annotations

import torch

from lib.emulation.invariant_matmul import matmul
from lib.emulation.npu_ops import BF16, F16, F32, I32, I64, _real_stack, need  # noqa: PLC2701 - the one probe of the real stack
from lib.emulation.relaxed import widths_relaxed

HC_WIDTHS = (4096, 7168)     # hidden sizes the fused mHC kernels are built for
HC_STREAMS = 4               # residual streams (hc_mult) they take


def real_op(name: str):
    """torch.ops._C_ascend.<name> with an NPU present and vllm-ascend's custom-op library loaded, else None."""
    if _real_stack() is None:
        return None
    try:
        return getattr(torch.ops._C_ascend, name)
    except (AttributeError, RuntimeError):   # vllm_ascend not imported, or built without the op
        return None


def _check_width(op: str, d: int) -> None:
    need(d in HC_WIDTHS or widths_relaxed(), f"{op}: hidden size {d} is not one the fused mHC kernel is built "
         f"for ({', '.join(map(str, HC_WIDTHS))}); choose the composite below these widths")


def hc_pre_v2(x, hc_fn, hc_scale, hc_base, hc_mult: int, hc_sinkhorn_iters: int, norm_eps: float, hc_eps: float):
    """x [T, n, D] bf16 streams -> (u [T, D] bf16, post [T, n] fp32, comb [T, n, n] fp32), all in fp32 inside:
    the RMS-scaled mixing GEMM, pre = sigmoid + eps, post = 2 sigmoid, comb = softmax + eps, then the
    Sinkhorn normalisation (a column step, then iters - 1 row / column pairs, each over sum + eps),
    u = sum_k pre_k X_k rounded once."""
    op = "npu_hc_pre_v2"
    need(x.dim() == 3 and x.dtype == BF16, f"{op}: x must be bf16 [T, hc, D], found {x.dtype} {tuple(x.shape)}")
    t, n, d = x.shape
    need(n == hc_mult == HC_STREAMS, f"{op}: hc_mult {hc_mult} with {n} streams; the kernel takes {HC_STREAMS}")
    _check_width(op, d)
    mix = (2 + n) * n
    for name, t_, shape in (("hc_fn", hc_fn, (mix, n * d)), ("hc_scale", hc_scale, (3,)), ("hc_base", hc_base, (mix,))):
        need(t_.dtype == F32 and tuple(t_.shape) == shape, f"{op}: {name} must be fp32 {shape}, found "
             f"{t_.dtype} {tuple(t_.shape)}")
    need(hc_sinkhorn_iters >= 1, f"{op}: hc_sinkhorn_iters must be >= 1, found {hc_sinkhorn_iters}")
    flat = x.float().flatten(1)
    m = matmul(flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps), hc_fn.t())
    pre = torch.sigmoid(hc_scale[0] * m[:, :n] + hc_base[:n]) + hc_eps
    post = 2 * torch.sigmoid(hc_scale[1] * m[:, n:2 * n] + hc_base[n:2 * n])
    comb = torch.softmax((hc_scale[2] * m[:, 2 * n:] + hc_base[2 * n:]).unflatten(-1, (n, n)), dim=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    u = (pre.unsqueeze(-1) * x.float()).sum(1)
    return u.to(BF16), post, comb


def hc_post(x, residual, post, comb):
    """x [B, T, D] bf16, residual [B, T, n, D] bf16, post [B, T, n] fp32, comb [B, T, n, n] fp32 ->
    [B, T, n, D] bf16: X_k <- post_k x + sum_j comb[j, k] X_j in fp32, rounded once (comb's FIRST index
    contracts, as the kernel's own fallback writes it)."""
    op = "npu_hc_post"
    need(x.dim() == 3 and residual.dim() == 4 and x.dtype == BF16 and residual.dtype == BF16,
         f"{op}: x must be bf16 [B, T, D] and residual bf16 [B, T, hc, D], found {x.dtype} {tuple(x.shape)} and "
         f"{residual.dtype} {tuple(residual.shape)}")
    b, t, n, d = residual.shape
    need(n == HC_STREAMS and tuple(x.shape) == (b, t, d), f"{op}: residual {tuple(residual.shape)} needs "
         f"{HC_STREAMS} streams and x [B, T, D] = {(b, t, d)}, found x {tuple(x.shape)}")
    _check_width(op, d)
    need(post.dtype == F32 and tuple(post.shape) == (b, t, n) and comb.dtype == F32
         and tuple(comb.shape) == (b, t, n, n), f"{op}: post must be fp32 {(b, t, n)} and comb fp32 {(b, t, n, n)}, "
         f"found {post.dtype} {tuple(post.shape)} and {comb.dtype} {tuple(comb.shape)}")
    mixed = torch.einsum("btjk,btjd->btkd", comb, residual.float())
    return (post.unsqueeze(-1) * x.float().unsqueeze(2) + mixed).to(BF16)


GATING_MAX_EXPERTS = 2048    # moe_gating_top_k_hash's binding refuses more experts


def moe_gating_top_k_hash(x, k: int, bias, input_ids, tid2eid, k_group: int, group_count: int,
                          routed_scaling_factor: float, eps: float, group_select_mode: int, renorm: int,
                          norm_type: int, out_flag: bool):
    """Router logits x [T, E] -> (y [T, k] in x's dtype, expert_idx [T, k] int32, out [T, E] fp32): scores
    s = softmax (norm_type 0), sigmoid (1) or sqrt(softplus) (2) of x in fp32; experts = tid2eid[input_ids]
    when a table is given (hash layers), else the top k of s + bias (bias steers selection only);
    y = s[experts] / (sum + eps) * routed_scaling_factor. `out` holds s with out_flag, else garbage
    (the kernel leaves it unwritten). The binding's own checks are reproduced; expert groups
    (group_count > 1) are not emulated."""
    op = "moe_gating_top_k_hash"
    need(x.dim() == 2 and x.dtype in (F16, BF16, F32), f"{op}: x must be 2-D fp16 / bf16 / fp32, found "
         f"{x.dtype} {tuple(x.shape)}")
    rows, experts = x.shape
    need(0 < experts <= GATING_MAX_EXPERTS, f"{op}: expert_num (E) must be in 1..{GATING_MAX_EXPERTS}, found {experts}")
    need(k > 0 and k_group >= 1 and group_count >= 1, f"{op}: k {k}, k_group {k_group}, group_count {group_count}")
    need(group_select_mode in (0, 1) and renorm == 0 and norm_type in (0, 1, 2) and eps > 0
         and routed_scaling_factor > 0, f"{op}: group_select_mode {group_select_mode} (0 / 1), renorm {renorm} "
         f"(0 only), norm_type {norm_type} (0 / 1 / 2), eps {eps} and routed_scaling_factor "
         f"{routed_scaling_factor} (> 0)")
    need(group_count == 1 and k_group == 1, f"{op}: expert groups are not emulated", NotImplementedError)
    if bias is not None:
        need(bias.dim() == 1 and bias.shape[0] == experts and bias.dtype == x.dtype, f"{op}: bias must be "
             f"[{experts}] in x's dtype {x.dtype}, found {bias.dtype} {tuple(bias.shape)}")
    xf = x.float()
    scores = (torch.softmax(xf, -1) if norm_type == 0 else torch.sigmoid(xf) if norm_type == 1
              else torch.sqrt(torch.nn.functional.softplus(xf)))
    if tid2eid is not None:
        need(input_ids is not None and input_ids.dtype in (I32, I64) and input_ids.numel() == rows
             and tid2eid.dtype in (I32, I64) and tid2eid.dim() == 2 and tid2eid.shape[1] == k,
             f"{op}: hash routing needs int32 / int64 input_ids of {rows} rows and tid2eid [V, {k}], found "
             f"{None if input_ids is None else (input_ids.dtype, tuple(input_ids.shape))} and "
             f"{tid2eid.dtype} {tuple(tid2eid.shape)}")
        ids = tid2eid.index_select(0, input_ids.reshape(-1)).to(I32)
    else:
        steer = scores if bias is None else scores + bias.float()
        ids = torch.topk(steer, k, dim=-1).indices.to(I32)
    picked = scores.gather(1, ids.long())
    y = picked / (picked.sum(-1, keepdim=True) + eps) * routed_scaling_factor
    out = scores if out_flag else torch.full_like(scores, float("nan"))
    return y.to(x.dtype), ids, out


ROTARY_MODES = {"half": 0, "interleave": 1, "quarter": 2, "interleave-half": 3}   # the binding's names


def inplace_partial_rotary_mul(x, r1, r2, rotary_mode: str, partial_slice) -> None:
    """Rotate channels [start, end) of x [B, S, N, D] in place: pairs (a, b) -> (a r1 - b r2, b r1 + a r2),
    r1 / r2 per channel [B, 1 or S, 1, end - start] in x's dtype or fp32, computed in fp32. A mode name the
    binding does not know makes it return without a launch (csrc/torch_binding.cpp
    inplace_partial_rotary_mul_npu), so x is left as it was; the A2 / A3 tiling takes only "interleave"
    (inplace_partial_rotary_mul_a3_tiling.cpp: "mode only support interleave")."""
    op = "inplace_partial_rotary_mul"
    if rotary_mode not in ROTARY_MODES:
        return None
    need(x.dim() == 4, f"{op}: Input tensor x's dim num should be 4, actual {x.dim()}")
    need(rotary_mode == "interleave", f"{op}: mode only support interleave on 910B / 910_93, found {rotary_mode!r}")
    start, end = partial_slice
    width = end - start
    need(0 <= start and 0 < width and end <= x.shape[-1] and width % 2 == 0, f"{op}: partial_slice {list(partial_slice)} "
         f"must be an even, non-empty slice of the last dim {x.shape[-1]}")
    need(r1.dim() == 4 and r1.shape == r2.shape and r1.dtype == r2.dtype and r1.dtype in (x.dtype, F32),
         f"{op}: r1 / r2 must be 4-D, the same shape and dtype (x's or fp32), found {r1.dtype} {tuple(r1.shape)} / "
         f"{r2.dtype} {tuple(r2.shape)}")
    need(r1.shape[0] == x.shape[0] and r1.shape[1] in (1, x.shape[1]) and r1.shape[2] == 1 and r1.shape[3] == width
         and (x.shape[1] == 1 or x.shape[2] == 1), f"{op}: r1 {tuple(r1.shape)} must be [{x.shape[0]}, 1 or "
         f"{x.shape[1]}, 1, {width}] for x {tuple(x.shape)} with S or N of 1 (the A2 / A3 tiling)")
    seg = x[..., start:end].float()
    swapped = torch.stack((-seg[..., 1::2], seg[..., 0::2]), dim=-1).flatten(-2)
    x[..., start:end] = (seg * r1.float() + swapped * r2.float()).to(x.dtype)
    return None
