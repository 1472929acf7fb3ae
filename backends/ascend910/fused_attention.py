"""ascend910's fused DeepSeek-V4 compressor, indexer and attention. The compressor (profile `fused:
compressor`) is vllm-ascend's `compressor` over the paged compressor state, as its DeepSeek-V4 compressor
calls it (vllm_ascend/models/deepseek_v4/compressor.py at commit 182b75ea84): the state pool of A | Z rows
read and written through a block table whose every entry is the sequence's slot + 1 (a ring of R rows is
one block of R rows; slot 0 of the pool is the block the kernel never writes), the entries' rope rows made
once per step (StepRope.kernel), then the completed entries written into the entry pool. The indexer (profile `fused: indexer`) is torch_npu's
`npu_lightning_indexer` over the indexer's compressed keys. The attention (profile `fused: sparse_attn`) is vllm-ascend's
`npu_sparse_attn_sharedkv` over the paged pools, as its DeepSeek-V4 attention calls it (dsa_v1.py
1481-1592 at commit 182b75ea84): q [T, H, D] "TND" with cu_seqlens_q, the window ring as "PA_ND" KV,
the compressed entries through the ratio's block table, the indexer's top-k (CSA) or every complete
entry (HCA), the sinks; its tiling buffer from `npu_sparse_attn_sharedkv_metadata`, made once per step for
each attention shape (window only, ratio 4, ratio 128) and reused by every layer of that shape.

The kernel reads only the pools, so the step's KV rows are written into the window ring first. A ring
of R rows (a multiple of 16: profile cache.ring_rows_multiple) is one block of R rows per sequence, its
block-table entries all the sequence's slot (Addressing `window_table`): position x is read at row
x % R, which is where the ring keeps it. That holds while a sequence feeds at most R - W + 1 tokens a
step (decode, a DSpark verify); a longer prefill chunk would overwrite window rows its own first
queries read, so such a step takes the composite, as do pools the kernel cannot address (a ring whose
rows are not a block size it takes, hybrid block geometry: pools built for another backend, such as
conformance's recorded reference inputs). This module must not know whether the ops are the real
kernels or the emulation.
"""
from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

from backends.ascend910 import device_ops as device
from backends.ascend910 import lowerings
from backends.common import attention
from lib.distributed import process_group as parallel
from lib.emulation.sharedkv_attention import TOPK, paged_block_ok
from lib.guard.capability import ONCE_PER_STEP, section

DTYPE = torch.bfloat16
ROTARY_INTERLEAVE = 2      # the compressor's rotary_mode: DeepSeek-V4's interleaved pairs
CACHE_MODE = 1             # the compressor's cache_mode as vllm-ascend's DeepSeek-V4 compressor passes it


def compressor_takes(batch, ring: int, *, ratio: int, overlap: bool, angles) -> bool:
    """Whether the compressor kernel can run this step: a ring it addresses as one block (rows a multiple of 16 up
    to 1024), the entries' rope rows made (this backend's rope_angles), and no sequence feeding more tokens than the
    ring holds past the positions an entry pools (the kernel writes them all before it reads the state back)."""
    pooled = 2 * ratio if overlap else ratio
    return (batch.state.step_tokens <= ring - pooled + 1 and paged_block_ok(ring)
            and bool(angles.entries[ratio].kernel))


def compress_fused(h, batch, pools, wkv, wgate, ape, norm, *, ratio: int, overlap: bool, eps: float, angles,
                   rope_dim: int):
    """The compressor kernel and one write of the entries it completes; the composite where a step feeds more
    tokens than the ring holds past the positions an entry pools (a long prefill chunk: the kernel writes the
    whole chunk into the ring before it reads it back), or where the pools are not ones it can address."""
    addr, ring = batch.state, pools.state.shape[1]
    if not compressor_takes(batch, ring, ratio=ratio, overlap=overlap, angles=angles):
        return lowerings.compress(h, batch, pools, wkv, wgate, ape, norm, ratio=ratio, overlap=overlap, eps=eps,
                                  angles=angles, rope_dim=rope_dim)
    cos, sin = angles.entries[ratio].kernel
    out = device.compressor(h.to(DTYPE), wkv, wgate, pools.state, ape, norm, sin, cos, addr.step(("state_table", ring)),
                            addr.step(("query_start",)), None, addr.step(("start_pos",)), rope_dim, ratio,
                            2 if overlap else 1, eps, ROTARY_INTERLEAVE, CACHE_MODE)
    slots = addr.writes[ratio].slots
    n = min(slots.shape[0], out.shape[0])     # the entries completed; a bucketed step's padded writes: trash rows
    pools.entries.index_copy_(0, slots[:n], out[:n].to(pools.entries.dtype))
    return pools


