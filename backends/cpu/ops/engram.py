"""Reference Engram (V41-REFERENCE §4.5-4.7, from the official DeepSeek-V4.1 `inference/model.py` and
`inference/engram.py`, code-index ids 70871433627 and 71212907549; the gate's per-(token, stream) form as
torchtitan-npu's Engram tests write it, ids 69332611211 and 68299168060).

Before the blocks of `engram_layer_ids`, each token's 24 hash ids (lib/engram/hashing.py: orders 2-4 x 8
heads, offset into the layer's one table) pick 24 table rows of 256 channels; W_e maps their concatenation to
one key per residual stream and one value, and each stream adds the value times a gate that compares the
stream with its key. The hash ids depend only on token ids, so the host computes them and hands over only the
rows a step reads; the table itself stays in host memory (its FP8 bytes and per-32-channel E8M0 scales, as the
checkpoint stores them). Computed in fp64 like the other reference ops, returned fp32.
"""
from __future__ import annotations

import math

import torch

from backends.cpu.ops.basic import wide
from lib.weights.engram_table import EngramShard, layer_lookup

GATE_FLOOR = 1e-6     # |dot| is floored before the square root: a zero dot gives sigmoid(1e-3) (§4.6), never NaN


def engram_rows(ids: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """ids [T, C] int64 rows of the layer's table (C = 3 orders x heads) -> [T, C, E] fp32, each row its FP8
    values times its own scale per 32 channels (weight [rows, E] float8_e4m3fn, scale [rows, E/32] E8M0); only the
    T*C rows read are dequantised."""
    if ids.dtype != torch.int64 or ids.dim() != 2:
        raise ValueError(f"engram_rows: ids must be [T, columns] int64, found {tuple(ids.shape)} {ids.dtype}")
    return EngramShard(weight, scale, 0, weight.shape[0]).lookup(ids)      # the whole table as one shard


def engram_inject(x: torch.Tensor, rows: torch.Tensor, wkv: torch.Tensor, q_weight: torch.Tensor,
                  k_weight: torch.Tensor, eps: float, mask: torch.Tensor | None = None) -> torch.Tensor:
    """X [T, n, D] streams, rows [T, C, E] (engram_rows), wkv [(n+1)*D, C*E], q_weight / k_weight [n, D].

    kv = W_e . vec(rows); key_i = kv[i*D:(i+1)*D] (stream i), value = kv[n*D:(n+1)*D];
    dot_i = sum_d X_i,d w_i,d key_i,d * rsqrt(mean X_i^2 + eps) * rsqrt(mean key_i^2 + eps) / sqrt(D), with
    w_i = q_weight_i * k_weight_i; g_i = sigmoid(sign(dot_i) * sqrt(max(|dot_i|, 1e-6))); X_i + g_i * value.
    Each (token, stream) is normalised alone. `mask` [T] bool: False rows (image positions) get g = 0."""
    t, n, d = x.shape
    if wkv.shape[0] != (n + 1) * d or wkv.shape[1] != rows.shape[1] * rows.shape[2]:
        raise ValueError(f"engram_inject: wkv {tuple(wkv.shape)} does not map {rows.shape[1]} x {rows.shape[2]} "
                         f"row channels to {n} keys and a value of {d}")
    xw = x.to(wide.dtype)
    kv = rows.to(wide.dtype).flatten(1) @ wkv.to(wide.dtype).t()                  # [T, (n+1)*D]
    key, value = kv[:, : n * d].view(t, n, d), kv[:, n * d:]
    w = q_weight.to(wide.dtype) * k_weight.to(wide.dtype)                          # [n, D]
    rx = torch.rsqrt(xw.square().mean(-1) + eps)                                   # [T, n]
    rk = torch.rsqrt(key.square().mean(-1) + eps)
    dot = (xw * w * key).sum(-1) * rx * rk / math.sqrt(d)
    sign = torch.where(dot < 0, -1.0, 1.0).to(wide.dtype)                         # a zero dot counts as positive
    g = torch.sigmoid(sign * dot.abs().clamp(min=GATE_FLOOR).sqrt())               # [T, n]
    if mask is not None:
        g = g * mask.to(wide.dtype).unsqueeze(-1)
    return (xw + g.unsqueeze(-1) * value.unsqueeze(1)).float()


def engram_lookup(ids: torch.Tensor, table: EngramShard, *, layer_index: int, layer_ids, tables, shard: int,
                  shards: int) -> torch.Tensor:
    """The graph's `engram_lookup`: the rows this layer's column of the batch's hash ids [T, L, C] names -> [T, C, E]
    fp32 (lib/weights/engram_table.py layer_lookup: this rank's block of rows, zeros for the others')."""
    return layer_lookup(ids, table, layer_index=layer_index, layer_ids=layer_ids, tables=tables, shard=shard,
                        shards=shards)
