"""Typed records for torch operator schema strings (`npu_rms_norm(Tensor input, ...) -> (Tensor, Tensor)`),
the loader for the recorded torch_npu 2.14.0 schemas, and `check_signature`, which compares a Python
shim's `inspect.signature` with a schema (names, order, `*` split, defaults).
Must not know any backend, device, op semantics or lesson; torch is imported only for live aten schemas.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "data"
SCHEMA_FILE = DATA / "torch_npu-2.14.0-npu-op-schemas.txt"
# vllm-ascend's DeepSeek-V4 custom ops (torch.ops._C_ascend), with the commit they were read from in its header
VLLM_ASCEND_FILE = DATA / "vllm_ascend-dsv4-op-schemas.txt"


class _NoDefault:
    """Sentinel for a parameter without a default (distinct from a default of None)."""
    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "<no default>"


NO_DEFAULT = _NoDefault()


class SchemaParseError(ValueError):
    """A schema line that does not parse; the message names the source (file:line) and the piece."""


@dataclass(frozen=True)
class SchemaType:
    text: str                   # as written, e.g. "Tensor(a!)", "int[]?", "SymInt[]", "bool[3]"
    base: str                   # "Tensor", "int", "SymInt", "ScalarType", ...
    optional: bool              # trailing "?" (of the whole type: "int[]?" is an optional list)
    is_list: bool               # "[]" or "[N]"
    list_size: int | None       # N of "[N]", None for "[]" or a scalar
    alias: str | None           # "a" of "(a!)" / "(a)"
    mutable: bool               # "!" in the alias annotation: the op writes this argument


@dataclass(frozen=True)
class Param:
    name: str
    type: SchemaType
    default: object             # parsed Python value (lists as tuples) or NO_DEFAULT
    kwarg_only: bool            # declared after the bare "*"


@dataclass(frozen=True)
class Return:
    type: SchemaType
    name: str | None            # "y" of "(Tensor y, Tensor scale)"


@dataclass(frozen=True)
class Schema:
    name: str                   # full name including the overload: "npu_apply_adam.out"
    params: tuple[Param, ...]
    returns: tuple[Return, ...]
    source: str                 # "file:line" (or "torch live") for error messages
    text: str

    @property
    def base_name(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def overload(self) -> str:
        return self.name.split(".", 1)[1] if "." in self.name else ""


_TYPE_RE = re.compile(r"^(?P<base>[A-Za-z_][A-Za-z0-9_]*)(?P<alias>\([a-z*]+!?\))?"
                      r"(?P<list>\[(?P<size>\d*)\])?(?P<opt>\?)?$")
_HEAD_RE = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*::)?(?P<name>[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)?)\(")


def _split_top(text: str, where: str) -> list[str]:
    """Split on commas outside brackets and quotes."""
    parts, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if depth or quote:
        raise SchemaParseError(f"{where}: unbalanced brackets or quotes in {text!r}")
    tail = "".join(cur).strip()
    return parts + [tail] if tail or parts else []


def parse_type(text: str, where: str = "<schema>") -> SchemaType:
    m = _TYPE_RE.match(text)
    if m is None:
        raise SchemaParseError(f"{where}: cannot parse type {text!r}")
    alias = m["alias"][1:-1] if m["alias"] else None
    return SchemaType(text=text, base=m["base"], optional=bool(m["opt"]), is_list=bool(m["list"]),
                      list_size=int(m["size"]) if m["size"] else None,
                      alias=alias.rstrip("!") if alias else None, mutable=bool(alias and alias.endswith("!")))


def parse_default(text: str, where: str = "<schema>") -> object:
    """Schema default literal -> Python value: None, bools, ints, floats, quoted strings, [lists] as tuples."""
    t = text.strip()
    if t == "None":
        return None
    if t in ("True", "False"):
        return t == "True"
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    if t.startswith("[") and t.endswith("]"):
        return tuple(parse_default(p, where) for p in _split_top(t[1:-1], where))
    try:
        return int(t)
    except ValueError:
        pass
    try:
        return float(t)  # "1.", "1e-06", "0.0"
    except ValueError:
        raise SchemaParseError(f"{where}: cannot parse default {text!r}") from None


def _parse_params(text: str, where: str) -> tuple[Param, ...]:
    params, kwarg_only, seen = [], False, set()
    for piece in _split_top(text, where):
        if piece == "*":
            kwarg_only = True
            continue
        decl, eq, default = piece.partition("=")
        bits = decl.split()
        if len(bits) != 2:
            raise SchemaParseError(f"{where}: expected 'TYPE NAME[=DEFAULT]', found {piece!r}")
        if bits[1] in seen:
            raise SchemaParseError(f"{where}: parameter {bits[1]!r} declared twice")
        seen.add(bits[1])
        params.append(Param(name=bits[1], type=parse_type(bits[0], where),
                            default=parse_default(default, where) if eq else NO_DEFAULT,
                            kwarg_only=kwarg_only))
    return tuple(params)


def _parse_returns(text: str, where: str) -> tuple[Return, ...]:
    t = text.strip()
    inner = t[1:-1] if t.startswith("(") and t.endswith(")") else t
    out = []
    for piece in _split_top(inner, where):
        bits = piece.split()
        if not 1 <= len(bits) <= 2:
            raise SchemaParseError(f"{where}: cannot parse return {piece!r}")
        out.append(Return(type=parse_type(bits[0], where), name=bits[1] if len(bits) == 2 else None))
    return tuple(out)


def parse_schema(line: str, source: str = "<schema>") -> Schema:
    """Parse one schema string; a leading `namespace::` (as in `aten::_int_mm`) is dropped."""
    text = line.strip()
    m = _HEAD_RE.match(text)
    arrow = text.rfind("->")
    if m is None or arrow < 0:
        raise SchemaParseError(f"{source}: expected 'name(params) -> returns', found {text!r}")
    head, ret = text[:arrow].rstrip(), text[arrow + 2:]
    if not head.endswith(")"):
        raise SchemaParseError(f"{source}: parameter list is not closed in {text!r}")
    params_text = head[head.index("(") + 1:-1]
    return Schema(name=m["name"], params=_parse_params(params_text, source),
                  returns=_parse_returns(ret, source), source=source, text=text)


def parse_schema_file(path: str | Path = SCHEMA_FILE) -> list[Schema]:
    """Every schema line of the file, in file order (duplicated names included); `#` lines are provenance."""
    path = Path(path)
    lines = path.read_text(encoding="utf-8").splitlines()
    return [parse_schema(line, f"{path.name}:{i}") for i, line in enumerate(lines, 1)
            if line.strip() and not line.startswith("#")]


def provenance(path: str | Path) -> list[str]:
    """The `#` lines of a schema file (where and from which version its schemas were read)."""
    return [line[1:].strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.startswith("#")]


def load_schemas(path: str | Path = SCHEMA_FILE) -> dict[str, Schema]:
    """name (with overload, e.g. "npu_format_cast_.acl_format"; the base name is the plain overload) -> Schema.
    A few names occur twice without an overload name (npu_moe_token_unpermute, npu_format_cast, npu_dtype_cast,
    ...); the later line wins: in this file it is the public Python-facing form (npu_moe_token_unpermute ->
    Tensor, npu_format_cast with customize_dtype). `parse_schema_file` keeps both."""
    return {s.name: s for s in parse_schema_file(path)}


def torch_schemas(qualified_name: str) -> dict[str, Schema]:
    """Live schemas of an aten op from the installed torch: "aten::_int_mm" -> {"_int_mm": .., "_int_mm.out": ..}."""
    import torch

    found = torch._C._jit_get_schemas_for_operator(qualified_name)
    if not found:
        raise KeyError(f"torch {torch.__version__} has no operator {qualified_name!r}")
    return {s.name: s for s in (parse_schema(str(f), f"torch {torch.__version__} live") for f in found)}


def aten_schema(name: str) -> Schema:
    """An aten op's schema as the installed torch declares it (`_int_mm`, `_fused_rms_norm`: hip936's device ops)."""
    return torch_schemas(f"aten::{name}")[name]


def _defaults_equal(schema_default: object, py_default: object) -> bool:
    if schema_default is None or py_default is None:
        return schema_default is None and py_default is None
    if isinstance(schema_default, bool) or isinstance(py_default, bool):
        return type(schema_default) is type(py_default) and schema_default == py_default
    if isinstance(schema_default, tuple):
        return isinstance(py_default, (list, tuple)) and len(py_default) == len(schema_default) and all(
            _defaults_equal(s, p) for s, p in zip(schema_default, py_default))
    if isinstance(schema_default, str) or isinstance(py_default, str):
        return schema_default == py_default and type(schema_default) is type(py_default)
    if isinstance(schema_default, (int, float)) and isinstance(py_default, (int, float)):
        return schema_default == py_default
    return False


def check_signature(func, schema: Schema) -> list[str]:
    """Mismatches between `func`'s signature and `schema` (empty list = match): parameter names and order,
    positional vs keyword-only (the schema's `*`), and defaults (None<->None, [] <-> () or [], numbers by value)."""
    where = f"{getattr(func, '__qualname__', func)} vs {schema.name} ({schema.source})"
    problems = []
    py = list(inspect.signature(func).parameters.values())
    for p in py:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            problems.append(f"{where}: Python has {'*' if p.kind is p.VAR_POSITIONAL else '**'}{p.name}; "
                            "the schema fixes the parameter list")
        elif p.kind is p.POSITIONAL_ONLY:
            problems.append(f"{where}: parameter {p.name!r} is positional-only in Python; the schema allows "
                            "it by keyword")
    py = [p for p in py if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    py_names, sc_names = [p.name for p in py], [p.name for p in schema.params]
    missing = [n for n in sc_names if n not in py_names]
    extra = [n for n in py_names if n not in sc_names]
    if missing:
        problems.append(f"{where}: schema parameters missing in Python: {missing}")
    if extra:
        problems.append(f"{where}: Python parameters not in the schema: {extra}")
    common_py = [n for n in py_names if n in sc_names]
    common_sc = [n for n in sc_names if n in py_names]
    if common_py != common_sc:
        problems.append(f"{where}: parameter order differs: Python {common_py}, schema {common_sc}")
    by_name = {p.name: p for p in py}
    for sp in schema.params:
        pp = by_name.get(sp.name)
        if pp is None:
            continue
        py_kwonly = pp.kind is pp.KEYWORD_ONLY
        if py_kwonly != sp.kwarg_only:
            problems.append(f"{where}: parameter {sp.name!r} is "
                            f"{'keyword-only' if sp.kwarg_only else 'positional-or-keyword'} in the schema "
                            f"but {'keyword-only' if py_kwonly else 'positional-or-keyword'} in Python "
                            "(the '*' is in a different place)")
        py_default = NO_DEFAULT if pp.default is inspect.Parameter.empty else pp.default
        if sp.default is NO_DEFAULT or py_default is NO_DEFAULT:
            if sp.default is not py_default:
                problems.append(f"{where}: parameter {sp.name!r} default is {py_default!r} in Python, "
                                f"{sp.default!r} in the schema")
        elif not _defaults_equal(sp.default, py_default):
            problems.append(f"{where}: parameter {sp.name!r} default is {py_default!r} in Python, "
                            f"{sp.default!r} in the schema")
    return problems
