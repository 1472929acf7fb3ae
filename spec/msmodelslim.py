"""Typed loading of `msmodelslim.yaml`: the Ascend ModelSlim checkpoint format as data, and the
label each tensor of a config takes under a label map or a recipe.

The checkpoint reader and the converter both ask this module which storage format (quant.yaml) a
tensor has under a ModelSlim label, and which labels a tensor may carry at all.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

import msgspec

from spec.config import ModelConfig
from spec.tables import SPEC_DIR, Logical, expand, load_quant, load_tensor_table, with_format
from spec.yamlio import SpecError, decode, load_yaml

Label = Literal["FLOAT", "W8A8_DYNAMIC", "W4A8_DYNAMIC", "INT8_ROW32"]


class Files(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    description: str
    index: str
    shard: str
    part_shards: dict[str, str] = {}            # an export part -> its own shard names (the drafter's `mtpq-*`)
    tensor_files: dict[str, str] = {}           # an export part -> one file per tensor (the Engram tables)
    part_size_gib: float
    version: str
    config_drops: tuple[str, ...]

    def shard_name(self, index: int, count: int, part: str = "backbone") -> str:
        return self.part_shards.get(part, self.shard).format(index=index, count=count)

    def tensor_file(self, part: str, key: str) -> str | None:
        """The file of its own a tensor of `part` is written to (None: the part's shards)."""
        pattern = self.tensor_files.get(part)
        if pattern is None:
            return None
        stem, _, suffix = key.rpartition(".")
        return pattern.format(stem=stem.replace(".", "_"), suffix=suffix)


class LabelSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    doc: str
    format: str | None = None                   # storage format of a quantised weight
    down_format: str | None = None              # ... of a down projection
    formats: dict[str, str] = {}                # FLOAT: official format -> the format it is written in
    classes: tuple[str, ...] = ()               # the tensor classes it applies to (default: quantisable linears)


class Recipe(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    model_quant_type: str
    classes: dict[str, Label]                   # tensor class -> label; unnamed classes are FLOAT


class Part(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    prefix: str | None = None                   # keys starting with it
    classes: tuple[str, ...] = ()               # ... or tensors of these classes


class DrafterVocabulary(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    model_types: tuple[str, ...]                # the model generations whose exports carry the copies
    copies: dict[str, str]                      # copy key ("{last}": the last drafter stage) -> backbone key


class ModelSlimSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    files: Files
    labels: dict[Label, LabelSpec]
    down_projections: tuple[str, ...]
    quantisable: tuple[str, ...]
    recipes: dict[str, Recipe]
    parts: dict[str, Part]                      # an export's parts; "backbone" is every other key
    drafter_vocabulary: DrafterVocabulary


@functools.lru_cache(maxsize=None)
def load_msmodelslim(path: Path = SPEC_DIR / "msmodelslim.yaml") -> ModelSlimSpec:
    data, lines = load_yaml(path)
    spec = decode(data, ModelSlimSpec, str(path), lines)
    formats = load_quant().formats
    classes = load_tensor_table().classes
    named = [f for lab in spec.labels.values() for f in (lab.format, lab.down_format, *lab.formats.values()) if f]
    for fmt in named:
        if fmt not in formats:
            raise SpecError(f"{path}: names storage format '{fmt}', which quant.yaml does not define")
    for cls in (*spec.quantisable, *(c for r in spec.recipes.values() for c in r.classes),
                *(c for lab in spec.labels.values() for c in lab.classes),
                *(c for part in spec.parts.values() for c in part.classes)):
        if cls not in classes:
            raise SpecError(f"{path}: names tensor class '{cls}', which tensors.yaml does not define")
    return spec


def allowed_labels(logical: Logical) -> tuple[str, ...]:
    """The labels a ModelSlim export may give this tensor: a label's `classes` (where it names some) and the
    quantisable classes' linears."""
    spec = load_msmodelslim()
    cls = logical.entry.tensor_class
    linear = cls in spec.quantisable and len(logical.shape) == 2
    return tuple(name for name, lab in spec.labels.items()
                 if name == "FLOAT" or (cls in lab.classes if lab.classes else linear))


def format_for(logical: Logical, label: str) -> str:
    """The storage format of `logical` (as the official expansion resolved it) under `label`."""
    spec = load_msmodelslim()
    lab = spec.labels[label]
    if label == "FLOAT":
        return lab.formats[logical.format]
    if logical.entry.key in spec.down_projections and lab.down_format:
        return lab.down_format
    return lab.format


def recipe_label(logical: Logical, recipe: str) -> str:
    """The label `dsv4gen convert --format msmodelslim --quant-type <recipe>` gives this tensor."""
    spec = load_msmodelslim()
    if recipe not in spec.recipes:
        raise SpecError(f"unknown ModelSlim quant type '{recipe}' (accepted: {', '.join(spec.recipes)})")
    return spec.recipes[recipe].classes.get(logical.entry.tensor_class, "FLOAT")


def part_of(logical: Logical, key: str | None = None) -> str:
    """Which part of an export a tensor (saved under `key`, default its own) belongs to ("backbone" unless a part
    claims it)."""
    key = logical.key if key is None else key
    for name, part in load_msmodelslim().parts.items():
        if (part.prefix and key.startswith(part.prefix)) or logical.entry.tensor_class in part.classes:
            return name
    return "backbone"


def vocabulary_copies(cfg: ModelConfig) -> dict[str, str]:
    """The drafter's vocabulary copies an export of this config saves: copy key -> the backbone key it copies
    (none for a generation whose exports share the backbone's)."""
    vocab = load_msmodelslim().drafter_vocabulary
    if cfg.model_type not in vocab.model_types or cfg.num_nextn_predict_layers < 1:
        return {}
    last = str(cfg.num_nextn_predict_layers - 1)
    return {copy.replace("{last}", last): source for copy, source in vocab.copies.items()}


def export_inventory(cfg: ModelConfig, recipe: str) -> dict[str, dict[str, int]]:
    """Saved keys per part and quant type of the ModelSlim export `recipe` writes for this config, from
    the spec alone: part -> label -> keys (a quantised linear saves its weight and its sibling tensors)."""
    out: dict[str, dict[str, int]] = {}
    copied = {source: copy for copy, source in vocabulary_copies(cfg).items()}
    for t in expand(cfg):
        label = recipe_label(t, recipe)
        keys = len(with_format(t, format_for(t, label), cfg).parts)
        for key in (t.key, copied.get(t.key)):
            if key is not None:
                counts = out.setdefault(part_of(t, key), {})
                counts[label] = counts.get(label, 0) + keys
    return out
