"""The decode-state declaration (spec/state.yaml): what each layer kind keeps between steps.

Loaded and checked here for `dsv4gen build`, which renders it into every backend's generated
package as Python (codegen/build.py); the run path reads that rendering, never this file.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

from spec import expr
from spec.config import ModelConfig
from spec.yamlio import load_yaml

STATE_FILE = Path(__file__).with_name("state.yaml")
KINDS = ("swa", "csa", "hca", "dspark", "csa2", "csa1")
LIFETIMES = ("sequence", "entry")
DTYPES = ("compute", "float32")
# names an expression may read beyond the config's integer fields
EXTRA_NAMES = ("ratio", "slack")


class Declared(NamedTuple):
    name: str                  # field of the layer's pools record ("window", "comp.kv", ...)
    kinds: tuple[str, ...]     # attention kinds that keep it
    lifetime: str              # "sequence" | "entry"
    rows: str | None           # ring rows (sequence lifetime), an expression
    dim: str                   # row width, an expression
    dtype: str                 # "compute" | "float32"
    why: str
    slot0_unused: bool = False  # (sequence lifetime) one more slot, slot 0, never read or written
    sources_only: bool = False  # kept only by the layers that make the compressed KV (LayerInfo.kv_source)


def _config_names() -> set[str]:
    return {f for f, t in ModelConfig.__annotations__.items() if str(t).split(" ")[0] in ("int", "int | None")}


def load_state(path: Path = STATE_FILE) -> tuple[Declared, ...]:
    """Every declared item, checked: known kinds / lifetimes / dtypes, expressions over config
    names, `ratio` and `slack`, rows exactly for sequence lifetime, no item declared twice."""
    raw = load_yaml(path)[0].get("state")
    if not isinstance(raw, list) or not raw:
        raise ValueError(f"{path}: expected a non-empty list under 'state'")
    known, seen, out = _config_names() | set(EXTRA_NAMES), set(), []
    for i, item in enumerate(raw):
        where = f"{path}: state[{i}] ({item.get('name', '?')})"
        missing = {"name", "kinds", "lifetime", "dim", "dtype", "why"} - set(item)
        if missing:
            raise ValueError(f"{where}: missing {', '.join(sorted(missing))}")
        unknown = set(item) - {"name", "kinds", "lifetime", "rows", "dim", "dtype", "why", "slot0_unused",
                               "sources_only"}
        if unknown:
            raise ValueError(f"{where}: unknown key {', '.join(sorted(unknown))}")
        spare, sources = item.get("slot0_unused", False), item.get("sources_only", False)
        if not isinstance(sources, bool):
            raise ValueError(f"{where}: sources_only is true or false")
        if not isinstance(spare, bool) or (spare and item["lifetime"] != "sequence"):
            raise ValueError(f"{where}: slot0_unused is true or false, and true only for sequence lifetime")
        bad = [k for k in item["kinds"] if k not in KINDS]
        if bad:
            raise ValueError(f"{where}: unknown layer kind '{bad[0]}' (accepted: {', '.join(KINDS)})")
        if item["lifetime"] not in LIFETIMES:
            raise ValueError(f"{where}: lifetime '{item['lifetime']}' is not one of {', '.join(LIFETIMES)}")
        if item["dtype"] not in DTYPES:
            raise ValueError(f"{where}: dtype '{item['dtype']}' is not one of {', '.join(DTYPES)}")
        rows = item.get("rows")
        if (rows is None) != (item["lifetime"] == "entry"):
            raise ValueError(f"{where}: 'rows' is given exactly for sequence lifetime")
        for field in ("dim",) + (("rows",) if rows is not None else ()):
            name = expr.unknown_name(item[field], known)
            if name is not None:
                raise ValueError(f"{where}: {field} '{item[field]}' reads unknown name '{name}'")
        for kind in item["kinds"]:
            if (item["name"], kind) in seen:
                raise ValueError(f"{where}: '{item['name']}' is declared twice for layer kind '{kind}'")
            seen.add((item["name"], kind))
        out.append(Declared(item["name"], tuple(item["kinds"]), item["lifetime"], None if rows is None else str(rows),
                            str(item["dim"]), item["dtype"], item["why"], spare, sources))
    return tuple(out)


def as_python(text: str) -> str:
    """An expression as the body of `lambda cfg, ratio, slack: ...`: config names read off `cfg`.
    The declaration's expressions use no division, so the arithmetic is Python's as written."""
    tree = ast.parse(ast.unparse(expr.parse(text)), mode="eval")
    if any(isinstance(n, ast.Div) for n in ast.walk(tree)):
        raise ValueError(f"state expression '{text}': use no '/' (ring rows and widths are whole numbers)")

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node):
            if node.id in EXTRA_NAMES or node.id == "cdiv":
                return node
            return ast.copy_location(ast.Attribute(ast.Name("cfg", ast.Load()), node.id, ast.Load()), node)

    return ast.unparse(Rename().visit(tree))
