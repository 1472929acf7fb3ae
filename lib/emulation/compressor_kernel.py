"""CPU kernel of vllm-ascend's DeepSeek-V4 compressor (torch.ops._C_ascend.compressor; schema in
data/vllm_ascend-dsv4-op-schemas.txt), as vllm-ascend 182b75ea84 has it: csrc/attention/compressor
(README.md for the interface and limits; op_kernel/arch32, the 910B / 910_93 kernel, for the state
layout and the order of work) and its caller vllm_ascend/models/deepseek_v4/compressor.py.

What the kernel does for x [T, H] of B sequences (cu_seqlens, start_pos):
- projects every token: A = x W_kv^T, Z = x W_gate^T + ape[p mod m] (fp32; p = start_pos + row);
- writes [A | Z] of position p to state row p mod bs of block state_block_table[b, p // bs], skipping
  every write to block 0 (WriteToCacheState: `if (idInBlockTable != 0)`), then
- for every entry e the step completes (start // m <= e < end // m, batches in order) pools its
  positions: with coff 2 (overlap) window e-1's left half of A / Z and window e's right half, else
  window e; a position before start_pos is read back from the state (after the step's writes), one
  before 0 counts as kv 0 and score -inf (DuplicateFirstBlock); softmax over the positions per
  channel, the A-weighted sum, RMSNorm (norm_weight, norm_eps), interleaved RoPE on the trailing
  rope_head_dim channels with the row's rope_cos / rope_sin (rotary_mode 2: (a, b) -> (a cos - b sin,
  b cos + a sin) per pair, cos and sin given per channel);
- returns cmp_kv [rope_sin rows, D] in x's dtype: the entries packed in batch order, the rows past them
  left unwritten on the device (zero here).
Width limits (D, H, rope_head_dim) yield to lib.emulation.relaxed; nothing else does. Must not know the
model or which backend calls it.
"""
from __future__ import annotations

import torch

from lib.emulation.invariant_matmul import matmul
from lib.emulation.npu_ops import BF16, F16, F32, I32, need
from lib.emulation.relaxed import widths_relaxed
from lib.emulation.sharedkv_attention import paged_block_ok

OP = "compressor"
# (head_dim, coff, cmp_ratio) the kernel is built for: C4A, C4Li, C128A (README.md "输入属性限制")
SHAPES = {(512, 2, 4): "C4A", (128, 2, 4): "C4Li", (512, 1, 128): "C128A"}
ROPE_HEAD_DIM = 64        # "rope_head_dim ... 当前仅支持64"
ROTARY_INTERLEAVE = 2     # the only rotary_mode the kernel supports ("支持rotary_mode为2")
CACHE_MODE = 1            # what vllm-ascend's DeepSeek-V4 compressor passes (cache_mode=1)
SCORE_FLOOR = float("-inf")   # a position before 0: the kernel fills SOFTMAX_MIN_NUM, which exp() takes to 0


