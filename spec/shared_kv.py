"""spec/shared_kv.yaml: DeepSeek-V4.1's decode-state formats and host-resident tables, as data.

The planner (lib/planner/shared_kv_layout.py, lib/planner/memory.py) sizes V4.1's KV cache and its
Engram tables from these expressions of config keys; this module only loads and checks them.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

import msgspec

from spec import expr
from spec.tables import shape_env
from spec.yamlio import SpecError, decode, load_yaml

PATH = Path(__file__).with_name("shared_kv.yaml")


class Entry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    doc: str
    bytes: str
    source: str


class Window(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    doc: str
    rows: str
    row_bytes: str
    source: str


class Compressor(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    doc: str
    min_ratio: int
    bytes: str
    source: str


class Rings(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    window: Window
    compressor: Compressor
    engram_ids: Entry


class Entries(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    main: Entry
    index: Entry


class Host(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    doc: str
    bytes: dict[str, str]
    placement: Literal["sharded_per_rank", "replicated_per_host"]
    source: str


class SharedKV(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    entries: Entries
    rings: Rings
    host: dict[str, Host]


@functools.lru_cache(maxsize=None)
def load_shared_kv(path: Path = PATH) -> SharedKV:
    data, lines = load_yaml(path)
    return decode(data, SharedKV, str(path), lines)


def size(text: str, cfg, **extra: int) -> int:
    """An expression of the config's integer keys (the tensor table's shape names) and `extra` (ratio, rows, cols)."""
    try:
        return expr.evaluate(text, {**shape_env(cfg, None), **extra})
    except expr.ExprError as err:
        raise SpecError(f"{PATH}: {err}") from None
