"""Converters from stored parts to runtime formats (spec/runtime.yaml names them).

A converter takes (storage format name, parts by role, config) and returns the runtime value of
one logical tensor. It must not know which tensor or layer it converts: the profile decides that.
"""
from __future__ import annotations

import torch

from lib import formats
from spec.config import ModelConfig


def to_dense_f32(storage: str, parts: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    return formats.decode(storage, parts, cfg).float().contiguous()


def to_dense_f64(storage: str, parts: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    return formats.decode(storage, parts, cfg).double().contiguous()


def to_index_i64(storage: str, parts: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    return formats.decode(storage, parts, cfg).long().contiguous()
