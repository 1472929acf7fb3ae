"""Lazy, validating reader of DeepSeek-V4 checkpoints: the official format (DSV4-REFERENCE §4) and
Ascend ModelSlim exports (lib/weights/msmodelslim.py says how those differ).

Opening a checkpoint reads `config.json`, the index and every shard's safetensors header (not the
data), and checks each tensor against the spec's tensor table: missing, unexpected, mis-shaped,
wrong-dtype and truncated tensors are reported with shard file, key, expected and found (B05,
B06). Tensors are then read on demand; `LoadLedger` proves every spec tensor was read exactly
once (B06, B16). This module knows the file format and the tensor table, not any backend.
"""
from __future__ import annotations

import json
import math
import struct
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from lib.weights import msmodelslim as modelslim
from lib.weights.tp_slices import TPSlice
from spec.config import ModelConfig, load_config_json
from spec.msmodelslim import load_msmodelslim, vocabulary_copies
from spec.tables import Logical, Stored, expand, load_quant
from spec.yamlio import SpecError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint does not match the spec; every line names the file and the key."""


class HeaderEntry(NamedTuple):
    shard: str
    dtype: str
    shape: tuple[int, ...]
    begin: int   # absolute byte offsets of the data in the shard file
    end: int


def read_header(path: Path) -> dict[str, HeaderEntry]:
    """Parse one safetensors header and check every tensor's bytes lie inside the file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path.name}: truncated shard ({size} bytes, no safetensors header)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointError(f"{path.name}: truncated shard (header says {n} bytes, file has {size - 8})")
        try:
            meta = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise CheckpointError(f"{path.name}: corrupt safetensors header: {err}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path.name}: corrupt safetensors header: expected a JSON object")
    nbytes = {k: v.bytes for k, v in load_quant().dtypes.items()}
    out: dict[str, HeaderEntry] = {}
    for key, info in meta.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = (8 + n + int(o) for o in info["data_offsets"])
            entry = HeaderEntry(path.name, str(info["dtype"]), tuple(int(d) for d in info["shape"]), begin, end)
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path.name}: {key}: corrupt safetensors header entry "
                                  f"({type(err).__name__}: {err})") from None
        if end > size:
            raise CheckpointError(f"{path.name}: {key}: truncated shard: tensor data ends at byte {end}, "
                                  f"file has {size} bytes")
        width = nbytes.get(entry.dtype)
        if width is not None and (end - begin) != width * math.prod(entry.shape):
            raise CheckpointError(f"{path.name}: {key}: header is inconsistent: {entry.dtype} "
                                  f"{list(entry.shape)} needs {width * math.prod(entry.shape)} bytes, "
                                  f"offsets span {end - begin}")
        out[key] = entry
    return out


def read_weight_map(root: Path, index_name: str = INDEX_NAME, single: str | None = SINGLE_NAME) -> dict[str, str]:
    """key -> shard file name, from the index `index_name` (or the single-file layout `single`)."""
    index = root / index_name
    if index.exists():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
            weight_map = data["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index_name}: not a safetensors index ({err})") from None
        missing = sorted({f for f in weight_map.values() if not (root / f).is_file()})
        if missing:
            keys = [k for k, f in weight_map.items() if f == missing[0]]
            raise CheckpointError(f"{index_name}: names shard {missing[0]} (for {len(keys)} tensors, e.g. "
                                  f"{keys[0]}), which does not exist in {root}")
        return dict(weight_map)
    if single is not None and (root / single).is_file():
        return {k: single for k in read_header(root / single)}
    raise CheckpointError(f"{root}: {index_name} not found" + (f", nor {single}" if single else ""))


