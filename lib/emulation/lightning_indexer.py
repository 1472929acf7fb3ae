"""CPU kernel of torch_npu's `npu_lightning_indexer` (aclnnLightningIndexer; schema in
data/torch_npu-2.14.0-npu-op-schemas.txt), the DeepSeek sparse-attention indexer, as torch_npu documents
it (op-plugin docs/context/torch_npu-npu_lightning_indexer.md) and as the kernel copy vendored in
vllm-ascend 182b75ea84 computes it (csrc/attention/lightning_indexer: README.md, op_kernel/arch22):

* score[t, s] = sum_h weights[t, h] * relu(q[t, h] . k[s]) in fp32, no scale of its own;
* query TND [T, N1, D] with actual_seq_lengths_query cumulative (no leading 0: its length is B); key
  PA_BSND [blocks, bs, N2, D] through block_table [B, n], actual_seq_lengths_key per batch; query row
  i of batch b sits at p = S2_b - S1_b + i and, in sparse_mode 3, sees keys 0..p;
* -> int32 [T, N2, sparse_count]: key positions by score, highest first, equal scores lower position
  first, -1 trailing where fewer are visible; values only with return_value (else an empty tensor).

Limits as the documentation states them (N1 64, N2 1, D 128, block size a multiple of 16 up to 1024,
sparse_count 1..2048, one dtype for q, k and weights); widths yield to lib.emulation.relaxed.
"""
from __future__ import annotations

import torch

from lib.emulation.npu_ops import BF16, F16, I32, need
from lib.emulation.relaxed import widths_relaxed
from lib.emulation.sharedkv_attention import paged_block_ok

HEADS, HEAD_DIM, MAX_COUNT = 64, 128, 2048


def _check(query, key, weights, lengths_q, lengths_k, block_table, layouts, sparse_count, sparse_mode, value):
    op = "npu_lightning_indexer"
    need(layouts == ("TND", "PA_BSND"), f"{op}: layouts {layouts}; this emulation takes TND queries over PA_BSND keys")
    need(sparse_mode == 3, f"{op}: sparse_mode {sparse_mode}; the indexer runs right-down causal (3)")
    need(not value, f"{op}: return_value is a training option and not with PA_BSND keys")
    need(query.dtype in (BF16, F16) and key.dtype == weights.dtype == query.dtype,
         f"{op}: query, key and weights must share fp16 or bf16, found {query.dtype}, {key.dtype}, {weights.dtype}")
    need(query.dim() == 3 and key.dim() == 4 and key.shape[2] == 1 and key.shape[3] == query.shape[2],
         f"{op}: query [T, N1, D] and key [blocks, block_size, 1, D], found {tuple(query.shape)}, {tuple(key.shape)}")
    t, n1, d = query.shape
    need((n1 == HEADS and d == HEAD_DIM) or widths_relaxed(),
         f"{op}: {n1} heads of {d}; the kernel takes {HEADS} heads of {HEAD_DIM}")
    need(tuple(weights.shape) == (t, n1), f"{op}: weights must be [T, N1] = {(t, n1)}, found {tuple(weights.shape)}")
    need(paged_block_ok(key.shape[1]),
         f"{op}: key block size {key.shape[1]}; it must be a multiple of 16 and at most 1024")
    need(1 <= sparse_count <= MAX_COUNT, f"{op}: sparse_count {sparse_count} outside 1..{MAX_COUNT}")
    for name, x in (("actual_seq_lengths_query", lengths_q), ("actual_seq_lengths_key", lengths_k),
                    ("block_table", block_table)):
        need(x is not None and x.dtype == I32 and x.numel() > 0, f"{op}: {name} must be a non-empty int32 tensor")
    need(lengths_q.shape == lengths_k.shape and int(lengths_q[-1]) == t and block_table.shape[0] == lengths_q.shape[0],
         f"{op}: cumulative query lengths ending at T = {t}, one key length and one block-table row per batch")


def lightning_indexer(query, key, weights, *, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
                      layout_query, layout_key, sparse_count, sparse_mode, return_value):
    _check(query, key, weights, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
           (layout_query, layout_key), sparse_count, sparse_mode, return_value)
    t, _, d = query.shape
    ends = actual_seq_lengths_query.long()
    b = torch.bucketize(torch.arange(t), ends, right=True)                          # each row's batch
    starts = torch.cat((ends.new_zeros(1), ends[:-1]))
    s2 = actual_seq_lengths_key.long()[b]
    p = s2 - (ends[b] - starts[b]) + (torch.arange(t) - starts[b])                  # the row's position
    width = int(actual_seq_lengths_key.max())
    s = torch.arange(max(width, 1))
    bs = key.shape[1]
    col = (s // bs).clamp(max=block_table.shape[1] - 1)
    rows = block_table.long()[b][:, col].clamp(min=0) * bs + s % bs                  # [T, S]
    k = key.reshape(-1, d).index_select(0, rows.reshape(-1)).view(t, -1, d).float()
    dots = torch.relu(torch.bmm(query.float(), k.transpose(1, 2)))                  # [T, N1, S]
    scores = (weights.float()[:, :, None] * dots).sum(1)
    visible = (s[None, :] <= p[:, None]) & (s[None, :] < s2[:, None])
    scores = torch.where(visible, scores, float("-inf"))
    count = min(sparse_count, scores.shape[1])
    # highest score first, the lower position first among equal scores (a stable sort of the negated scores)
    order = torch.sort(-scores, dim=-1, stable=True).indices[:, :count]
    picked = torch.gather(visible, 1, order)
    out = torch.full((t, 1, sparse_count), -1, dtype=I32)
    out[:, 0, :count] = torch.where(picked, order, -1).to(I32)
    return out, query.new_empty(0)
