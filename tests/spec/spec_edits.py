"""Helpers of the pinned spec-error tests: copy a real spec file with one targeted edit, find a
snippet's line, take a SpecError's message."""

from pathlib import Path

import pytest

from spec.graph import load_graph
from spec.tables import load_tensor_table
from spec.yamlio import SpecError

ROOT = Path(__file__).resolve().parents[2]
TENSORS = ROOT / "spec" / "tensors.yaml"
QUANT = ROOT / "spec" / "quant.yaml"
GRAPH = ROOT / "spec" / "graph.yaml"
MODEL = ROOT / "spec" / "models" / "deepseek-v4-flash.yaml"
PROFILE = ROOT / "backends" / "cpu" / "profile.yaml"


def edit(src: Path, dest: Path, old: str, new: str) -> Path:
    """Copy `src` to `dest` with the one occurrence of `old` replaced by `new`."""
    text = src.read_text(encoding="utf-8")
    assert text.count(old) == 1, f"{old!r} must occur exactly once in {src.name}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text.replace(old, new), encoding="utf-8")
    return dest


def line(path: Path, snippet: str) -> int:
    """1-based line of the (unique) `snippet` in `path`."""
    text = path.read_text(encoding="utf-8")
    assert text.count(snippet) == 1, f"{snippet!r} must occur exactly once in {path}"
    return text[: text.index(snippet)].count("\n") + 1


def error_of(fn, *args) -> str:
    with pytest.raises(SpecError) as info:
        fn(*args)
    return str(info.value)


def real_classes() -> str:
    return ", ".join(load_tensor_table().classes)


def real_ops() -> str:
    return ", ".join(sorted(load_graph().graph.ops))
