"""Reference of what a DeepSeek-V4.1 KV-source layer caches from one pooled latent (V41-REFERENCE §3.4-3.6, from
the official `inference/model.py` and NVIDIA's CSA2 parity tests, code-index ids 70871433627, 66524956617).

V4.1's compressor runs only on the KV-source layers (2, 8, 14, 20); every layer after one reads what it cached.
From each pooled group (ratio 2: the softmax-gated pair, no `ape`; ratio 1: the token's own projection) the layer
makes two rows: the main entry the sparse attention reads, RMS-normalised, rotated at the group's first position
j * r and FP4-simulated in blocks of 16 with E4M3 scales; and the indexer's key, projected from the same latent
*before* its rotation (W_k, then k_norm), rotated on its own trailing lanes at j * r and FP4-simulated in blocks
of 32 with power-of-two scales. V4 had a second compressor for the indexer; V4.1 has none.
"""
from __future__ import annotations

import torch

from backends.cpu.ops.basic import rms_norm, wide
from backends.cpu.ops.rope import rope
from lib.quant.kv_simulation import fp4_index, fp4_main


def latent_entries(pooled: torch.Tensor, norm: torch.Tensor, wk: torch.Tensor, k_norm: torch.Tensor, angles,
                   rope_dim: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """pooled [K, Dc] -> (main entries [K, Dc], index keys [K, Di]); wk [Di, Dc], k_norm [Di]; angles: the
    rotation at each group's first position (a StepRope of the entries, or a (cos, sin) pair [K, rope_dim/2])."""
    latent = rms_norm(pooled, norm, eps)                                               # pre-RoPE: what W_k reads
    projected = (latent.to(wide.dtype) @ wk.to(wide.dtype).t()).float()
    keys = fp4_index(rope(rms_norm(projected, k_norm, eps), angles, rope_dim))
    main = fp4_main(rope(latent, angles, rope_dim))
    return main, keys
