"""Reference decoding of a logical tensor from its stored parts to fp32 (or int64 for tables).

quant.yaml names one of these per storage format; each takes the parts by role (`data`, or
`weight` + `scale`, or ModelSlim's `weight` + `weight_scale` + `weight_offset` [+ `scale_bias`])
and the config. Backends with other runtime formats convert from the same
parts in their generated loaders; this is the meaning those conversions are tested against.
"""
from __future__ import annotations

import importlib

import torch

from lib.quant import bit_codecs as codecs
from lib.quant import int_codecs
from spec.config import ModelConfig


def decode_plain(parts: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    return parts["data"].float()


def decode_index(parts: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    return parts["data"].long()


def decode_fp8_block(parts: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    block = tuple(cfg.quantization_config.weight_block_size)
    return codecs.dequant_fp8_block(parts["weight"], parts["scale"], block=block)


def decode_fp8_row32(parts: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    # one scale per row per 32 channels: an FP8 block of 1 x 32 (V4.1's Engram tables)
    return codecs.dequant_fp8_block(parts["weight"], parts["scale"], block=(1, 32))


def decode_int8_row32(parts: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    # int8 values times an fp32 scale per row per 32 channels (the field's Engram tables)
    weight = parts["weight"]
    return (weight.float().unflatten(-1, (-1, 32)) * parts["scale"].float().unsqueeze(-1)).flatten(-2)


def decode_mxfp4(parts: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    return codecs.dequant_fp4_expert(parts["weight"], parts["scale"], group=32)


def decode_w8a8_dynamic(parts: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    return (parts["weight"].float() - parts["weight_offset"].float()) * parts["weight_scale"].float()


def decode_w4a8_dynamic(parts: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    q = int_codecs.unpack_int4_rows(parts["weight"])
    return (q.float() - parts["weight_offset"].float()) * parts["weight_scale"].float()


def resolve(ref: str):
    """'package.module:function' -> the function (spec files name implementations this way).

    Not cached: the attribute is looked up on every call, so a patched function (fault injection,
    tests) is seen exactly like a call through the module would see it."""
    module, _, name = ref.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ImportError(f"spec names implementation '{ref}', which does not exist: {err}") from None


def decode(format_name: str, parts: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    from spec.tables import load_quant
    return resolve(load_quant().formats[format_name].decode)(parts, cfg)


# Encoders: fp32 logical tensor -> stored parts. Used to write official-format checkpoints
# (make-tiny); each is the inverse of the decoder above on the values it produces.

def encode_bf16(x: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return {"data": x.to(torch.bfloat16)}


def encode_f32(x: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return {"data": x.to(torch.float32)}


def encode_i64(x: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return {"data": x.to(torch.int64)}


def encode_fp8_block(x: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    weight, scale = codecs.quant_fp8_block(x.float(), block=tuple(cfg.quantization_config.weight_block_size))
    return {"weight": weight, "scale": scale}


def encode_fp8_row32(x: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    weight, scale = codecs.quant_fp8_block(x.float(), block=(1, 32))
    return {"weight": weight, "scale": scale}


def encode_int8_row32(x: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    blocks = x.float().unflatten(-1, (-1, 32))
    scale = blocks.abs().amax(-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))          # an all-zero block: zeros, scale 0
    weight = torch.round(blocks / safe.unsqueeze(-1)).clamp(-127, 127).to(torch.int8).flatten(-2)
    return {"weight": weight, "scale": scale}


def encode_mxfp4(x: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    weight, scale = codecs.quant_fp4_expert(x.float(), group=32)
    return {"weight": weight, "scale": scale}


def encode_w8a8_dynamic(x: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    q, scale = int_codecs.quant_sym_rows(x.float())
    return {"weight": q, "weight_scale": scale[:, None], "weight_offset": torch.zeros_like(scale[:, None])}


def _encode_w4a8(x: torch.Tensor, chunks: int) -> dict[str, torch.Tensor]:
    q, scale = int_codecs.quant_sym_rows(x.float(), qmax=7)
    return {"weight": int_codecs.pack_int4_rows(q), "weight_scale": scale[:, None],
            "weight_offset": torch.zeros_like(scale[:, None]), "scale_bias": int_codecs.scale_bias(q, scale, chunks)}


def encode_w4a8_dynamic(x: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return _encode_w4a8(x, 1)


def encode_w4a8_dynamic_down(x: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return _encode_w4a8(x, 16)


def encode(format_name: str, x: torch.Tensor, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    from spec.tables import load_quant
    return resolve(load_quant().formats[format_name].encode)(x, cfg)
