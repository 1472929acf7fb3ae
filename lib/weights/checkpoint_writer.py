"""Writing official-format checkpoints: sharded safetensors + index + side files, atomically.

Everything is written into a temporary sibling folder and renamed into place at the end, so an
interrupted write never leaves a half-written checkpoint behind. Knows the file layout only.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from lib.weights.checkpoint import INDEX_NAME


def shard_names(n: int) -> list[str]:
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def split_shards(tensors: dict[str, torch.Tensor], n: int) -> list[list[str]]:
    """Up to n contiguous groups of keys (in the given order) of roughly equal bytes, none empty."""
    keys = list(tensors)
    n = max(1, min(n, len(keys)))
    sizes = [tensors[k].numel() * tensors[k].element_size() for k in keys]
    total = sum(sizes) or 1
    groups: list[list[str]] = [[] for _ in range(n)]
    acc = 0
    for key, size in zip(keys, sizes):
        groups[min(n - 1, acc * n // total)].append(key)
        acc += size
    return [g for g in groups if g]


def publish_dir(out: Path, write: Callable[[Path], None], overwrite: bool = False) -> Path:
    """Run `write(tmp)` into a temporary sibling folder, then move it into place as `out`;
    on any failure nothing is left behind and an existing `out` is untouched."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out}: already exists and is not empty (pass --force to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(tmp)
        _publish_modes(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def write_checkpoint(out: Path | str, tensors: dict[str, torch.Tensor], side_files: dict[str, str | bytes],
                     shards: int = 4, overwrite: bool = False) -> Path:
    """Write `tensors` as `shards` safetensors files + index, plus side files (config.json, ...)."""
    def write(tmp: Path) -> None:
        groups = split_shards(tensors, shards)
        weight_map = {}
        for name, keys in zip(shard_names(len(groups)), groups):
            save_file({k: tensors[k].contiguous() for k in keys}, str(tmp / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in keys})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        for name, content in side_files.items():
            mode = "wb" if isinstance(content, bytes) else "w"
            with open(tmp / name, mode, **({} if mode == "wb" else {"encoding": "utf-8"})) as f:
                f.write(content)

    return publish_dir(Path(out), write, overwrite)


def _publish_modes(folder: Path) -> None:
    """mkdtemp makes a 0700 folder: give the finished checkpoint the modes a plain mkdir/open would
    (umask applied), so a shared cache or a server running as another user can read it."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for path in folder.iterdir():
        os.chmod(path, 0o666 & ~umask)


def _replace_dir(src: Path, dst: Path) -> None:
    if dst.exists():
        trash = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.replace(dst, trash)
        os.replace(src, dst)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(src, dst)
