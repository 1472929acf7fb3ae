"""The runtime parameter tree, built from a checkpoint by a backend's generated loader.

`Params` holds runtime tensors under their official keys: model-level ones in `model`, each
block's in `layers` (backbone, schedule order) or `drafter` (stages) relative to its prefix.
Routed experts are stacked per block into `[E, rows, cols]` under the key without `{expert}.`.
Every logical tensor is read exactly once, and the ledger proves it (B06, B16).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from tqdm import tqdm

from lib.checkpoint import Checkpoint, LoadLedger
from lib.formats import resolve
from spec.tables import Logical


class Params(NamedTuple):
    model: dict[str, torch.Tensor]
    layers: tuple[dict[str, torch.Tensor], ...]
    drafter: tuple[dict[str, torch.Tensor], ...]


def runtime_key(logical: Logical) -> str:
    """Key inside its scope's dict: official key relative to the block, experts un-numbered."""
    return logical.entry.key.replace("{expert}.", "")


def load_params(ckpt: Checkpoint, converter_for: Callable[[Logical], str], progress: bool = False) -> Params:
    """Convert every logical tensor with the converter the backend's table names for it."""
    ledger = LoadLedger(ckpt.logical)
    model: dict[str, torch.Tensor] = {}
    blocks: dict[str, dict[str, object]] = {}
    expert_parts: dict[tuple[str, str], list[torch.Tensor]] = {}
    items = tqdm(ckpt.logical, desc="loading weights", unit="tensor", disable=not progress, leave=False)
    for t in items:
        value = resolve(converter_for(t))(t.format, ckpt.read_parts(t, ledger), ckpt.config)
        if t.layer is None:
            model[runtime_key(t)] = value
        elif t.expert is not None:
            expert_parts.setdefault((t.layer.prefix, runtime_key(t)), []).append(value)
        else:
            blocks.setdefault(t.layer.prefix, {})[runtime_key(t)] = value
    for (prefix, key), values in expert_parts.items():
        blocks.setdefault(prefix, {})[key] = torch.stack(values)   # [E, rows, cols], expert order
    ledger.check()
    n = ckpt.config.num_hidden_layers
    stages = len(ckpt.config.compress_ratios) - n
    layers = tuple(blocks.get(f"layers.{i}", {}) for i in range(n))
    drafter = tuple(blocks.get(f"mtp.{s}", {}) for s in range(stages))
    return Params(model, layers, drafter)