def index_select_fused(q, weights, batch, keys, *, topk: int, ratio: int, weight_scale: float, group=None):
    """torch_npu's npu_lightning_indexer (profile `fused: indexer`) -> [T, topk] int32 sequence-local entry ids,
    the highest scores first, -1 trailing. Every token row is its own batch of one query (cumulative query
    lengths 1..T), its keys its sequence's entries through that sequence's block table, as many as it may
    read ((p + 1) // ratio): the kernel's causal rule then sees exactly those, whatever the step's mix of
    sequences and drafts. The weights carry the scale (the kernel has none), in q's dtype as the kernel
    requires."""
    q, weights = parallel.gather_heads(q, weights, group)
    addr = batch.state
    ws = (weights * weight_scale).to(DTYPE)   # bf16 x a Python float: torch multiplies in fp32 and rounds once (one launch)
    ids, _ = device.npu_lightning_indexer(
        q.to(DTYPE), keys.view(-1, addr.block_tokens, 1, q.shape[-1]), ws,
        actual_seq_lengths_query=addr.step(("row_ends",)), actual_seq_lengths_key=addr.step(("limit", ratio)),
        block_table=addr.step(("row_table", ratio)), layout_query="TND", layout_key="PA_BSND", sparse_count=topk,
        sparse_mode=3)
    return ids[:, 0, :]


def sparse_attention_fused(q, kv, batch, windows, entries, selection, sink, *, window: int, ratio: int):
    """Window + compressed entries + sink in one kernel; returns (o [T, H, D] bf16, the window pool written)."""
    addr, ring, d = batch.state, windows.shape[1], q.shape[-1]
    addressable = paged_block_ok(ring) and paged_block_ok(addr.block_tokens) and (
        addr.block_tokens == addr.logical_block_tokens)
    if addr.step_tokens > ring - window + 1 or not addressable:
        return attention.sparse_attention(q, kv, batch, windows, entries, selection, sink, window=window, ratio=ratio)
    windows.view(-1, d).index_copy_(0, addr.step(("ring", ring)), kv.to(windows.dtype))
    cmp = entries is not None
    seq = {"cu_seqlens_q": addr.step(("query_start",)), "seqused_kv": addr.step(("seq_lens",))}
    shape = {"cmp_ratio": ratio if cmp else 1, "ori_win_left": window - 1, "ori_win_right": 0,
             "layout_q": "TND", "layout_kv": "PA_ND"}
    meta = _tiling(seq, heads=q.shape[1], head_dim=d, batch_size=addr.seq_slot.shape[0], max_seqlen_q=addr.step_tokens,
                   max_seqlen_kv=addr.max_len, cmp_topk=0 if selection is None else TOPK, has_cmp_kv=cmp,
                   device=str(q.device), **shape)
    table = addr.sites.group_of(addr.tables, ratio).table if cmp else None
    if selection is not None and selection.shape[-1] < TOPK:    # the kernel reads 512 ids a row, up to the first -1
        selection = torch.nn.functional.pad(selection, (0, TOPK - selection.shape[-1]), value=-1)
    out, _ = device.npu_sparse_attn_sharedkv(
        q.to(DTYPE), ori_kv=windows.view(-1, ring, 1, d), ori_block_table=addr.step(("window_table", ring)),
        cmp_kv=entries.view(-1, addr.block_tokens, 1, d) if cmp else None, cmp_block_table=table,
        cmp_sparse_indices=None if selection is None else selection.unsqueeze(1), sinks=sink.float(), metadata=meta,
        softmax_scale=d ** -0.5, **seq, **shape)
    return out, windows


# step tensor (cu_seqlens_q) -> {layer shape: tiling}: the tilings of the step that tensor belongs to, dropped with it
_TILINGS = WeakIdKeyDictionary()


def _tiling(seq: dict, *, heads: int, **shape):
    """The attention kernel's tiling for this step and layer shape, made by the first layer of that shape and reused
    by the rest: the tiling depends only on the step's lengths and the shape, and vllm-ascend's attention metadata
    builder keeps one per shape for the whole step (cann-recipes-infer's DeepSeek-V4 inference guide, "AICPU
    Scheduler算子多流并行": one npu_sparse_attn_sharedkv_metadata per attention kind per forward, reused across
    layers; vllm-ascend's common_ratio_to_sas_metadata cache)."""
    step = _TILINGS.setdefault(seq["cu_seqlens_q"], {})
    key = (id(seq["seqused_kv"]), heads, *sorted(shape.items()))
    if key not in step:
        with section(ONCE_PER_STEP):
            step[key] = device.npu_sparse_attn_sharedkv_metadata(heads, 1, shape.pop("head_dim"), **seq, **shape)
    return step[key]
