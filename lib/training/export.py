"""A trained model back into the official checkpoint format (FP8 block weights, MXFP4 experts, BF16 / F32 where the
spec stores them), through the same spec tensor table and codecs `make-tiny` writes with and the loader reads.

The reference backend holds each logical tensor as one float64 tensor under its official key relative to its block
(routed experts stacked in expert order; lib/weights/params.py), so each is found again by that key and encoded by
its storage format. Quantising is the only change: a reloaded checkpoint computes with the stored values, and
`dsv4gen train-tiny` evaluates that reloaded checkpoint, not the float weights it trained.
Must not know training.
"""
from __future__ import annotations

from pathlib import Path

import torch

from lib.quant import reference_formats as formats
from lib.text.tokenizer import Tokenizer
from lib.weights.checkpoint_writer import write_checkpoint
from lib.weights.params import runtime_key
from lib.weights.tiny_checkpoint import side_files
from spec.config import ModelConfig
from spec.tables import expand


def stored_tensors(params, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every stored tensor of the checkpoint `params` (a reference backend's Params) amounts to."""
    blocks = {info.prefix: block for info, block in zip(params.backbone_layers + params.drafter_layers,
                                                           params.layers + params.drafter)}
    out: dict[str, torch.Tensor] = {}
    for t in expand(cfg):
        scope = params.model if t.layer is None else blocks[t.layer.prefix]
        value = scope[runtime_key(t)]
        if t.expert is not None:
            value = value[t.expert]
        if tuple(value.shape) != t.shape:
            raise ValueError(f"{t.key}: the trained tensor has shape {tuple(value.shape)}, the spec says {t.shape}")
        stored = formats.encode(t.format, value.detach().float(), cfg)
        for part in t.parts:
            out[part.key] = stored[part.role]
    return out


def write_trained(out: Path, params, cfg: ModelConfig, tokenizer: Tokenizer, overwrite: bool = False) -> Path:
    """The official-format checkpoint folder of `params`, with config and tokenizer files; written to a temporary
    folder and moved into place (write_checkpoint), so an interrupted export leaves nothing half-written."""
    return write_checkpoint(out, stored_tensors(params, cfg), side_files(cfg, tokenizer.backend), shards=4,
                            overwrite=overwrite)
