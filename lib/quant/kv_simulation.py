"""DeepSeek-V4.1's low-precision simulation of what its caches hold (V41-REFERENCE §3.9, from the official
`inference/model.py` and the independent ports of its `act_quant` / `fp4_act_quant`, code-index ids 70871433627,
70172717437, 70094490474).

V4.1 was trained with its cached KV quantised and dequantised in place (QAT), so the reference forward applies
the same rounding to each vector before it is cached or attended: the 512-channel window KV to FP8 E4M3 in
blocks of 32 with power-of-two scales, the indexer's queries and keys to FP4 E2M1 in blocks of 32 with
power-of-two (E8M0) scales, and the compressed main KV to FP4 E2M1 in blocks of 16 with E4M3 scales. Each
function returns the dequantised values in the input's dtype, computed in fp32; the last dim is split into
blocks. The rounding itself is the checkpoint codecs' (lib/quant/bit_codecs.py: round to nearest, ties to even).
"""
from __future__ import annotations

import torch

from lib.quant.bit_codecs import E2M1_MAX, E4M3_MAX, e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, \
    e8m0_decode, e8m0_scale_for

FP8_WINDOW_BLOCK = 32        # window KV: FP8 E4M3, UE8M0 scale per 32 channels
FP8_WINDOW_FLOOR = 1e-4      # amax floor before the scale: an all-zero block gets 2**ceil(log2(1e-4 / 448))
FP4_INDEX_BLOCK = 32         # indexer q / k: FP4 E2M1, UE8M0 scale per 32 channels (floor 6 * 2**-126)
FP4_MAIN_BLOCK = 16          # compressed main KV: FP4 E2M1, E4M3 scale per 16 channels
FP4_MAIN_FLOOR = 6 * 2.0 ** -9   # amax floor: the smallest scale is then e4m3(2**-9), E4M3's smallest subnormal


def _blocks(x: torch.Tensor, block: int, what: str) -> torch.Tensor:
    """x [..., C] -> fp32 [..., C / block, block]."""
    if x.shape[-1] % block:
        raise ValueError(f"{what}: the last dim ({x.shape[-1]}) must be a multiple of the block ({block})")
    return x.float().unflatten(-1, (-1, block))


def fp8_window(x: torch.Tensor) -> torch.Tensor:
    """Window KV (§3.3, §3.9): per 32 channels s = 2**ceil(log2(max(amax, 1e-4) / 448)),
    x -> s * e4m3(clamp(x / s, -448, 448)). The RoPE lanes are rounded like the rest."""
    b = _blocks(x, FP8_WINDOW_BLOCK, "fp8_window")
    amax = b.abs().amax(-1, keepdim=True).clamp(min=FP8_WINDOW_FLOOR)
    s = e8m0_decode(e8m0_scale_for(amax, E4M3_MAX))
    q = e4m3_decode(e4m3_encode((b / s).clamp(-E4M3_MAX, E4M3_MAX)))
    return (q * s).flatten(-2).to(x.dtype)


def fp4_index(x: torch.Tensor) -> torch.Tensor:
    """Indexer queries and keys (§3.6, §3.9): per 32 channels s = 2**ceil(log2(max(amax, 6 * 2**-126) / 6)),
    x -> s * e2m1(clamp(x / s, -6, 6)) (the scale's floor is e8m0_scale_for's own)."""
    b = _blocks(x, FP4_INDEX_BLOCK, "fp4_index")
    s = e8m0_decode(e8m0_scale_for(b.abs().amax(-1, keepdim=True), E2M1_MAX))
    q = e2m1_decode(e2m1_encode((b / s).clamp(-E2M1_MAX, E2M1_MAX)))
    return (q * s).flatten(-2).to(x.dtype)


def fp4_main(x: torch.Tensor) -> torch.Tensor:
    """Compressed main KV (§3.5, §3.9): per 16 channels s = e4m3(max(amax, 6 * 2**-9) / 6) (an E4M3 value, not a
    power of two; no second-level scale), x -> s * e2m1(clamp(x / s, -6, 6)), after RoPE, every lane."""
    b = _blocks(x, FP4_MAIN_BLOCK, "fp4_main")
    amax = b.abs().amax(-1, keepdim=True).clamp(min=FP4_MAIN_FLOOR)
    s = e4m3_decode(e4m3_encode(amax / E2M1_MAX))
    q = e2m1_decode(e2m1_encode((b / s).clamp(-E2M1_MAX, E2M1_MAX)))
    return (q * s).flatten(-2).to(x.dtype)

