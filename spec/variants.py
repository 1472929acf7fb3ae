"""Model spec files (`spec/models/*.yaml`): a family's base config and its named variants.

A variant restates only what differs (`set`, `unset`) so a shared value lives in one place.
`variant_config("flash-0731")` returns a validated `ModelConfig`; `--set key=value` overrides
from the command line go through the same validation.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

import msgspec

from spec.config import CONFIG_KEYS, ModelConfig, config_from_dict
from spec.yamlio import SpecError, decode, load_yaml

MODELS_DIR = Path(__file__).resolve().parent / "models"


class Variant(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    doc: str
    set: dict[str, object] = {}
    unset: tuple[str, ...] = ()


class ModelSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    family: str
    config: dict[str, object]
    variants: dict[str, Variant]


@functools.lru_cache(maxsize=None)
def _load_family(path: Path) -> tuple[ModelSpec, dict]:
    data, lines = load_yaml(path)
    return decode(data, ModelSpec, str(path), lines), lines


def _families(models_dir: Path | None = None) -> list[Path]:
    return sorted((models_dir or MODELS_DIR).glob("*.yaml"))


def variants(models_dir: Path | None = None) -> dict[str, tuple[Path, str]]:
    """Every variant name -> (spec file, doc); `models_dir`: another spec folder's models (diff --spec)."""
    out: dict[str, tuple[Path, str]] = {}
    for path in _families(models_dir):
        spec, _ = _load_family(path)
        for name, var in spec.variants.items():
            out[name] = (path, var.doc.strip())
    return out


def variant_config(name: str, overrides: dict[str, object] | None = None,
                   models_dir: Path | None = None) -> ModelConfig:
    known = variants(models_dir)
    if name not in known:
        raise SpecError(f"unknown model variant '{name}' (accepted: {', '.join(sorted(known))})")
    path, _ = known[name]
    spec, lines = _load_family(path)
    var = spec.variants[name]
    data = dict(spec.config)
    for i, key in enumerate(var.unset):
        if key not in data:
            raise SpecError(f"{path}:{lines[('variants', name, 'unset', i)]}: variant '{name}' unsets "
                            f"'{key}', which the base config does not have")
        del data[key]
    data.update(var.set)
    key_lines = _variant_lines(lines, name)
    # A spec file holds config keys only (checked first: a misspelt key is the likelier cause of
    # any later error); checkpoint bookkeeping keys are tolerated in config.json, not here.
    unknown = [k for k in data if k not in CONFIG_KEYS]
    if unknown:
        raise SpecError(f"{path}:{key_lines[(unknown[0],)]}: variant '{name}': unknown config key "
                        f"'{unknown[0]}' (accepted: {', '.join(sorted(CONFIG_KEYS))})")
    cfg, _ = config_from_dict(data, str(path), key_lines, context=f"variant '{name}': ")
    if overrides:
        cfg = apply_overrides(cfg, overrides, f"variant {name} with --set")
    return cfg


def _variant_lines(lines: dict, name: str) -> dict:
    """Line map for a variant's merged config: its own `set` lines win over the base config's."""
    out = {path[1:]: line for path, line in lines.items() if path[:1] == ("config",)}
    prefix = ("variants", name, "set")
    out.update({path[3:]: line for path, line in lines.items() if path[:3] == prefix})
    return out


def apply_overrides(cfg: ModelConfig, overrides: dict[str, object], where: str) -> ModelConfig:
    data = cfg.to_json_dict()
    data.update(overrides)
    new, unknown = config_from_dict(data, where)
    if unknown:
        raise SpecError(f"{where}: unknown config key '{unknown[0]}' (accepted: {', '.join(sorted(CONFIG_KEYS))})")
    return new


def parse_set_args(items: list[str] | None) -> dict[str, object]:
    """`key=value` pairs; values are JSON (`[0,4,8]`, `true`, `1e-6`) or else plain strings."""
    out: dict[str, object] = {}
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise SpecError(f"--set expects key=value, got '{item}'")
        try:
            out[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            out[key.strip()] = raw
    return out
