"""Runtime weight formats (the reference's dense fp32/fp64, the device backends' records), and the
converters spec/runtime.yaml names.

A converter takes (storage format, stored parts by role, config) and returns one logical tensor
in a runtime format: a plain tensor (dense fp16/bf16, int32 tables) or a record of tensors
(W8A8, packed MXFP4). Decoding always goes through lib.quant.bit_codecs' bit arithmetic (L14); this module
must not know which tensor or layer it converts.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from lib.quant import bit_codecs as codecs
from lib.quant import int_codecs

from lib.quant import reference_formats as formats
from spec.config import ModelConfig

FP16_MAX = 65504.0


class W8A8(NamedTuple):
    """Symmetric int8 weight, one scale per output row: W ~= qweight * scale[..., None]."""
    qweight: torch.Tensor   # [..., N, K] int8 in [-127, 127]
    scale: torch.Tensor     # [..., N] float32 dequantisation multiplier


class PackedFP4(NamedTuple):
    """MXFP4 experts exactly as stored: two E2M1 codes per byte (even element low, B01) + E8M0 bits."""
    weight: torch.Tensor    # [..., N, K/2] int8
    scale: torch.Tensor     # [..., N, K/32] uint8 exponent bits (never value-converted, B04)


def quantize_rows(w: torch.Tensor, qmax: int = 127) -> W8A8:
    """Per-output-row symmetric quantisation of w [..., N, K] (fp32) to int8 (round half to even)."""
    return W8A8(*int_codecs.quant_sym_rows(w, qmax))


def packed_fp4_to_w8a8(p: PackedFP4, quantize=quantize_rows) -> W8A8:
    """Decode stacked MXFP4 [..., N, K/2] and requantise to W8A8 rows (the 310P streaming path).
    `quantize` (like every requantising converter's) is a fault site conformance passes a field bug to."""
    lead, half = p.weight.shape[:-1], p.weight.shape[-1]
    w = codecs.dequant_fp4_expert(p.weight.reshape(-1, half), p.scale.reshape(-1, p.scale.shape[-1]))
    return quantize(w.reshape(*lead, half * 2))


def _checked_f16(x: torch.Tensor) -> torch.Tensor:
    big = x.abs().max() if x.numel() else torch.tensor(0.0)
    if big > FP16_MAX:
        raise ValueError(f"value {float(big)} does not fit fp16 (max {FP16_MAX}); this tensor cannot run in fp16")
    return x.to(torch.float16)


def to_dense_f16(storage: str, parts: dict, cfg: ModelConfig) -> torch.Tensor:
    return _checked_f16(formats.decode(storage, parts, cfg).float()).contiguous()


def to_dense_bf16(storage: str, parts: dict, cfg: ModelConfig) -> torch.Tensor:
    return formats.decode(storage, parts, cfg).float().to(torch.bfloat16).contiguous()


def to_index_i32(storage: str, parts: dict, cfg: ModelConfig) -> torch.Tensor:
    # int32 ids: int64 gathers fall back to the AI-CPU on 310P (L13)
    return formats.decode(storage, parts, cfg).to(torch.int32).contiguous()


def _symmetric(parts: dict) -> bool:
    return not bool(parts["weight_offset"].any())


def to_w8a8_row(storage: str, parts: dict, cfg: ModelConfig, quantize=quantize_rows) -> W8A8:
    """FP8 block or MXFP4 -> exact fp32 -> int8 per output row (L01: no FP8/FP4 execution); a ModelSlim
    W8A8_DYNAMIC weight is already that record and is taken as stored, without a pass through floats."""
    if storage == "w8a8_dynamic" and _symmetric(parts):
        return W8A8(parts["weight"].contiguous(), parts["weight_scale"].reshape(-1).float().contiguous())
    return quantize(formats.decode(storage, parts, cfg).float())


def to_w8a8_group(storage: str, parts: dict, cfg: ModelConfig, quantize=quantize_rows) -> W8A8:
    """wo_b [d, G*R] -> int8 [G, d, R] with one scale per (group, output row) [G, d], R = o_lora_rank.
    A TP rank holds whole groups, so its scales are the ones one process computes for those groups:
    per-row scales over a rank's columns would change the int8 weights with the TP size."""
    w = formats.decode(storage, parts, cfg).float()
    groups = w.shape[1] // cfg.o_lora_rank
    q = quantize(w.reshape(w.shape[0], groups, -1).transpose(0, 1))
    return W8A8(q.qweight.contiguous(), q.scale.contiguous())


def to_packed_fp4(storage: str, parts: dict, cfg: ModelConfig) -> PackedFP4:
    if storage != "mxfp4":
        raise ValueError(f"packed FP4 runtime format (expert mode streaming) needs MXFP4 storage, got '{storage}': "
                         f"hold these experts resident instead (--expert-mode resident)")
    return PackedFP4(parts["weight"].contiguous(), codecs.as_bits(parts["scale"]).contiguous())


class W4A8(NamedTuple):
    """Symmetric int4 weight per output channel, laid out for a grouped matmul x @ W:
    8 int4 per int32 along N (element 8j+i in bits 4i..4i+3, low nibble first)."""
    qweight: torch.Tensor   # [..., K, N/8] int32
    scale: torch.Tensor     # [..., N] float32


def to_w4a8_channel(storage: str, parts: dict, cfg: ModelConfig, quantize=quantize_rows) -> W4A8:
    """Any storage -> exact fp32 [N, K] -> int4 per output channel (scale amax/7), packed [K, N/8]."""
    from lib.emulation.int_numerics import pack_int4

    if storage in ("w4a8_dynamic", "w4a8_dynamic_down") and _symmetric(parts):
        # a ModelSlim W4A8_DYNAMIC weight: the same int4 codes and scales, repacked along K-major words
        q = W8A8(int_codecs.unpack_int4_rows(parts["weight"]), parts["weight_scale"].reshape(-1).float())
    else:
        q = quantize(formats.decode(storage, parts, cfg).float(), qmax=7)
    return W4A8(pack_int4(q.qweight.transpose(-1, -2).contiguous()), q.scale.contiguous())


# runtime formats held as records (what `dsv4gen convert` stores field by field)
FORMAT_RECORDS = {"w8a8_row": W8A8, "w8a8_group": W8A8, "mxfp4_packed": PackedFP4, "w4a8_channel": W4A8}


def to_dense_f32(storage: str, parts: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The reference's dense fp32 (the meaning every other converter is tested against)."""
    return formats.decode(storage, parts, cfg).float().contiguous()


def to_dense_f64(storage: str, parts: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The cpu reference's weights, held in fp64 so no op converts them per call."""
    return formats.decode(storage, parts, cfg).double().contiguous()


def to_index_i64(storage: str, parts: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    return formats.decode(storage, parts, cfg).long().contiguous()
