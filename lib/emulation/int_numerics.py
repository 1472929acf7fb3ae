"""Exact integer numerics of the emulated int8 / int4 kernels: the int32 accumulator, int8 saturation,
symmetric quantisation, and int4 values packed eight per int32 word (lowest nibble first, B01).
Must not know chips, ops or the model; holds no state.
"""
from __future__ import annotations

import sys

import torch

I8, I32, I64 = torch.int8, torch.int32, torch.int64


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ValueError(msg)


def int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Integer a [..., m, k] @ b [..., k, n] -> int32, wrapped to int32 like the device's int32 accumulator
    (exact for int8 unless k > 2**17).

    int8 operands multiply in fp64: every product (|p| <= 2**14) and partial sum (< k * 2**14 < 2**53) is an
    integer fp64 holds exactly, so the sum is exact in any order, and BLAS does it far faster than torch's int64
    kernel (which the per-row cost of a verify step would otherwise be dominated by). Other integer dtypes go
    through int64."""
    if a.dtype == I8 and b.dtype == I8:
        return torch.matmul(a.to(torch.float64), b.to(torch.float64)).to(I64).to(I32)
    return torch.matmul(a.to(I64), b.to(I64)).to(I32)


def saturate_int8(y: torch.Tensor) -> torch.Tensor:
    return torch.round(y).clamp(-128, 127).to(I8)


def quantize_symmetric(x: torch.Tensor, qmax: int, dims=(-1,), smooth=None):
    """s = amax|x * smooth| over `dims` / qmax (fp32, keepdim); q = round(x * smooth / s) clamped to
    [-qmax, qmax]. The clamp only catches fp32 rounding just above qmax (the row max maps to exactly qmax),
    so the result is symmetric. An all-zero row gets s = 0 and q = 0 (the emulation's choice)."""
    xf = x.float() if smooth is None else x.float() * smooth.float()
    s = xf.abs().amax(dim=dims, keepdim=True) / qmax
    q = torch.round(xf / torch.where(s == 0, torch.ones_like(s), s)).clamp(-qmax, qmax).to(I8)
    return q, s


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 values held in int8 [..., 8j] -> int32 [..., j]. Element 8j+i sits in bits 4i..4i+3 (lowest nibble
    first, the low-then-high order of lib/quant/bit_codecs.py, B01), as a two's-complement nibble."""
    _need(q.shape[-1] % 8 == 0, f"int4 packing needs a last dim divisible by 8, found {tuple(q.shape)}")
    _need(bool(((q >= -8) & (q <= 7)).all()), "int4 packing: values must lie in [-8, 7]")
    nib = (q.to(I64) & 0xF).reshape(*q.shape[:-1], -1, 8)
    word = (nib << torch.arange(0, 32, 4, dtype=I64)).sum(-1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(I32)


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: int32 [..., j] -> int8 [..., 8j] in [-8, 7]."""
    _need(p.dtype == I32, f"int4 unpacking expects int32 words, found {p.dtype}")
    if sys.byteorder == "little":   # byte i of a word holds nibbles 2i (low) and 2i+1 (high): no int64 shifts
        octets = p.contiguous().view(torch.uint8)                                  # [..., 4j]
        nib = torch.stack((octets & 0xF, octets >> 4), dim=-1).flatten(-2).to(I8)  # [..., 8j] in 0..15
        return (nib ^ 8) - 8                                                       # two's-complement nibble
    nib = ((p.to(I64) & 0xFFFFFFFF).unsqueeze(-1) >> torch.arange(0, 32, 4, dtype=I64)) & 0xF
    return torch.where(nib >= 8, nib - 16, nib).to(I8).flatten(-2)
