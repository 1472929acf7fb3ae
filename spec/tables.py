"""Typed loading of `quant.yaml` and `tensors.yaml`, and their expansion for one config.

`expand(cfg)` turns the key patterns into the exact list of safetensors tensors a checkpoint of
that config holds (key, dtype, stored shape), grouped into logical tensors (a weight and its
scale). Checkpoint I/O, the inventory and the code generator all read this one expansion.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal, NamedTuple

import msgspec

from spec import expr
from spec.config import ModelConfig
from spec.schedule import Attention, LayerInfo, Role, schedule
from spec.yamlio import SpecError, decode, load_yaml

SPEC_DIR = Path(__file__).resolve().parent
DTypeName = Literal["BF16", "F32", "I64", "I8", "F8_E4M3", "F8_E8M0"]


class DType(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    bytes: int
    torch: str
    doc: str


class Part(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    role: Literal["data", "weight", "scale", "weight_scale", "weight_offset", "scale_bias"]
    dtype: DTypeName
    shape: tuple[str | int, ...] | None = None   # None: the logical shape itself
    suffix: str | None = None                     # "scale": key `X.weight` -> `X.scale`


class Format(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    doc: str
    logical: Literal["any", "matrix"]
    parts: tuple[Part, ...]
    decode: str     # reference decoder to fp32: "module:function" taking (parts by role, cfg)
    encode: str     # encoder from fp32 to the stored parts (writing checkpoints)


class Selected(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    config_key: str
    choices: dict[str, str]


class QuantSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    dtypes: dict[DTypeName, DType]
    formats: dict[str, Format]
    selected: dict[str, Selected]


class When(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    attention: tuple[Attention, ...] | None = None
    routing: tuple[Literal["hash", "learned"], ...] | None = None
    role: tuple[Role, ...] = ("backbone", "mtp", "dspark")
    stage: Literal["first", "last"] | None = None
    # layer facts of spec.schedule.LayerInfo (None: either)
    kv_source: bool | None = None
    index_source: bool | None = None
    engram: bool | None = None
    # config facts (model-level entries too): model_type one of these; these keys set / absent
    model_type: tuple[str, ...] | None = None
    config_set: tuple[str, ...] = ()
    config_unset: tuple[str, ...] = ()

    def matches(self, layer: LayerInfo, cfg: ModelConfig | None = None) -> bool:
        if not self.matches_config(cfg):
            return False
        if layer.role not in self.role:
            return False
        if self.attention is not None and layer.attention not in self.attention:
            return False
        if self.routing is not None and layer.routing not in self.routing:
            return False
        for fact in ("kv_source", "index_source", "engram"):
            want = getattr(self, fact)
            if want is not None and getattr(layer, fact) != want:
                return False
        if self.stage == "first" and layer.stage != 0:
            return False
        return not (self.stage == "last" and not layer.last_stage)

    def matches_config(self, cfg: ModelConfig | None) -> bool:
        """The config predicates. Without a config (the code generator's per-kind layers, which
        describe the runnable V4 graph) they are judged for a V4 config: model_type deepseek_v4 and
        none of the optional V4.1 keys set."""
        model_type = cfg.model_type if cfg is not None else "deepseek_v4"
        if self.model_type is not None and model_type not in self.model_type:
            return False
        if any(cfg is None or getattr(cfg, key) is None for key in self.config_set):
            return False
        return not any(cfg is not None and getattr(cfg, key) is not None for key in self.config_unset)


class Entry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    key: str
    scope: Literal["model", "block"]
    shape: tuple[str | int, ...]
    format: str
    tp: Literal["replicate", "rows", "row_blocks", "cols", "experts"]
    tensor_class: str = msgspec.field(name="class")
    when: When = When()


class Derived(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A runtime parameter the loader builds (not stored in the checkpoint)."""
    key: str
    scope: Literal["model", "block"]
    doc: str
    build: str                  # "module:function" (cfg, layer, options) -> value
    when: When = When()