def _check(x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos, table, cu_seqlens, seqused, start_pos,
           rope_head_dim: int, cmp_ratio: int, coff: int, rotary_mode: int, cache_mode: int) -> None:
    need(x.dim() == 2 and x.dtype in (BF16, F16), f"{OP}: x must be [T, H] bf16 / fp16 (the BS-merged layout the "
         f"DeepSeek-V4 caller passes), found {x.dtype} {tuple(x.shape)}")
    t, h = x.shape
    d = norm_weight.shape[0]
    shape = (d, coff, cmp_ratio)
    if widths_relaxed():
        need((coff, cmp_ratio) in ((2, 4), (1, 128)), f"{OP}: coff {coff} with cmp_ratio {cmp_ratio}; the kernel "
             f"takes coff 2 at ratio 4 and coff 1 at ratio 128")
    else:
        need(shape in SHAPES, f"{OP}: (head_dim, coff, cmp_ratio) {shape} is none of the kernel's "
             f"{', '.join(f'{v} {k}' for k, v in SHAPES.items())}")
        need(1024 <= h <= 10240 and h % 512 == 0, f"{OP}: hidden size {h} must be 1K..10K and a multiple of 512")
        need(rope_head_dim == ROPE_HEAD_DIM, f"{OP}: rope_head_dim {rope_head_dim}; the kernel takes {ROPE_HEAD_DIM}")
    need(rotary_mode == ROTARY_INTERLEAVE and cache_mode == CACHE_MODE, f"{OP}: rotary_mode {rotary_mode} / cache_mode "
         f"{cache_mode}; the kernel rotates interleaved (2) and the V4 caller passes cache_mode {CACHE_MODE}")
    c = coff * d
    for name, w in (("wkv", wkv), ("wgate", wgate)):
        need(w.dtype == x.dtype and tuple(w.shape) == (c, h), f"{OP}: {name} must be {x.dtype} {(c, h)}, found "
             f"{w.dtype} {tuple(w.shape)}")
    need(norm_weight.dim() == 1 and norm_weight.dtype == x.dtype, f"{OP}: norm_weight must be [D] {x.dtype}, "
         f"found {norm_weight.dtype} {tuple(norm_weight.shape)}")
    need(ape.dtype == F32 and tuple(ape.shape) == (cmp_ratio, c), f"{OP}: ape must be fp32 {(cmp_ratio, c)}, found "
         f"{ape.dtype} {tuple(ape.shape)}")
    need(state_cache.dim() == 3 and state_cache.dtype == F32 and state_cache.shape[0] > 0
         and state_cache.shape[2] == 2 * c and paged_block_ok(state_cache.shape[1]),
         f"{OP}: state_cache must be fp32 [blocks > 0, block_size, 2 * coff * D = {2 * c}] with a block size a "
         f"multiple of 16 up to 1024, found {state_cache.dtype} {tuple(state_cache.shape)}")
    need(seqused is None and cu_seqlens is not None and start_pos is not None and table is not None,
         f"{OP}: the DeepSeek-V4 caller passes cu_seqlens, start_pos and state_block_table, never seqused")
    b = start_pos.shape[0]
    need(cu_seqlens.dtype == I32 and start_pos.dtype == I32 and table.dtype == I32 and tuple(cu_seqlens.shape) == (b + 1,)
         and table.dim() == 2 and table.shape[0] == b, f"{OP}: cu_seqlens [B + 1], start_pos [B] and "
         f"state_block_table [B, n] must be int32, found {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}, {start_pos.dtype} "
         f"{tuple(start_pos.shape)}, {table.dtype} {tuple(table.shape)}")
    cu = cu_seqlens.tolist()
    need(cu[0] == 0 and cu[-1] == t and all(a <= z for a, z in zip(cu, cu[1:])), f"{OP}: cu_seqlens {cu} must rise "
         f"from 0 to T = {t}")
    rows = min(t, t // cmp_ratio + b)
    for name, r in (("rope_sin", rope_sin), ("rope_cos", rope_cos)):
        need(r.dtype == x.dtype and tuple(r.shape) == (rows, rope_head_dim), f"{OP}: {name} must be {x.dtype} "
             f"[min(T, T // cmp_ratio + B), rope_head_dim] = {(rows, rope_head_dim)}, found {r.dtype} {tuple(r.shape)}")


def compressor(x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos, state_block_table, cu_seqlens,
               seqused, start_pos, rope_head_dim: int, cmp_ratio: int, coff: int, norm_eps: float, rotary_mode: int,
               cache_mode: int) -> torch.Tensor:
    _check(x, wkv, wgate, state_cache, ape, norm_weight, rope_sin, rope_cos, state_block_table, cu_seqlens, seqused,
           start_pos, rope_head_dim, cmp_ratio, coff, rotary_mode, cache_mode)
    m, d, bs = cmp_ratio, norm_weight.shape[0], state_cache.shape[1]
    c = coff * d
    cu, starts = cu_seqlens.tolist(), start_pos.tolist()
    lens = [z - a for a, z in zip(cu, cu[1:])]
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens, dtype=torch.int64))
    pos = torch.tensor([s + i for s, n in zip(starts, lens) for i in range(n)], dtype=torch.int64)
    table = state_block_table.to(torch.int64)
    last = max((s + n - 1 for s, n in zip(starts, lens) if n), default=-1)
    need(last // bs < table.shape[1], f"{OP}: state_block_table has {table.shape[1]} blocks a sequence, positions "
         f"reach {last} (block size {bs})")
    a = matmul(x.float(), wkv.float().t())                                     # [T, C] fp32 accumulation
    z = matmul(x.float(), wgate.float().t()) + ape.index_select(0, pos % m)
    block, row = table[seq, pos // bs], pos % bs
    kept = block != 0                                                          # writes to block 0 are skipped
    state_cache[block[kept], row[kept]] = torch.cat((a, z), dim=-1)[kept]

    done = [(k, e) for k, (s, n) in enumerate(zip(starts, lens)) for e in range(s // m, (s + n) // m)]
    out = x.new_zeros((rope_sin.shape[0], d))
    need(len(done) <= out.shape[0], f"{OP}: {len(done)} entries complete but cmp_kv has {out.shape[0]} rows")
    if not done:
        return out
    span = coff * m
    ks = torch.tensor([k for k, _ in done])
    q = torch.tensor([e for _, e in done])[:, None] * m - (span - m) + torch.arange(span)       # [K, span] positions
    kk = ks[:, None].expand_as(q)
    start = torch.tensor(starts, dtype=torch.int64)[kk]
    fed = q >= start                                                            # this step's rows: its projections
    step_row = torch.tensor(cu[:-1], dtype=torch.int64)[kk] + (q - start)
    old = state_cache[table[kk, q.clamp(min=0) // bs], q.clamp(min=0) % bs]   # [K, span, 2C] read after the writes
    new = torch.cat((a, z), dim=-1)[step_row.clamp(0, a.shape[0] - 1)]
    rows = torch.where(fed[..., None], new, old)
    kv, score = rows[..., :c], rows[..., c:]
    if coff == 2:       # window e-1 contributes its left half, window e its right half
        kv = torch.cat((kv[:, :m, :d], kv[:, m:, d:]), dim=1)
        score = torch.cat((score[:, :m, :d], score[:, m:, d:]), dim=1)
    valid = (q >= 0)[..., None]
    weights = torch.softmax(torch.where(valid, score, SCORE_FLOOR), dim=1)
    pooled = (weights * torch.where(valid, kv, 0.0)).sum(dim=1)                # [K, D] fp32
    normed = pooled * torch.rsqrt(pooled.square().mean(-1, keepdim=True) + norm_eps) * norm_weight.float()
    k = len(done)
    cos, sin = rope_cos[:k].float(), rope_sin[:k].float()
    tail = normed[:, d - rope_head_dim:]
    swapped = torch.stack((-tail[:, 1::2], tail[:, 0::2]), dim=-1).flatten(-2)    # (a, b) -> (-b, a)
    out[:k] = torch.cat((normed[:, : d - rope_head_dim], tail * cos + swapped * sin), dim=-1).to(x.dtype)
    return out
