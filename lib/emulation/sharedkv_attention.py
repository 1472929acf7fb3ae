"""CPU kernels of vllm-ascend's DeepSeek-V4 hybrid attention, `npu_sparse_attn_sharedkv` and its tiling
companion `npu_sparse_attn_sharedkv_metadata` (torch.ops._C_ascend; schemas in
data/vllm_ascend-dsv4-op-schemas.txt), as vllm-ascend commit 182b75ea84 builds and checks them
(csrc/attention/sparse_attn_sharedkv: README.md, op_host/sparse_attn_sharedkv_tiling.cpp, op_kernel/
scfa_kernel.h, swa_kernel.h, scfa_block_vector.h) and calls them (vllm_ascend/attention/dsa_v1.py
1481-1592):

* q [T, N1, D] (layout "TND", cu_seqlens_q [B+1]); K = V ("shared KV"), one KV head; D = 512.
* The query row i of batch b sits at position p = seqused_kv[b] - S1_b + i (the step's tokens are the
  last S1_b of the sequence).
* ori_kv [blocks, bs, 1, D] (layout "PA_ND"): position x of batch b is row x % bs of block
  ori_block_table[b, x // bs]; ori_mask_mode 4: p sees x in [max(p - ori_win_left, 0), min(p + ori_win_right, S2 - 1)].
* cmp_kv [blocks, cbs, 1, D]: entry e the same way through cmp_block_table; cmp_mask_mode 3: e is
  visible iff e < (p + 1) // cmp_ratio (the entry is complete at p). With cmp_sparse_indices
  [T, 1, K] (sequence-local entry ids) only those are read, up to the first negative one (the
  kernel stops there: -1 padding must trail); without, every visible entry (ratio 128).
* One softmax (scores * softmax_scale, fp32) over the window rows, the compressed rows and a per-head
  sink (fp32 [N1]) that adds exp(sink) to the denominator; out in q's dtype. No inverse RoPE.

The tiling buffer is opaque on the device (int32 [1024]); here it records the arguments that shape
the tiling, and the kernel refuses a buffer built for other ones (a metadata of another layer's ratio
would tile the wrong work). Width limits (D, the head count) yield to lib.emulation.relaxed.
"""
from __future__ import annotations

import torch

from lib.emulation.npu_ops import BF16, F16, F32, I32, need
from lib.emulation.relaxed import widths_relaxed

HEAD_DIM = 512               # DIM_LIMIT (op_host/sparse_attn_sharedkv_tiling.h:127)
METADATA_INTS = 1024         # the tiling buffer (torch_binding.cpp OUTPUT_SIZE; tiling.cpp:1256)
RATIOS = (4, 128)            # cmp_ratio whenever cmp_kv is given (tiling.cpp:1268)
TOPK = 512                   # cmp_sparse_indices width, "only 512" (README.md:65)
def paged_block_ok(n: int) -> bool:
    """A paged KV block size these kernels take: a multiple of 16, at most 1024 (sparse_attn_sharedkv
    tiling.cpp:1196, 1221; lightning_indexer tiling: the same limits)."""
    return n % 16 == 0 and n <= 1024


_TILED = ("num_heads_q", "head_dim", "batch_size", "cmp_topk", "cmp_ratio", "ori_win_left", "ori_win_right",
          "has_cmp_kv")     # the arguments recorded in the emulated buffer, in this order


def metadata(num_heads_q, num_heads_kv, head_dim, *, batch_size, cmp_topk, cmp_ratio, ori_mask_mode,
             cmp_mask_mode, ori_win_left, ori_win_right, layout_q, layout_kv, has_cmp_kv, device) -> torch.Tensor:
    op = "npu_sparse_attn_sharedkv_metadata"
    need(num_heads_kv == 1, f"{op}: num_heads_kv must be 1 (shared KV), found {num_heads_kv}")
    need((layout_q, layout_kv) == ("TND", "PA_ND"), f"{op}: layouts ({layout_q}, {layout_kv}); vllm-ascend's "
         "DeepSeek-V4 attention uses (TND, PA_ND), the only KV layout the kernel supports (README.md:77)")
    need((ori_mask_mode, cmp_mask_mode) == (4, 3), f"{op}: mask modes ({ori_mask_mode}, {cmp_mask_mode}); only (4, 3)")
    out = torch.zeros(METADATA_INTS, dtype=I32, device=device)
    values = (num_heads_q, head_dim, batch_size, cmp_topk, cmp_ratio, ori_win_left, ori_win_right, int(has_cmp_kv))
    out[:len(values)] = torch.tensor(values, dtype=I32)
    return out