class TensorTable(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    classes: dict[str, str]
    entries: tuple[Entry, ...]
    derived: tuple[Derived, ...] = ()


class Stored(NamedTuple):
    """One safetensors tensor of a checkpoint."""
    key: str
    dtype: DTypeName
    shape: tuple[int, ...]
    role: str                   # data | weight | scale (official); weight_scale | weight_offset | scale_bias (ModelSlim)


class Logical(NamedTuple):
    """One logical tensor: what the model computes with, stored as one or more `Stored` parts."""
    key: str                    # official key of the main part (`...weight`)
    entry: Entry
    format: str                 # resolved format name
    shape: tuple[int, ...]      # logical shape
    layer: LayerInfo | None     # None for model-level tensors
    expert: int | None
    parts: tuple[Stored, ...]


@functools.lru_cache(maxsize=None)
def load_quant(path: Path = SPEC_DIR / "quant.yaml") -> QuantSpec:
    data, lines = load_yaml(path)
    spec = decode(data, QuantSpec, str(path), lines)
    for name, sel in spec.selected.items():
        for choice, fmt in sel.choices.items():
            if fmt not in spec.formats:
                raise SpecError(f"{path}:{lines[('selected', name, 'choices', choice)]}: choice '{choice}' of "
                                f"'{name}' names unknown format '{fmt}' (accepted: {', '.join(spec.formats)})")
    return spec


@functools.lru_cache(maxsize=None)
def load_tensor_table(path: Path = SPEC_DIR / "tensors.yaml", quant_path: Path = SPEC_DIR / "quant.yaml") -> TensorTable:
    data, lines = load_yaml(path)
    table = decode(data, TensorTable, str(path), lines)
    quant = load_quant(quant_path)
    formats = sorted(set(quant.formats) | set(quant.selected))
    env_names = _shape_names()
    for i, entry in enumerate(table.entries):
        line = lines.get(("entries", i), "?")
        if entry.format not in formats:
            raise SpecError(f"{path}:{line}: unknown format '{entry.format}' for {entry.key} "
                            f"(accepted: {', '.join(formats)})")
        if entry.tensor_class not in table.classes:
            raise SpecError(f"{path}:{line}: unknown class '{entry.tensor_class}' for {entry.key} "
                            f"(accepted: {', '.join(table.classes)})")
        from spec.config import CONFIG_KEYS
        for key in (*entry.when.config_set, *entry.when.config_unset):
            if key not in CONFIG_KEYS:
                raise SpecError(f"{path}:{line}: when of {entry.key} names unknown config key '{key}'")
        for dim in entry.shape:
            try:
                unknown = expr.unknown_name(dim, env_names)
            except expr.ExprError as err:
                raise SpecError(f"{path}:{line}: shape of {entry.key}: {err}") from None
            if unknown:
                raise SpecError(f"{path}:{line}: shape of {entry.key} uses unknown name "
                                f"'{unknown}' (accepted: config keys, {', '.join(sorted(LAYER_NAMES))})")
    return table


# Shape names beyond the config keys: facts of the block (or model) a tensor belongs to.
LAYER_NAMES = frozenset({"compress_ratio", "n_dspark_targets", "n_block_experts", "engram_rows"})


def _shape_names() -> set[str]:
    from spec.config import CONFIG_KEYS
    return set(CONFIG_KEYS) | LAYER_NAMES


def block_experts(cfg: ModelConfig, layer: LayerInfo | None) -> int:
    """Routed experts of a block: V4.1's DSpark stages have their own (dspark_n_routed_experts)."""
    if layer is not None and layer.role == "dspark" and cfg.dspark_n_routed_experts is not None:
        return cfg.dspark_n_routed_experts
    return cfg.n_routed_experts


def shape_env(cfg: ModelConfig, layer: LayerInfo | None) -> dict[str, int]:
    env = {k: v for k, v in msgspec.structs.asdict(cfg).items() if isinstance(v, int) and not isinstance(v, bool)}
    env["compress_ratio"] = layer.ratio if layer else 0
    env["n_dspark_targets"] = len(cfg.dspark_target_layer_ids or ())
    env["n_block_experts"] = block_experts(cfg, layer)
    if layer is not None and layer.engram:       # this Engram layer's table rows
        env["engram_rows"] = cfg.engram_num_embeddings[cfg.engram_layer_ids.index(layer.index)]
    return env


# Key placeholders repeated over an index: `{expert}` over the block's routed experts,
# `{vision_block}` over the vision tower's blocks.
def _repeats(key: str, cfg: ModelConfig, layer: LayerInfo | None) -> tuple[str | None, range]:
    if "{expert}" in key:
        return "{expert}", range(block_experts(cfg, layer))
    if "{vision_block}" in key:
        return "{vision_block}", range(cfg.vision_num_hidden_layers or 0)
    return None, range(0)


def resolve_format(entry: Entry, cfg: ModelConfig, quant: QuantSpec) -> str:
    if entry.format in quant.selected:
        sel = quant.selected[entry.format]
        value = getattr(cfg, sel.config_key)
        return sel.choices[value]
    return entry.format


def stored_parts(key: str, fmt: Format, logical: tuple[int, ...], cfg: ModelConfig) -> tuple[Stored, ...]:
    """The safetensors tensors that hold one logical tensor in format `fmt`."""
    env = {"block_out": cfg.quantization_config.weight_block_size[0],
           "block_in": cfg.quantization_config.weight_block_size[1]}
    if fmt.logical == "matrix":
        env["rows"], env["cols"] = logical
    out = []
    for part in fmt.parts:
        shape = logical if part.shape is None else tuple(expr.evaluate(d, env) for d in part.shape)
        part_key = key
        if part.suffix is not None:
            if not key.endswith(".weight"):
                raise SpecError(f"format with a .{part.suffix} part needs a '.weight' key, got {key}")
            part_key = key[: -len("weight")] + part.suffix
        out.append(Stored(part_key, part.dtype, shape, part.role))
    return tuple(out)


def expand(cfg: ModelConfig, table: TensorTable | None = None, quant: QuantSpec | None = None) -> tuple[Logical, ...]:
    """Every logical tensor of a checkpoint with this config, in a stable order."""
    table = table or load_tensor_table()
    quant = quant or load_quant()
    layers = schedule(cfg)
    out: list[Logical] = []
    for entry in table.entries:
        fmt_name = resolve_format(entry, cfg, quant)
        fmt = quant.formats[fmt_name]
        if entry.scope == "model":
            scopes = [None] if entry.when.matches_config(cfg) else []
        else:
            scopes = [lay for lay in layers if entry.when.matches(lay, cfg)]
        for layer in scopes:
            env = shape_env(cfg, layer)
            try:
                shape = tuple(expr.evaluate(d, env) for d in entry.shape)
            except expr.ExprError as err:
                where = layer.prefix if layer else "model"
                raise SpecError(f"tensor {entry.key} in {where}: {err}") from None
            prefix = f"{layer.prefix}." if layer else ""
            holder, repeat = _repeats(entry.key, cfg, layer)
            for e in (repeat if holder else [None]):
                key = prefix + (entry.key.replace(holder, str(e)) if holder else entry.key)
                expert = e if holder == "{expert}" else None
                out.append(Logical(key, entry, fmt_name, shape, layer, expert, stored_parts(key, fmt, shape, cfg)))
    return tuple(out)


def stored_tensors(cfg: ModelConfig) -> dict[str, Stored]:
    """Flat map key -> stored tensor; duplicate keys are a tensor-table bug and raise."""
    out: dict[str, Stored] = {}
    for logical in expand(cfg):
        for part in logical.parts:
            if part.key in out:
                raise SpecError(f"tensors.yaml: key {part.key} is produced by two entries")
            out[part.key] = part
    return out


def with_format(logical: Logical, fmt_name: str, cfg: ModelConfig) -> Logical:
    """The same logical tensor stored in another format (a ModelSlim export's label)."""
    fmt = load_quant().formats[fmt_name]
    if fmt.logical == "matrix" and len(logical.shape) != 2:
        raise SpecError(f"{logical.key}: format '{fmt_name}' stores matrices, the tensor has shape {list(logical.shape)}")
    return logical._replace(format=fmt_name, parts=stored_parts(logical.key, fmt, logical.shape, cfg))
