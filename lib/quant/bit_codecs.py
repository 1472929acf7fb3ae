"""Bit-exact codecs for the checkpoint's number formats: E4M3, E8M0, E2M1 (FP4) and their
FP8-block / FP4-expert weight layouts (DSV4-REFERENCE §4.2-4.3).
Pure torch on CPU or any device; decoders are shift/mask arithmetic on integer tensors (L14) and
bytes are only ever reinterpreted with `.view`, never value-converted (B04).
Must not know tensor names, the model graph, sharding or any backend.
"""
from __future__ import annotations

import math
import struct

import torch
import torch.nn.functional as F

E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                                  -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E4M3_MAX = 448.0
E2M1_MAX = 6.0

_F32_NAN_BITS = 0x7FC00000
_F32_MIN_NORMAL_EXP = -126  # smallest scale the quantisers emit (see e8m0_scale_for)
_RAW_DTYPES = frozenset({torch.uint8, torch.int8})  # immutable; raw bytes from any loader


def _bits(t: torch.Tensor, fmt_dtype: torch.dtype | None, what: str) -> torch.Tensor:
    # Raw uint8/int8 bytes are accepted everywhere; a float8 tensor only by the codec of its own
    # format, so a scale passed where a weight belongs (or vice versa) fails loudly.
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}: expected a torch.Tensor, found {type(t).__name__}")
    allowed = _RAW_DTYPES | ({fmt_dtype} if fmt_dtype is not None else set())
    if t.dtype not in allowed:
        names = sorted(str(d) for d in allowed)
        raise TypeError(f"{what}: expected dtype in {names}, found {t.dtype}")
    return t.view(torch.uint8)  # reinterpretation only (B04)


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """View float8/int8/uint8 storage as uint8 bits. Never `.to()`: that converts values (B04)."""
    byte_dtypes = {torch.float8_e4m3fn, torch.float8_e8m0fnu}
    if hasattr(torch, "float4_e2m1fn_x2"):  # convert.py views packed experts this way
        byte_dtypes.add(torch.float4_e2m1fn_x2)
    if not isinstance(t, torch.Tensor) or t.dtype not in byte_dtypes | _RAW_DTYPES:
        raise TypeError(f"as_bits: expected a 1-byte tensor, found {getattr(t, 'dtype', type(t))}")
    return t.view(torch.uint8)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """Exact 2**k as float32 for int32 k in [-127, 127], built from exponent bits (no pow/exp)."""
    # 2**-127 is an fp32 subnormal: mantissa bit 22 alone, exponent field 0.
    bits = torch.where(k > -127, (k + 127) << 23, torch.full_like(k, 1 << 22))
    return bits.view(torch.float32)


def _f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) for finite float32 a >= 2**-126, read from the exponent field; int32."""
    return (a.view(torch.int32) >> 23) - 127


# ---------------------------------------------------------------- E4M3 (s|eeee|mmm, bias 7)

def e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    """All 256 codes -> float32; e=0 subnormals m/8 * 2**-6; 0x7F/0xFF NaN (no infinities)."""
    b = _bits(bits, torch.float8_e4m3fn, "e4m3_decode").to(torch.int32)
    e, m = (b >> 3) & 0xF, b & 0x7
    # value = mant * 2**(max(e,1) - 10) with the implicit 8 only for normals
    mant = torch.where(e > 0, m + 8, m).to(torch.float32)
    v = mant * _pow2(torch.clamp(e, min=1) - 10)
    v = torch.where((b >> 7) == 1, -v, v)  # keeps -0.0 for 0x80
    nan = torch.full_like(b, _F32_NAN_BITS).view(torch.float32)
    return torch.where((b & 0x7F) == 0x7F, nan, v)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> E4M3 bits (uint8), round-to-nearest-even, sign kept (-0.0 -> 0x80), NaN -> 0x7F.

    |x| > 448 saturates to ±448: the quantisers pick scales so that |x/s| <= 448 and this never
    triggers; if it does, saturation is a bounded error while NaN would poison every matmul.
    """
    x = x.to(torch.float32)
    nan = torch.isnan(x)
    a = torch.where(nan, torch.zeros_like(x), x.abs().clamp(max=E4M3_MAX))
    # Exponent of the quantum: values below 2**-6 share the subnormal quantum 2**-9.
    e = torch.clamp(_floor_log2(a.clamp(min=2.0 ** -126)), min=-6)
    q = torch.round(a * _pow2(3 - e)).to(torch.int32)  # torch.round is half-to-even; q in 0..16
    # (e+6)*8 + q works for normals (q = 8+m), subnormals (e=-6, q = m) and carries q=16 into
    # the next exponent; the clamp at 448 keeps it <= 0x7E.
    code = (e + 6) * 8 + q
    code = code | (torch.signbit(x).to(torch.int32) << 7)
    return torch.where(nan, torch.full_like(code, 0x7F), code).to(torch.uint8)