class Checkpoint:
    """An opened, validated checkpoint. `read(key)` returns the stored tensor exactly as stored."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        if not self.root.is_dir():
            raise CheckpointError(f"{self.root}: checkpoint directory not found")
        # "official" (FP8 / FP4, DSV4-REFERENCE §4) or "msmodelslim" (W8A8 / W4A8, lib/weights/msmodelslim.py)
        self.layout = "msmodelslim" if modelslim.is_modelslim(self.root) else "official"
        replace = modelslim.config_replacements(self.root / "config.json") if self.layout == "msmodelslim" else None
        try:
            self.config, self.unknown_config_keys = load_config_json(self.root / "config.json", replace)
        except SpecError as err:   # a bad config.json is a broken checkpoint, like a bad shard
            raise CheckpointError(str(err)) from None
        self.logical: tuple[Logical, ...] = expand(self.config)
        problems: list[str] = []
        if self.layout == "msmodelslim":
            self.index_name = load_msmodelslim().files.index
            weight_map = read_weight_map(self.root, self.index_name, single=None)
            slim = modelslim.read_layout(self.root, weight_map, CheckpointError)
            self.quant_type = slim.model_quant_type
            self.logical, problems = modelslim.relabel(self.logical, slim, self.config)
        else:
            self.index_name, self.quant_type, weight_map = INDEX_NAME, "fp8", read_weight_map(self.root)
        self.expected: dict[str, Stored] = {p.key: p for t in self.logical for p in t.parts}
        # backbone key -> the key of its copy: the drafter vocabulary a V4.1 ModelSlim export carries (spec/msmodelslim.yaml)
        copies = vocabulary_copies(self.config) if self.layout == "msmodelslim" else {}
        self.copy_of: dict[str, str] = {source: copy for copy, source in copies.items()}
        for copy, source in copies.items():
            self.expected[copy] = self.expected[source]._replace(key=copy)
        self.headers: dict[str, HeaderEntry] = {}
        for shard in sorted(set(weight_map.values())):
            for key, entry in read_header(self.root / shard).items():
                if weight_map.get(key) == shard:
                    self.headers[key] = entry._replace(shard=shard)     # the index's name: a file may sit in a folder
        problems = self._problems(weight_map) + problems
        if problems:
            raise CheckpointError("\n".join(problems))
        self._handles: dict[str, object] = {}
        self.bytes_read = 0          # tensor bytes copied out of the shards so far (TP/EP loads read less)

    def _problems(self, weight_map: dict[str, str]) -> list[str]:
        out = []
        for key, exp in self.expected.items():
            if key not in weight_map:
                out.append(f"{self.index_name}: {key}: missing (expected {exp.dtype} {list(exp.shape)})")
                continue
            found = self.headers.get(key)
            if found is None:
                out.append(f"{weight_map[key]}: {key}: listed in the index but absent from the shard")
            elif found.dtype != exp.dtype or found.shape != exp.shape:
                out.append(f"{found.shard}: {key}: expected {exp.dtype} {list(exp.shape)}, "
                           f"found {found.dtype} {list(found.shape)}")
        for key in sorted(set(weight_map) - set(self.expected)):
            out.append(f"{weight_map[key]}: {key}: unexpected tensor (not in the spec's tensor table for this config)")
        return out

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The stored tensor, or only `index` of it: a TP rank reads its slice through safetensors'
        `get_slice`, so the bytes of other ranks' slices are never copied out of the file."""
        entry = self.headers[key]
        handle = self._handles.get(entry.shard)
        if handle is None:
            handle = self._handles[entry.shard] = safe_open(str(self.root / entry.shard), framework="pt")
        value = handle.get_tensor(key) if index is None else handle.get_slice(key)[index]
        self.bytes_read += value.numel() * value.element_size()
        return value

    def read_parts(self, logical: Logical, ledger: "LoadLedger | None" = None,
                   index: dict[str, TPSlice] | None = None) -> dict[str, torch.Tensor]:
        """The stored parts of one logical tensor by role (`data` or `weight` + `scale`); with `index`
        (lib.weights.tp_slices.part_index: role -> TPSlice) only those slices."""
        if ledger is not None:
            ledger.mark(logical)
        return {p.role: self.read(p.key, None if index is None else index[p.role].index()) for p in logical.parts}

    def total_bytes(self) -> int:
        return sum(e.end - e.begin for e in self.headers.values())


class LoadLedger:
    """Counts how often each logical tensor was read, so a loader can prove exactly-once (B06)."""

    def __init__(self, logical: tuple[Logical, ...]):
        self.expected = {t.key for t in logical}
        self.counts: Counter[str] = Counter()

    def mark(self, logical: Logical) -> None:
        self.counts[logical.key] += 1

    def check(self, allowed_unread: set[str] | frozenset[str] = frozenset(),
              other_ranks: set[str] | frozenset[str] = frozenset()) -> None:
        """Every expected tensor read once, except `allowed_unread` (may be unread) and `other_ranks`
        (another EP rank's experts: must be unread, or this rank holds experts it does not run)."""
        skip = set(allowed_unread) | set(other_ranks)
        never = sorted(self.expected - set(self.counts) - skip)
        twice = sorted(k for k, c in self.counts.items() if c > 1)
        stray = sorted(set(self.counts) & set(other_ranks))
        if never or twice or stray:
            lines = ([f"{k}: never loaded" for k in never[:20]] + [f"{k}: loaded {self.counts[k]} times" for k in twice[:20]]
                     + [f"{k}: loaded, but another EP rank holds it" for k in stray[:20]])
            raise CheckpointError("loader did not read every spec tensor exactly once:\n" + "\n".join(lines))


def stored_to_torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, load_quant().dtypes[name].torch)


def summary(cfg: ModelConfig) -> dict:
    """Counts and bytes of a checkpoint with this config, from the spec alone (the inventory)."""
    quant = load_quant()
    parts = [p for t in expand(cfg) for p in t.parts]

    def tally(items) -> dict:
        dtypes = Counter(p.dtype for p in items)
        return {"tensors": len(items),
                "bytes": sum(math.prod(p.shape) * quant.dtypes[p.dtype].bytes for p in items),
                "dtypes": dict(sorted(dtypes.items()))}

    return {"all": tally(parts), "mtp": tally([p for p in parts if p.key.startswith("mtp.")])}
