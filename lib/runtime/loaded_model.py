"""Loading a checkpoint into a backend and stepping its generated forward over per-sequence state.

`load_model` opens and validates the checkpoint, converts weights with the backend's generated
loader and returns an immutable `Model`; `step` runs one batch (any mix of prefill chunks and
decode tokens) and returns logits with the sequences' new caches. Sampling and scheduling live
elsewhere; this module must not know about requests.
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lib.records.batch import Batch
from lib.weights.checkpoint import Checkpoint
from lib.distributed.process_group import SINGLE, Parallel, check_sizes
from lib.weights.params import LoadOptions
from lib.runtime.rope_tables import rope_tables
from lib.records.decode_state import LayerCache, SeqCache, empty_compressor
from spec.config import ModelConfig, RankConfig
from spec.profile import load_profile
from spec.schedule import backbone


class Model(NamedTuple):
    backend: str
    cfg: RankConfig                  # the model's config plus this rank's place in TP / EP
    params: Any                      # lib.weights.params.Params
    rope: dict[str, torch.Tensor]    # RoPE frequency tables by name
    forward: Any                     # the backend's generated `forward`
    root: Path
    state_dtype: torch.dtype         # dtype of KV windows and compressed entries (the compute dtype)
    module: Any = None               # the backend's generated model module (drafter programs live there)

    def new_cache(self) -> SeqCache:
        return new_cache(self.cfg, self.state_dtype)


def backend_module(backend: str, name: str):
    load_profile(backend)            # a clear error for an unknown backend name
    return importlib.import_module(f"backends.{backend}._generated.{name}")


def load_model(path: Path | str, backend: str = "cpu", progress: bool = False,
               options: LoadOptions = LoadOptions(), parallel: Parallel = SINGLE) -> Model:
    """Load for one rank: `parallel` (from lib.distributed.process_group.live, after the process group exists: L17)
    decides which slice of every TP-split tensor and which routed experts this process reads."""
    options = options._replace(backend=backend)
    ckpt = Checkpoint(path)
    if parallel.world > 1:
        check_sizes(ckpt.config, parallel.tp_size, parallel.ep_size)
        options = options._replace(tp_size=parallel.tp_size, tp_rank=parallel.tp_rank, ep_size=parallel.ep_size,
                                   ep_rank=parallel.ep_rank, ep_simulate=False, ep_group=parallel.ep_group,
                                   ep_dispatch=parallel.ep_dispatch)
    cfg = RankConfig.of(ckpt.config, tp_size=parallel.tp_size, tp_rank=parallel.tp_rank, ep_size=parallel.ep_size,
                        ep_rank=parallel.ep_rank, tp_group=parallel.tp_group, ep_group=parallel.ep_group)
    params = backend_module(backend, "loader").load(ckpt, progress=progress, options=options)
    module = backend_module(backend, "model")
    dtype = getattr(torch, load_profile(backend).compute_dtype)
    return Model(backend, cfg, params, rope_tables(ckpt.config), module.forward, Path(path), dtype, module)


def new_cache(cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> SeqCache:
    """The state of a sequence with no tokens yet; windows and entries in `dtype`, compressor
    buffers in fp32 (they feed a softmax)."""
    layers = []
    for layer in backbone(cfg):
        window = torch.zeros(0, cfg.head_dim, dtype=dtype)
        comp = index = None
        if layer.attention == "csa":
            comp = empty_compressor(2 * cfg.head_dim, cfg.head_dim, entry_dtype=dtype)
            index = empty_compressor(2 * cfg.index_head_dim, cfg.index_head_dim, entry_dtype=dtype)
        elif layer.attention == "hca":
            comp = empty_compressor(cfg.head_dim, cfg.head_dim, entry_dtype=dtype)
        layers.append(LayerCache(window, comp, index))
    return SeqCache(0, tuple(layers))


def _by_layer(caches: list[SeqCache], n_layers: int) -> tuple[LayerCache, ...]:
    """Per-sequence caches -> per-layer records whose fields are per-sequence lists."""
    out = []
    for i in range(n_layers):
        rows = [c.layers[i] for c in caches]
        comp = [r.comp for r in rows] if rows[0].comp is not None else None
        index = [r.index for r in rows] if rows[0].index is not None else None
        out.append(LayerCache([r.window for r in rows], comp, index))
    return tuple(out)


def _by_sequence(layers: tuple[LayerCache, ...], old: list[SeqCache], batch: Batch) -> list[SeqCache]:
    out = []
    for s, cache in enumerate(old):
        per_layer = tuple(LayerCache(lay.window[s], lay.comp[s] if lay.comp is not None else None,
                                     lay.index[s] if lay.index is not None else None) for lay in layers)
        out.append(SeqCache(cache.length + batch.seq_lens[s], per_layer))
    return out


def step(model: Model, batch: Batch, caches: list[SeqCache], *, with_hidden: bool = False):
    """One forward over a batch; caches[s] must hold exactly batch.starts[s] tokens.

    Returns (logits, new caches), plus main_hidden [T, k*d] (the DSpark context features of
    every row, None without a drafter) when `with_hidden`."""
    for s, cache in enumerate(caches):
        if cache.length != batch.starts[s]:
            raise ValueError(f"sequence {s}: cache holds {cache.length} tokens but the batch continues at "
                             f"position {batch.starts[s]}")
    with torch.inference_mode():
        logits, layers, hidden = model.forward(model.params, batch, _by_layer(caches, model.cfg.num_hidden_layers),
                                               model.cfg, model.rope)
    new = _by_sequence(layers, caches, batch)
    return (logits, new, hidden) if with_hidden else (logits, new)
