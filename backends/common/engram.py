"""DeepSeek-V4.1's Engram as device composites (V41-REFERENCE §4.5-4.7; the reference: backends/cpu/ops/engram.py).

The tables never reach the device: the field kept them in host memory (two ~98 GB int8 tables, seeds/002), and so
does the runtime (lib/weights/engram_table.py). The host gathers and dequantises the rows a step's hash ids name
(the ids are computed on the host from token ids: no device value is read) and the device receives them in one
copy; the injection is then a product and a handful of fp32 elementwise kernels over the residual streams.
"""
from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import _disable_current_modes

from backends.common import dense
from lib.emulation.invariant_matmul import matmul
from lib.weights.engram_table import EngramShard, layer_lookup

GATE_FLOOR = 1e-6     # |dot| floored before the square root (§4.6), as the reference


def engram_lookup(ids: torch.Tensor, table: EngramShard, *, layer_index: int, layer_ids, tables, shard: int,
                  shards: int) -> torch.Tensor:
    """ids [T, L, C] int64 (host), table: this rank's rows in host memory -> [T, C, E] fp32 rows, in host memory.

    Host work, so it runs out of sight of a dispatch mode (the capability guard counts device kernels): on a
    device the CPU does this gather while the device runs the layers before. The copy to the device is the
    injection's first kernel."""
    with torch._C.DisableTorchFunction(), _disable_current_modes():      # neither mode sees host work
        return layer_lookup(ids, table, layer_index=layer_index, layer_ids=layer_ids, tables=tables, shard=shard,
                            shards=shards)


def engram_inject(x, rows, wkv, q_weight, k_weight, eps: float, mask=None, *, rms=dense.rms) -> torch.Tensor:
    """X [T, n, D] streams, rows [T, C, E] (host) -> X + g * value per stream, in X's dtype (fp32 math).

    kv = W_e vec(rows) in the weight's dtype (one GEMM; the rows arrive in it: FP8 values under a power-of-two
    scale are exact in bf16); keys [T, n, D], value [T, D]; each (token, stream) RMS-normalised on its own
    (`rms`: the device's RMSNorm kernel over the stream and over its key), the dot with w = q_weight * k_weight
    (made once per weight) / sqrt(D), and the signed square-root gate."""
    t, n, d = x.shape
    if wkv.shape[0] != (n + 1) * d or wkv.shape[1] != rows.shape[1] * rows.shape[2]:
        raise ValueError(f"engram_inject: wkv {tuple(wkv.shape)} does not map {rows.shape[1]} x {rows.shape[2]} "
                         f"row channels to {n} keys and a value of {d}")
    kv = matmul(rows.to(device=wkv.device, dtype=wkv.dtype).flatten(1), wkv.t()).float()      # [T, (n+1)*D]
    key, value = kv[:, : n * d].view(t, n, d), kv[:, n * d:]
    w = dense.derived(q_weight, (k_weight,), lambda: (q_weight.float() * k_weight.float()) / math.sqrt(d))
    xn, kn = rms(x.float(), None, eps), rms(key, None, eps)                                   # fp32 [T, n, D]
    dot = (xn * kn * w).sum(-1)                                                                # [T, n]
    g = torch.sigmoid(torch.copysign(dot.abs().clamp(min=GATE_FLOOR).sqrt(), dot))
    if mask is not None:
        g = g * mask.float().unsqueeze(-1)
    return torch.addcmul(x.float(), g.unsqueeze(-1), value.unsqueeze(1)).to(x.dtype)
