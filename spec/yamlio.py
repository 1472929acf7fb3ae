"""Strict YAML reading for spec files: every value keeps the file and line it came from.

Anchors, aliases, merge keys and duplicate keys are refused (one edit, one hunk), and typed
decoding errors are reported as `file:line: message (accepted: ...)`. This module knows YAML and
msgspec, not what any spec file means.
"""
from __future__ import annotations

import re
import types
import typing
from pathlib import Path

import msgspec
import yaml


class SpecError(ValueError):
    """A spec, profile or config file is malformed; the message names file and line."""


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects anchors/aliases and `<<` merges instead of expanding them."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise _located(self, event, f"YAML alias '*{event.anchor}' is not allowed in spec files")
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            raise _located(self, event, f"YAML anchor '&{anchor}' is not allowed in spec files")
        return super().compose_node(parent, index)


def _located(loader, event, message: str) -> SpecError:
    return SpecError(f"{loader.name}:{event.start_mark.line + 1}: {message}")


Path_ = tuple  # a JSON-like path: ("layers", 3, "shape")


def load_yaml(path: Path | str) -> tuple[object, dict[Path_, int]]:
    """Parse one YAML file into plain data plus a map from data path to 1-based line."""
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    loader = _StrictLoader(text)
    loader.name = str(path)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f"{mark.line + 1}" if mark else "?"
        raise SpecError(f"{path}:{line}: invalid YAML: {getattr(err, 'problem', err)}") from None
    finally:
        loader.dispose()
    if node is None:
        raise SpecError(f"{path}:1: the file holds no YAML document")
    lines: dict[Path_, int] = {}
    data = _to_data(node, (), lines, str(path))
    return data, lines


def _to_data(node, at: Path_, lines: dict, fname: str):
    lines[at] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise SpecError(f"{fname}:{key_node.start_mark.line + 1}: YAML merge key '<<' is not allowed")
            key = _StrictLoader.construct_object(_bare_loader(), key_node)
            if key in out:
                raise SpecError(f"{fname}:{key_node.start_mark.line + 1}: duplicate key '{key}'")
            out[key] = _to_data(value_node, at + (key,), lines, fname)
            lines[at + (key,)] = key_node.start_mark.line + 1
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_to_data(item, at + (i,), lines, fname) for i, item in enumerate(node.value)]
    return _StrictLoader.construct_object(_bare_loader(), node)


def _bare_loader():
    # construct_object only needs the constructor tables of a loader, not its input stream.
    return _StrictLoader("")


_PATH_RE = re.compile(r" - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`$")
_STEP_RE = re.compile(r"\.([A-Za-z_][\w\-]*)|\[(\d+)\]|\[\.\.\.\]")
_SOME_KEY = object()  # msgspec writes `[...]` for a dict key without naming it


def _parse_path(text: str) -> Path_:
    out: list = []
    for m in _STEP_RE.finditer(text):
        if m.group(1) is not None:
            out.append(m.group(1))
        elif m.group(2) is not None:
            out.append(int(m.group(2)))
        else:
            out.append(_SOME_KEY)
    return tuple(out)


def _converts(value, typ) -> bool:
    try:
        msgspec.convert(value, typ, strict=True)
    except msgspec.ValidationError:
        return False
    return True


def _name_keys(data, typ, path: tuple, bad_key: bool) -> tuple[Path_, object]:
    """Name msgspec's unnamed dict keys: each is the first key whose value does not convert (or,
    for an error in a key itself, the first key that does not). Returns the named path and the type
    found at its end (for a bad key, the key type, whose choices the message lists)."""
    out: list = []
    typ = _unwrap(typ)
    for i, step in enumerate(path + ((_SOME_KEY,) if bad_key else ())):
        if step is _SOME_KEY:
            if typing.get_origin(typ) is not dict or not isinstance(data, dict):
                break
            key_t, value_t = typing.get_args(typ)
            if i == len(path):  # the failing key itself
                key = next((k for k in data if not _converts(k, key_t)), None)
                return tuple(out) + ((key,) if key is not None else ()), _unwrap(key_t)
            step = next((k for k, v in data.items() if not _converts(v, value_t)), None)
            if step is None:
                break
        out.append(step)
        typ = _type_at(typ, (step,))
        if isinstance(data, dict):
            data = data.get(step)
        elif isinstance(data, list) and isinstance(step, int) and step < len(data):
            data = data[step]
        else:
            data = None
    return tuple(out), typ