# ---------------------------------------------------------------- E8M0 (exponent only, bias 127)

def e8m0_decode(bits: torch.Tensor) -> torch.Tensor:
    """Byte b -> 2**(b-127) as float32; b=0 -> 2**-127 (fp32 subnormal, exact); b=255 -> NaN."""
    b = _bits(bits, torch.float8_e8m0fnu, "e8m0_decode").to(torch.int32)
    v = _pow2(b - 127)
    nan = torch.full_like(b, _F32_NAN_BITS).view(torch.float32)
    return torch.where(b == 255, nan, v)


def e8m0_encode(x: torch.Tensor) -> torch.Tensor:
    """Exact positive power of two in [2**-127, 2**127] -> byte; anything else raises ValueError."""
    x = torch.as_tensor(x)
    x32 = x.to(torch.float32)
    u = x32.view(torch.int32)
    exp_field, frac = (u >> 23) & 0xFF, u & 0x7FFFFF
    normal_pow2 = (u >= 0) & (frac == 0) & (exp_field >= 1) & (exp_field <= 254)
    ok = (normal_pow2 | (u == (1 << 22))) & (x32.to(x.dtype) == x)  # 2**-127; no float64 rounding
    if not bool(ok.all()):
        bad = x.flatten()[(~ok).flatten()][0].item()
        raise ValueError(f"e8m0_encode: {bad!r} is not a power of two in [2**-127, 2**127]")
    return torch.where(u == (1 << 22), torch.zeros_like(u), exp_field).to(torch.uint8)


