"""CPU kernel of torch_npu's `npu_moe_finalize_routing` on Atlas A2 / A3 (aclnnMoeFinalizeRoutingV2, which
torch_npu 2.14's op calls when the CANN build has it; schema in data/torch_npu-2.14.0-npu-op-schemas.txt),
as cann/ops-transformer documents it (moe/moe_finalize_routing_v2/docs/aclnnMoeFinalizeRoutingV2.md):

    out[i, :] = x1[i] + x2[i] + sum_k scales[i, k] * (expanded_x[expanded_row_idx[r(i, k)]] + bias[expert_idx[i, k]])

with r(i, k) = i + k * N for drop_pad_mode 0 (the index arranged by column, aclnnMoeInitRouting's output) and
i * K + k for drop_pad_mode 2 (arranged by row: npu_moe_init_routing_v2's expanded_row_idx as it comes). On A2 /
A3 the scales may be fp32 beside bf16 rows ("mixed precision"), x1 / x2 / bias take the rows' dtype, x2 needs
x1, bias needs expert_idx. Emulated: the dropless modes 0 and 2, accumulated in fp32 and rounded once to the
rows' dtype (the doc states no accumulation type; the emulation of npu_moe_token_unpermute, its unfused
counterpart, accumulates the same way).
"""
from __future__ import annotations

import torch

from lib.emulation.npu_ops import BF16, F16, F32, I32, need

OP = "npu_moe_finalize_routing"
FLOATS = (F16, BF16, F32)


def _check(rows, skip1, skip2, bias, scales, row_idx, expert_idx, drop_pad_mode):
    need(drop_pad_mode in (0, 2), f"{OP}: drop_pad_mode {drop_pad_mode}: the dropless modes 0 (index by column) "
         "and 2 (by row) are emulated, the drop / pad modes 1 and 3 are not", NotImplementedError)
    need(rows.dim() == 2 and rows.dtype in FLOATS, f"{OP}: expanded_permuted_rows must be 2-D fp16 / bf16 / fp32, "
         f"found {rows.dtype} {tuple(rows.shape)}")
    need(row_idx.dim() == 1 and row_idx.dtype == I32 and row_idx.numel() == rows.shape[0],
         f"{OP}: expanded_src_to_dst_row must be int32 [NUM_ROWS * K] = [{rows.shape[0]}], found {row_idx.dtype} "
         f"{tuple(row_idx.shape)}")
    need(skip2 is None or skip1 is not None, f"{OP}: skip2 needs skip1 (aclnnMoeFinalizeRoutingV2: x1 before x2)")
    need(bias is None or expert_idx is not None, f"{OP}: bias needs export_for_source_row (the expert of each pair)")
    for name, t in (("skip1", skip1), ("skip2", skip2), ("bias", bias)):
        found = None if t is None else t.dtype
        need(t is None or found == rows.dtype, f"{OP}: {name} must have the rows' dtype {rows.dtype}, found {found}")
    need(scales is None or scales.dtype == rows.dtype or (scales.dtype == F32 and rows.dtype == BF16),
         f"{OP}: scales {None if scales is None else scales.dtype} must have the rows' dtype (fp32 beside bf16 rows "
         "is the documented mixed precision)")


def moe_finalize_routing(rows, skip1, skip2, bias, scales, row_idx, expert_idx, drop_pad_mode, k):
    _check(rows, skip1, skip2, bias, scales, row_idx, expert_idx, drop_pad_mode)
    k = scales.shape[1] if scales is not None else (k or 1)
    n = rows.shape[0] // k
    need(n * k == rows.shape[0] and (scales is None or tuple(scales.shape) == (n, k)),
         f"{OP}: {rows.shape[0]} rows do not split into NUM_ROWS x K with scales "
         f"{None if scales is None else tuple(scales.shape)}")
    for name, t in (("skip1", skip1), ("skip2", skip2)):
        need(t is None or tuple(t.shape) == (n, rows.shape[1]), f"{OP}: {name} must be [{n}, {rows.shape[1]}], "
             f"found {None if t is None else tuple(t.shape)}")
    idx = row_idx.to(torch.int64)
    need(bool(((idx >= 0) & (idx < rows.shape[0])).all()), f"{OP}: expanded_src_to_dst_row values must lie in "
         f"[0, {rows.shape[0]}) in the dropless modes")
    order = idx.view(k, n).t() if drop_pad_mode == 0 else idx.view(n, k)          # [N, K] rows of each token
    picked = rows.float()[order]                                                 # [N, K, H]
    if bias is not None:
        picked = picked + bias.float()[expert_idx.to(torch.int64)]
    w = torch.ones(n, k) if scales is None else scales.float()
    out = (picked * w.unsqueeze(-1)).sum(1)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.float()
    return out.to(rows.dtype)