def decode(data: object, typ: type, fname: str, lines: dict[Path_, int], at: Path_ = (), context: str = ""):
    """msgspec-convert `data` into `typ`; on failure raise SpecError with file, line, alternatives.
    `context` (e.g. "variant 'tiny': ") goes right after `file:line: `."""
    try:
        return msgspec.convert(data, typ, strict=True)
    except msgspec.ValidationError as err:
        raise _explain(str(err), data, typ, fname, lines, at, context) from None


def _explain(message: str, data, typ: type, fname: str, lines: dict, at: Path_, context: str = "") -> SpecError:
    m = _PATH_RE.search(message)
    path, target = _name_keys(data, typ, _parse_path(m.group("path")) if m else (), bool(m and m.group("key")))
    base = message[: m.start()] if m else message
    unknown = re.match(r"Object contains unknown field `(.+)`", base)
    missing = re.match(r"Object missing required field `(.+)`", base)
    if unknown:
        field = unknown.group(1)
        path = path + (field,)  # msgspec points at the object; the key's own line is more useful
        accepted = _fields(target)
        text = f"unknown key '{field}'" + (f" (accepted: {', '.join(accepted)})" if accepted else "")
    elif missing:
        text = f"missing required key '{missing.group(1)}'"
    else:
        choices = _literal_choices(target)
        text = base[0].lower() + base[1:] if base else "invalid value"
        if choices:
            text += f" (accepted: {', '.join(map(str, choices))})"
    where = ".".join(str(p) for p in path)
    line = _line_for(lines, at + path)
    return SpecError(f"{fname}:{line}: {context}{text}" + (f" at '{where}'" if where else ""))


def _line_for(lines: dict, path: Path_) -> int | str:
    while path not in lines and path:
        path = path[:-1]
    return lines.get(path, "?")


def _unwrap(typ):
    """Strip Optional/Annotated wrappers down to the meaningful type."""
    origin = typing.get_origin(typ)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(typ)[0])
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
    return typ


def _type_at(typ, path: Path_):
    """Walk a msgspec type along a data path (struct fields, list items, dict values)."""
    typ = _unwrap(typ)
    for step in path:
        if isinstance(typ, type) and issubclass(typ, msgspec.Struct):
            hints = typing.get_type_hints(typ, include_extras=True)
            enc = {f.encode_name: f.name for f in msgspec.structs.fields(typ)}
            typ = _unwrap(hints.get(enc.get(step, step), object))
            continue
        origin = typing.get_origin(typ)
        args = typing.get_args(typ)
        if origin in (list, tuple, set, frozenset) and args:
            typ = _unwrap(args[0])
        elif origin is dict and len(args) == 2:
            typ = _unwrap(args[1])
        else:
            return None
    return typ


def _fields(typ) -> list[str]:
    if isinstance(typ, type) and issubclass(typ, msgspec.Struct):
        return [f.encode_name for f in msgspec.structs.fields(typ)]
    return []


def _literal_choices(typ) -> list:
    typ = _unwrap(typ)
    if typing.get_origin(typ) is typing.Literal:
        return list(typing.get_args(typ))
    origin = typing.get_origin(typ)
    if origin in (list, tuple) and typing.get_args(typ):
        return _literal_choices(typing.get_args(typ)[0])
    if isinstance(typ, type) and issubclass(typ, __import__("enum").Enum):
        return [e.value for e in typ]
    return []