def _check(q, ori_kv, cmp_kv, indices, sinks, meta, tables, *, cmp_ratio, ori_win_left, ori_win_right, masks, layouts,
           batch: int, lse: bool) -> None:
    op = "npu_sparse_attn_sharedkv"
    need(layouts == ("TND", "PA_ND"), f"{op}: layouts {layouts}; the kernel takes q TND with cu_seqlens_q and PA_ND KV")
    given = (("q", q), ("ori_kv", ori_kv), ("cmp_kv", cmp_kv), ("cmp_sparse_indices", indices), *tables.items())
    for name, t_ in ((n, t_) for n, t_ in given if t_ is not None):
        need(t_.numel() > 0, f"{op}: {name} is empty {tuple(t_.shape)}; no input may be (README.md:82)")
        need(not name.endswith("block_table") or (t_.dtype == I32 and t_.dim() == 2), f"{op}: {name} must be int32 [B, blocks]")
    need(masks == (4, 3), f"{op}: ori_mask_mode / cmp_mask_mode {masks}; the kernel supports only 4 and 3")
    need(not lse, f"{op}: return_softmax_lse is not supported (README.md:78)")
    need(q.dim() == 3 and q.dtype in (BF16, F16), f"{op}: q must be fp16/bf16 [T, N1, D], found {q.dtype} {tuple(q.shape)}")
    t, n1, d = q.shape
    need(d == HEAD_DIM or widths_relaxed(), f"{op}: head dim {d}; the kernel is built for {HEAD_DIM}")
    need(n1 % 4 == 0 or widths_relaxed(), f"{op}: {n1} q heads; the kernel needs a multiple of 4")
    for name, kv in (("ori_kv", ori_kv), ("cmp_kv", cmp_kv)):
        if kv is not None:
            need(kv.dim() == 4 and kv.shape[2] == 1 and kv.shape[3] == d and kv.dtype == q.dtype,
                 f"{op}: {name} must be {q.dtype} [blocks, block_size, 1, {d}], found {kv.dtype} {tuple(kv.shape)}")
            need(paged_block_ok(kv.shape[1]),
                 f"{op}: {name} block size {kv.shape[1]}; it must be a multiple of 16 and at most 1024")
    need(ori_kv is not None and tables["ori_block_table"] is not None,
         f"{op}: ori_kv and ori_block_table are required (the sliding window)")
    need((cmp_kv is None) == (tables["cmp_block_table"] is None), f"{op}: cmp_kv and cmp_block_table come together")
    need(ori_win_left >= 0 and ori_win_right >= 0, f"{op}: window ({ori_win_left}, {ori_win_right}) must be >= 0")
    need(cmp_kv is None or cmp_ratio in RATIOS, f"{op}: cmp_ratio {cmp_ratio} with cmp_kv; the kernel takes {RATIOS}")
    need(indices is None or (cmp_kv is not None and indices.dtype == I32 and tuple(indices.shape) == (t, 1, TOPK)),
         f"{op}: cmp_sparse_indices must be int32 [T, 1, {TOPK}] with cmp_kv (pad a smaller top-k with -1)")
    need(sinks is not None and sinks.dtype == F32 and tuple(sinks.shape) == (n1,), f"{op}: sinks must be fp32 [{n1}]")
    need(meta is not None and meta.dtype == I32 and tuple(meta.shape) == (METADATA_INTS,),
         f"{op}: metadata must be the int32 [{METADATA_INTS}] of npu_sparse_attn_sharedkv_metadata")
    want = (n1, d, batch, 0 if indices is None else indices.shape[-1], cmp_ratio, ori_win_left, ori_win_right,
            int(cmp_kv is not None))
    got = tuple(int(v) for v in meta[:len(_TILED)])
    need(got == want, f"{op}: the metadata was built for {dict(zip(_TILED, got))}, this call is {dict(zip(_TILED, want))}")


