"""Loading a checkpoint into a backend: the immutable `Model` the runtime steps.

`load_model` opens and validates the checkpoint, converts weights with the backend's generated
loader and returns a `Model` carrying the generated forward, the profile facts and the decode-state
declaration; lib/runtime/paged_step.py steps it over a paged cache. Sampling and scheduling live
elsewhere; this module must not know about requests.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import msgspec
import torch

from lib.emulation.relaxed import widths_relaxed
from lib.weights.checkpoint import Checkpoint
from lib.distributed.process_group import SINGLE, Parallel, check_sizes
from lib.weights.params import LoadOptions
from lib.runtime.engram_ids import engram_hashing
from lib.runtime.rope_tables import rope_tables
from spec.config import RankConfig
from spec.yamlio import SpecError
from spec.fused import chosen
from spec.schedule import LayerInfo, drafter_kind


class BackendFacts(NamedTuple):
    """What the run path needs of a backend's profile, rendered into its generated package by
    `dsv4gen build` (backends/<name>/_generated/__init__.py): nothing at run time reads YAML."""
    compute_dtype: torch.dtype       # activations, KV windows and compressed entries
    block_tokens: int                # positions per physical block of the paged decode state
    logical_block_tokens: int        # positions per block-table entry the attention kernel reads (L19)
    ep_dispatch: str                 # default EP token exchange: "allgather" | "alltoall"
    fused: dict = {}                 # fused kernel name -> its shape limits (profile `fused`, spec/fused.py)
    ring_rows_multiple: int = 1      # ring pools get a multiple of this many rows (profile cache)


class Model(NamedTuple):
    backend: str
    cfg: RankConfig                  # the model's config plus this rank's place in TP / EP
    params: Any                      # lib.weights.params.Params (with the layer schedule)
    rope: dict[str, torch.Tensor]    # RoPE frequency tables by name
    forward: Any                     # the backend's generated `forward`
    root: Path
    facts: BackendFacts
    drafter_kind: str                # "dspark" | "mtp" | "none", from the checkpoint's schedule
    module: Any = None               # the backend's generated model module (drafter programs live there)
    state: tuple = ()                # the decode-state declaration (StateItem records, generated STATE)
    engram: Any = None               # V4.1's Engram hashing (lib/runtime/engram_ids.py); None without Engram layers

    @property
    def state_dtype(self) -> torch.dtype:
        return self.facts.compute_dtype

    @property
    def layers(self) -> tuple[LayerInfo, ...]:
        """The backbone schedule, derived once at load."""
        return self.params.backbone_layers

    @property
    def stages(self) -> tuple[LayerInfo, ...]:
        """The drafter stages' schedule (empty without a drafter)."""
        return self.params.drafter_layers


class Generated(NamedTuple):
    """A backend's generated package: the checked-in one, or a temporary rendering (conformance's
    injected field bugs, codegen.build.render_into)."""
    package: ModuleType              # the profile facts (COMPUTE_DTYPE, CACHE_*, EP_DISPATCH)
    model: ModuleType                # forward and the drafter programs
    loader: ModuleType               # load(ckpt, progress, options) -> Params

    @property
    def state(self) -> tuple:
        """The decode-state declaration rendered from spec/state.yaml (StateItem records)."""
        return self.package.STATE

    @property
    def facts(self) -> BackendFacts:
        p = self.package
        return BackendFacts(getattr(torch, p.COMPUTE_DTYPE), p.CACHE_BLOCK_TOKENS, p.CACHE_LOGICAL_BLOCK_TOKENS,
                            p.EP_DISPATCH, dict(p.FUSED), p.CACHE_RING_ROWS_MULTIPLE)


def generated(backend: str) -> Generated:
    """The backend's checked-in generated package; a clear error for an unknown backend."""
    package = f"backends.{backend}._generated"
    try:
        return Generated(*(importlib.import_module(m) for m in (package, f"{package}.model", f"{package}.loader")))
    except ModuleNotFoundError as err:
        if err.name not in (f"backends.{backend}", package):
            raise
        from spec.profile import backend_names

        raise ValueError(f"unknown backend '{backend}' (accepted: {', '.join(backend_names())})") from None


def generated_from(folder: Path, name: str) -> Generated:
    """Import a rendered folder (codegen.build.render_into) as the package `name`: its modules import
    only absolute names, so each file loads on its own."""
    def load(module_name: str, path: Path) -> ModuleType:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module          # importable by name (pickling, tracebacks)
        spec.loader.exec_module(module)
        return module
    folder = Path(folder)
    return Generated(load(name, folder / "__init__.py"), load(f"{name}.model", folder / "model.py"),
                     load(f"{name}.loader", folder / "loader.py"))


def backend_facts(backend: str) -> BackendFacts:
    return generated(backend).facts


def load_model(path: Path | str, backend: str = "cpu", progress: bool = False,
               options: LoadOptions = LoadOptions(), parallel: Parallel = SINGLE,
               code: Generated | None = None) -> Model:
    """Load for one rank: `parallel` (from lib.distributed.process_group.live, after the process group exists: L17)
    decides which slice of every TP-split tensor and which routed experts this process reads. `code`:
    the backend's generated package to run (default: the checked-in one)."""
    options = options._replace(backend=backend)
    code = code or generated(backend)
    facts = code.facts
    ckpt = Checkpoint(path)
    if parallel.world > 1:
        check_sizes(ckpt.config, parallel.tp_size, parallel.ep_size)
        options = options._replace(tp_size=parallel.tp_size, tp_rank=parallel.tp_rank, ep_size=parallel.ep_size,
                                   ep_rank=parallel.ep_rank, ep_simulate=False, ep_group=parallel.ep_group,
                                   ep_dispatch=parallel.ep_dispatch)
    cfg = RankConfig.of(ckpt.config, tp_size=parallel.tp_size, tp_rank=parallel.tp_rank, ep_size=parallel.ep_size,
                        ep_rank=parallel.ep_rank, tp_group=parallel.tp_group, ep_group=parallel.ep_group)
    # the fused kernels this rank's shapes meet; width limits yield only inside relaxed_widths() (the emulation)
    choose = options.faults.fused_choice or chosen
    cfg = msgspec.structs.replace(cfg, fused=choose(facts.fused, cfg, relax_widths=widths_relaxed()))
    params = code.loader.load(ckpt, progress=progress, options=options)
    forward = getattr(code.model, FORWARDS.get(ckpt.config.model_type, "forward"))
    hashing = engram_hashing(ckpt.config, Path(path))
    if hashing is not None and options.faults.engram_params is not None:
        hashing = hashing._replace(params=options.faults.engram_params(hashing.params))
    return Model(backend, cfg, params, rope_tables(ckpt.config), forward, Path(path), facts,
                 drafter_kind(ckpt.config), code.model, code.state, hashing)


# each model generation's generated forward (codegen/lower.py ENTRY_FUNCTIONS)
FORWARDS = {"deepseek_v4": "forward", "deepseek_v41": "forward_v41"}

