"""DeepSeek-V4.1's low-precision simulation of what its caches hold (V41-REFERENCE §3.9, from the official
`inference/model.py` and the independent ports of its `act_quant` / `fp4_act_quant`, code-index ids 70871433627,
70172717437, 70094490474).

V4.1 was trained with its cached KV quantised and dequantised in place (QAT), so the reference forward applies
the same rounding to each vector before it is cached or attended: the 512-channel window KV to FP8 E4M3 in
blocks of 32 with power-of-two scales, the indexer's queries and keys to FP4 E2M1 in blocks of 32 with
power-of-two (E8M0) scales, and the compressed main KV to FP4 E2M1 in blocks of 16 with E4M3 scales. Each
function returns the dequantised values in the input's dtype, computed in fp32; the last dim is split into
blocks. The rounding is the checkpoint codecs' (lib/quant/bit_codecs.py: round to nearest, ties to even),
computed on the values themselves (exponent fields and one round per value, no codes): the same numbers as
decode(encode(x)) (tests/quant/test_kv_simulation.py checks it on every binade), with no range check that
reads a value back, so the reference and every device backend run these very functions (a device's queue
never waits on the host here).
"""
from __future__ import annotations

import struct

import torch

from lib.quant.bit_codecs import E2M1_MAX, E4M3_MAX

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


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k as fp32 from the exponent field, int32 k in [-126, 127] (no pow, no exp: exact everywhere)."""
    return ((k + 127) << 23).view(torch.float32)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) of fp32 a >= 2**-126, read from the exponent field (int32)."""
    return (a.view(torch.int32) >> 23) - 127


def _round_to(a: torch.Tensor, mantissa_bits: int, min_exp: int) -> torch.Tensor:
    """Non-negative fp32 a (within the format's range) to the nearest value with `mantissa_bits` bits after the
    point and exponent >= min_exp (below it the subnormal quantum 2**(min_exp - mantissa_bits)), ties to even:
    E4M3 is (3, -6), E2M1 (1, 0). q = round(a / quantum) lies in 0 .. 2**(bits+1): exact in fp32."""
    e = _floor_log2(a.clamp(min=2.0 ** -126)).clamp(min=min_exp)
    return torch.round(a * _pow2(mantissa_bits - e)) * _pow2(e - mantissa_bits)   # torch.round: half to even


def _signed(rounded: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.copysign(rounded, x)                      # a negative that rounds to zero keeps its sign (-0.0)


def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """The smallest power of two s with amax / s <= qmax, 2**ceil(log2(amax / qmax)), floored at 2**-126
    (bit_codecs.e8m0_scale_for's rule, from the exponent and mantissa fields)."""
    a = amax.clamp(min=qmax * 2.0 ** -126)
    u, uq = a.view(torch.int32), struct.unpack("<i", struct.pack("<f", qmax))[0]
    k = ((u >> 23) - (uq >> 23)) + ((u & 0x7FFFFF) > (uq & 0x7FFFFF)).to(torch.int32)
    return _pow2(k)


def fp8_window(x: torch.Tensor) -> torch.Tensor:
    """Window KV (§3.3, §3.9): per 32 channels s = 2**ceil(log2(max(amax, 1e-4) / 448)),
    x -> s * e4m3(clamp(x / s, -448, 448)). The RoPE lanes are rounded like the rest."""
    b = _blocks(x, FP8_WINDOW_BLOCK, "fp8_window")
    s = _pow2_scale(b.abs().amax(-1, keepdim=True).clamp(min=FP8_WINDOW_FLOOR), E4M3_MAX)
    v = b / s
    return (_signed(_round_to(v.abs().clamp(max=E4M3_MAX), 3, -6), v) * s).flatten(-2).to(x.dtype)


def fp4_index(x: torch.Tensor) -> torch.Tensor:
    """Indexer queries and keys (§3.6, §3.9): per 32 channels s = 2**ceil(log2(max(amax, 6 * 2**-126) / 6)),
    x -> s * e2m1(clamp(x / s, -6, 6))."""
    b = _blocks(x, FP4_INDEX_BLOCK, "fp4_index")
    s = _pow2_scale(b.abs().amax(-1, keepdim=True), E2M1_MAX)
    v = b / s
    return (_signed(_round_to(v.abs().clamp(max=E2M1_MAX), 1, 0), v) * s).flatten(-2).to(x.dtype)


def fp4_main(x: torch.Tensor) -> torch.Tensor:
    """Compressed main KV (§3.5, §3.9): per 16 channels s = e4m3(max(amax, 6 * 2**-9) / 6) (an E4M3 value, not a
    power of two; no second-level scale), x -> s * e2m1(clamp(x / s, -6, 6)), after RoPE, every lane."""
    b = _blocks(x, FP4_MAIN_BLOCK, "fp4_main")
    amax = b.abs().amax(-1, keepdim=True).clamp(min=FP4_MAIN_FLOOR)
    s = _round_to((amax / E2M1_MAX).clamp(max=E4M3_MAX), 3, -6)     # the codec saturates at 448
    v = b / s
    return (_signed(_round_to(v.abs().clamp(max=E2M1_MAX), 1, 0), v) * s).flatten(-2).to(x.dtype)


SIMULATED = {"fp8_window": fp8_window, "fp4_index": fp4_index}     # the graph's simulate_format formats


def simulated(format: str):
    """The simulation the graph's `simulate_format` names."""
    if format not in SIMULATED:
        raise ValueError(f"simulate_format: unknown format {format!r} (accepted: {', '.join(SIMULATED)})")
    return SIMULATED[format]