def _paged_rows(table: torch.Tensor, b: torch.Tensor, x: torch.Tensor, block: int) -> torch.Tensor:
    """Flat pool rows of positions x [T, k] of batches b [T] through block tables [B, n] (x clamped in range)."""
    col = (x // block).clamp(0, table.shape[1] - 1)
    return table.long()[b[:, None], col].clamp(min=0) * block + x % block


def sparse_attn_sharedkv(q, *, ori_kv, cmp_kv, cmp_sparse_indices, ori_block_table, cmp_block_table, cu_seqlens_q,
                         seqused_kv, sinks, metadata, softmax_scale, cmp_ratio, ori_mask_mode, cmp_mask_mode,
                         ori_win_left, ori_win_right, layout_q, layout_kv, return_softmax_lse):
    """-> (out [T, N1, D] in q's dtype, softmax_lse (not computed, as on the device: [T, N1, 1] zeros))."""
    batch = cu_seqlens_q.shape[0] - 1
    _check(q, ori_kv, cmp_kv, cmp_sparse_indices, sinks, metadata,
           {"ori_block_table": ori_block_table, "cmp_block_table": cmp_block_table}, cmp_ratio=cmp_ratio, ori_win_left=ori_win_left,
           ori_win_right=ori_win_right, masks=(ori_mask_mode, cmp_mask_mode), layouts=(layout_q, layout_kv),
           batch=batch, lse=return_softmax_lse)
    t, n1, d = q.shape
    starts = cu_seqlens_q.long()
    b = torch.bucketize(torch.arange(t), starts[1:], right=True)                    # each row's batch
    p = seqused_kv.long()[b] - (starts[b + 1] - starts[b]) + (torch.arange(t) - starts[b])
    s2 = seqused_kv.long()[b]
    x = p[:, None] - ori_win_left + torch.arange(ori_win_left + ori_win_right + 1)   # [T, W] window positions
    ok = (x >= 0) & (x <= s2[:, None] - 1)
    ori = ori_kv.reshape(-1, d)
    keys = [ori.index_select(0, _paged_rows(ori_block_table, b, x.clamp(min=0), ori_kv.shape[1]).reshape(-1)).view(t, -1, d)]
    masks = [ok]
    if cmp_kv is not None:
        limit = (p + 1) // cmp_ratio
        if cmp_sparse_indices is not None:
            ids = cmp_sparse_indices[:, 0, :].long()
            live = torch.cumprod((ids >= 0).to(torch.int64), dim=-1).bool() & (ids < limit[:, None])
        else:
            ids = torch.arange(int((seqused_kv.long() // cmp_ratio).max()) if batch else 0).expand(t, -1)
            live = ids < limit[:, None]
        cmp = cmp_kv.reshape(-1, d)
        rows = _paged_rows(cmp_block_table, b, ids.clamp(min=0), cmp_kv.shape[1])
        keys.append(cmp.index_select(0, rows.reshape(-1)).view(t, -1, d))
        masks.append(live)
    k = torch.cat(keys, dim=1).float()                                                  # [T, W + K, D]
    mask = torch.cat(masks, dim=1)
    logits = torch.where(mask[:, None, :], torch.bmm(q.float(), k.transpose(1, 2)) * softmax_scale, float("-inf"))
    sink = sinks.float()[None, :, None]
    top = torch.maximum(logits.amax(-1, keepdim=True), sink)
    e = torch.exp(logits - top)
    out = torch.bmm(e, k) / (e.sum(-1, keepdim=True) + torch.exp(sink - top))
    return out.to(q.dtype), torch.zeros(t, n1, 1, dtype=F32)