def e8m0_scale_for(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest power of two s with amax/s <= qmax, i.e. 2**ceil(log2(amax/qmax)), as E8M0 bytes.

    Floored at 2**-126, as the official indexer rule 2**ceil(log2(max(amax, qmax*2**-126)/qmax)):
    amax == 0 gives 2**-126, the smallest scale that is a normal fp32, so backends that flush
    subnormals never see a zero scale (0/0 on requantisation). Computed from exponent and
    mantissa fields, never from a rounded float log2.
    """
    if not (math.isfinite(qmax) and qmax >= 1.0 and float(torch.tensor(qmax)) == qmax):
        raise ValueError(f"e8m0_scale_for: qmax must be a float32-exact value >= 1, found {qmax!r}")
    a = amax.to(torch.float32)
    bad = ~torch.isfinite(a) | (a < 0)
    if bool(bad.any()):
        found = a[bad][0].item()
        raise ValueError(f"e8m0_scale_for: amax must be finite and >= 0, found {found!r}")
    # A float64 amax that float32 rounded down would get too small a scale: step up one ulp.
    a = torch.where(a.to(amax.dtype) < amax, torch.nextafter(a, torch.full_like(a, math.inf)), a)
    a = torch.clamp(a, min=qmax * 2.0 ** _F32_MIN_NORMAL_EXP)  # qmax >= 1 keeps this normal
    u, uq = a.view(torch.int32), _f32_bits(qmax)
    # a = 1.fa * 2**ea, qmax = 1.fq * 2**eq: log2(a/qmax) lies in (ea-eq-1, ea-eq+1), and its
    # ceiling is ea-eq exactly when 1.fa <= 1.fq.
    k = ((u >> 23) - (uq >> 23)) + ((u & 0x7FFFFF) > (uq & 0x7FFFFF)).to(torch.int32)
    if bool((k > 127).any()):
        found = a[k > 127][0].item()
        raise ValueError(f"e8m0_scale_for: amax {found!r} / {qmax} needs a scale above 2**127")
    return (k + 127).to(torch.uint8)


# ---------------------------------------------------------------- E2M1 (s|ee|m, bias 1)

def _e2m1_value(c: torch.Tensor) -> torch.Tensor:
    c = c.to(torch.int32)
    e, m = (c >> 1) & 0x3, c & 0x1
    mant = torch.where(e > 0, m + 2, m).to(torch.float32)
    v = mant * _pow2(torch.clamp(e, min=1) - 2)
    return torch.where(((c >> 3) & 1) == 1, -v, v)  # bit 3 is the sign (B02)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes 0..15 (one per byte) -> float32; codes 8..15 are negative (B02)."""
    c = _bits(codes, None, "e2m1_decode")
    if bool((c > 15).any()):  # a packed byte here means a missing unpack (B01)
        raise ValueError(f"e2m1_decode: codes must be 0..15, found {int(c.max())}")
    return _e2m1_value(c)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float -> nearest E2M1 code (uint8), ties to even mantissa, |x| > 6 saturates to ±6.

    Sign is kept like IEEE casts and e4m3_encode: -0.0 and small negatives that round to zero give
    code 8 (-0), so encode(decode(c)) == c for all 16 codes. NaN has no code and raises.
    """
    x = x.to(torch.float32)
    if bool(torch.isnan(x).any()):
        raise ValueError("e2m1_encode: NaN has no E2M1 code")
    a = x.abs().clamp(max=E2M1_MAX)
    e = torch.clamp(_floor_log2(a.clamp(min=2.0 ** -126)), min=0)  # below 1: quantum 0.5
    q = torch.round(a * _pow2(1 - e)).to(torch.int32)  # half-to-even; parity of q = mantissa bit
    code = e * 2 + q  # same carry trick as e4m3_encode; q=4 rolls into the next exponent
    return (code | (torch.signbit(x).to(torch.int32) << 3)).to(torch.uint8)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2k] codes -> [..., k] int8; element 2j in the LOW nibble, 2j+1 in the HIGH (B01)."""
    c = _bits(codes, None, "pack_e2m1")
    if c.shape[-1] % 2:
        raise ValueError(f"pack_e2m1: last dim must be even, found shape {tuple(c.shape)}")
    if bool((c > 15).any()):
        raise ValueError(f"pack_e2m1: codes must be 0..15, found {int(c.max())}")
    return (c[..., 0::2] | (c[..., 1::2] << 4)).view(torch.int8)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., k] int8/uint8 -> [..., 2k] uint8 codes, byte-interleaved [lo, hi] (B01)."""
    b = as_bits(packed)  # viewing int8 as uint8 first avoids sign-extending the high nibble
    lohi = torch.stack((b & 0xF, b >> 4), dim=-1)  # [..., k, 2]
    return lohi.reshape(*b.shape[:-1], 2 * b.shape[-1])


# ---------------------------------------------------------------- weight layouts

def _check_shape(what: str, found: torch.Size, expected: tuple[int, ...], why: str) -> None:
    if tuple(found) != expected:
        raise ValueError(f"{what}: expected shape {expected} ({why}), found {tuple(found)}")


def dequant_fp8_block(weight: torch.Tensor, scale: torch.Tensor,
                      block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """W[i,j] = e4m3(W_q[i,j]) * 2**(scale[i//bo, j//bi] - 127); partial last blocks allowed."""
    if weight.dim() != 2:
        raise ValueError(f"dequant_fp8_block: weight must be 2-D [out, in], "
                         f"found {tuple(weight.shape)}")
    (out, inn), (bo, bi) = weight.shape, block
    nbo, nbi = -(-out // bo), -(-inn // bi)
    _check_shape("dequant_fp8_block scale", scale.shape, (nbo, nbi),
                 f"ceil(out/{bo}) x ceil(in/{bi}) for weight {tuple(weight.shape)}")
    w = e4m3_decode(_bits(weight, torch.float8_e4m3fn, "dequant_fp8_block weight"))  # [out, in]
    s = e8m0_decode(_bits(scale, torch.float8_e8m0fnu, "dequant_fp8_block scale"))  # [nbo, nbi]
    # Pad to whole blocks and broadcast the scale, rather than gathering it per element (L14).
    w = F.pad(w, (0, nbi * bi - inn, 0, nbo * bo - out)).view(nbo, bo, nbi, bi)
    return (w * s.view(nbo, 1, nbi, 1)).reshape(nbo * bo, nbi * bi)[:out, :inn].contiguous()


def dequant_fp4_expert(weight: torch.Tensor, scale: torch.Tensor, group: int = 32) -> torch.Tensor:
    """W[i,j] = e2m1(nibble(i,j)) * 2**(scale[i, j//group] - 127); weight int8 [out, in/2]."""
    if weight.dim() != 2:
        raise ValueError(f"dequant_fp4_expert: weight must be 2-D [out, in/2], "
                         f"found {tuple(weight.shape)}")
    out, inn = weight.shape[0], 2 * weight.shape[1]
    if inn % group:
        raise ValueError(f"dequant_fp4_expert: in={inn} is not a multiple of group={group}")
    _check_shape("dequant_fp4_expert scale", scale.shape, (out, inn // group),
                 f"[out, in/{group}] for packed weight {tuple(weight.shape)}")
    codes = unpack_e2m1(_bits(weight, None, "dequant_fp4_expert weight"))  # [out, in]
    s = e8m0_decode(_bits(scale, torch.float8_e8m0fnu, "dequant_fp4_expert scale"))  # [out, in/g]
    w = _e2m1_value(codes).view(out, inn // group, group)
    return (w * s.unsqueeze(-1)).reshape(out, inn)


def quant_fp8_block(w: torch.Tensor, block: tuple[int, int] = (128, 128)
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (float8_e4m3fn [out, in], float8_e8m0fnu [ceil(out/bo), ceil(in/bi)]).

    Power-of-two scales make w/s exact, so dequant(quant(w)) == w for representable w.
    """
    if w.dim() != 2:
        raise ValueError(f"quant_fp8_block: w must be 2-D [out, in], found {tuple(w.shape)}")
    (out, inn), (bo, bi) = w.shape, block
    nbo, nbi = -(-out // bo), -(-inn // bi)
    # Zero padding cannot raise a block's amax.
    wp = F.pad(w.to(torch.float32), (0, nbi * bi - inn, 0, nbo * bo - out)).view(nbo, bo, nbi, bi)
    sb = e8m0_scale_for(wp.abs().amax(dim=(1, 3)), E4M3_MAX)  # [nbo, nbi]
    q = e4m3_encode(wp / e8m0_decode(sb).view(nbo, 1, nbi, 1))
    q = q.reshape(nbo * bo, nbi * bi)[:out, :inn].contiguous()
    return q.view(torch.float8_e4m3fn), sb.view(torch.float8_e8m0fnu)


def quant_fp4_expert(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (int8 [out, in/2], float8_e8m0fnu [out, in/group])."""
    if w.dim() != 2 or w.shape[1] % group or w.shape[1] % 2:
        raise ValueError(f"quant_fp4_expert: w must be [out, in] with in a multiple of {group} "
                         f"and even, found {tuple(w.shape)}")
    out, inn = w.shape
    wg = w.to(torch.float32).view(out, inn // group, group)
    sb = e8m0_scale_for(wg.abs().amax(dim=-1), E2M1_MAX)  # [out, in/group]
    # Divide by the dequantisation multiplier; multiplying here is the inverted-scale bug (B03).
    codes = e2m1_encode(wg / e8m0_decode(sb).unsqueeze(-1)).view(out, inn)
    return pack_e2m1(codes), sb.view(torch.float8_e8m0fnu)
