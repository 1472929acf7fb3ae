"""Per-device weight memory of a DeepSeek-V4 deployment, from the spec and the backend profile alone.

A deployment is `devices` devices on `nodes` nodes. Attention and the dense layers run TP ways,
in devices / TP data-parallel attention replicas (DP; TP within a node, DP across nodes is the
usual multi-node layout on Ascend); routed experts are split EP ways, the expert split repeated
devices / EP times. The runtime launches only TP and EP each 1 or the world size
(lib/distributed/process_group.check_sizes); `runtime_refusal` says why any other layout is
planning-only.

Every logical tensor of the variant (spec/tables.expand: the expansion `dsv4gen inventory` counts)
is split by its tensors.yaml `tp` rule, kept on a rank by expert placement (lib/records/expert_placement.py),
held in the runtime format the profile gives its class (or the chosen expert mode), and sized by
that format's `bytes` expressions in spec/runtime.yaml. The same walk sizes a preconverted
checkpoint. Knows no backend by name, no cache layout and no device speed.
"""
from __future__ import annotations

import functools
import math
from types import MappingProxyType
from typing import Mapping, NamedTuple

from lib.distributed.process_group import check_sizes
from spec import expr
from spec.profile import Profile, load_profile, load_runtime_formats
from spec.shared_kv import load_shared_kv
from spec.tables import Logical, expand
from spec.variants import variant_config
from spec.yamlio import SpecError

GiB = 1 << 30
FIELD_SHARD_BYTES = 4 * GiB     # the 310P field saved its preconverted checkpoint in <= 4 GiB shards (seeds/000)


class Deployment(NamedTuple):
    backend: str
    variant: str = "flash-0731"
    devices: int = 8
    tp: int = 8
    ep: int = 8
    expert_mode: str | None = None      # None: the profile's routed_expert class format
    max_model_len: int = 4096
    memory_fraction: float = 0.9        # share of device memory the runtime may use (vLLM's gpu_memory_utilization)
    kv_cache_bytes: int | None = None   # an explicit KV pool (vLLM's kv_cache_memory_bytes) instead of the fraction
    max_num_seqs: int = 16
    speculative: bool = True            # DSpark drafting: its rings are in the cache
    shard_bytes: int = FIELD_SHARD_BYTES
    nodes: int = 1                      # devices are spread evenly over this many nodes

    @property
    def dp(self) -> int:
        """Data-parallel attention replicas: each is TP ranks holding the attention and dense weights."""
        return self.devices // self.tp

    @property
    def devices_per_node(self) -> int:
        return self.devices // self.nodes

    @property
    def classic(self) -> bool:
        """One node, one attention replica: the layout every plan before multi-node had (TP = devices)."""
        return self.nodes == 1 and self.dp == 1


class ClassBytes(NamedTuple):
    tensor_class: str
    runtime_format: str
    data: int           # bytes per device of weight fields
    scale: int          # bytes per device of scale fields


# how tensors.yaml's `tp` rule places a tensor on the devices (the `dsv4gen plan` "by split" table)
SPLITS = {"rows": "tp", "cols": "tp", "replicate": "replicated", "experts": "experts"}


class Weights(NamedTuple):
    target: tuple[ClassBytes, ...]      # backbone and model-level tensors (embed/head are shared with the drafter, B16)
    draft: tuple[ClassBytes, ...]       # drafter stages mtp.*
    expert_format: str                  # how this rank holds routed experts
    expert_bytes: int                   # one routed expert (w1 + w3 + w2) in that format
    converted_expert_bytes: int         # the same in its run-time format (runs_as), 0 when held as run
    largest_expert_matrix: int          # elements of an expert's largest matrix (the fp32 decode buffer)
    n_local: int                        # routed experts per rank
    # (split, class) -> bytes (data + scale) per device of target tensors, split "tp" (cut TP ways),
    # "replicated" (whole on every device) or "experts" (EP ways); the draft is its own row
    split: tuple[tuple[str, str, int], ...] = ()

    def by_split(self) -> dict[str, int]:
        """Split -> bytes per device: tp, replicated, experts (target) and draft; they sum to the total."""
        out = dict.fromkeys(("tp", "replicated", "experts"), 0)
        for split, _, size in self.split:
            out[split] += size
        out["draft"] = self.total(self.draft)
        return out

    def total(self, classes: tuple[ClassBytes, ...]) -> int:
        return sum(c.data + c.scale for c in classes)

    def rollup(self) -> dict[str, int]:
        """The four tensor groups `dsv4gen plan` prints, plus their sum."""
        out = {"resident_weights": sum(c.data for c in self.target if c.tensor_class != "routed_expert"),
               "routed_experts": sum(c.data for c in self.target if c.tensor_class == "routed_expert"),
               "scales": sum(c.scale for c in self.target),
               "draft": self.total(self.draft)}
        out["total"] = sum(out.values())
        return out


class Preconverted(NamedTuple):
    """Each rank's target parameters in its runtime formats, written per rank as the 310P field did
    (replicated tensors repeated on every rank); no drafter: it is read from the source (B17)."""
    runtime_format: str
    bytes_per_rank: int
    shards_per_rank: int
    ranks: int
    # what `dsv4gen convert` writes (the target's routed experts, all EP ranks); None where the backend
    # has no preconverted expert mode and convert refuses it
    convert_output_bytes: int | None

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_rank * self.ranks


@functools.lru_cache(maxsize=4)
def logicals(variant: str) -> tuple[Logical, ...]:
    return expand(variant_config(variant))


def check_deployment(d: Deployment) -> Profile:
    """The deployment's profile, after refusing arguments the spec or the profile cannot honour."""
    profile = load_profile(d.backend)
    cfg = variant_config(d.variant)
    if profile.device is None:
        raise ValueError(f"backend {d.backend} has no `device:` section in backends/{d.backend}/profile.yaml; the "
                         f"planner needs its memory, bandwidth and launch latency (spec/hardware.py)")
    for name, value in (("--nodes", d.nodes), ("--devices", d.devices), ("--tp", d.tp), ("--ep", d.ep),
                        ("--max-model-len", d.max_model_len), ("--max-num-seqs", d.max_num_seqs),
                        ("--shard-bytes", d.shard_bytes)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if d.devices % d.nodes:
        raise ValueError(f"--devices {d.devices} is not a multiple of --nodes {d.nodes}: every node holds the same "
                         f"number of devices")
    check_sizes(cfg, d.tp, 1)           # the runtime's divisibility rules for each size on its own
    check_sizes(cfg, 1, d.ep)
    world = max(d.tp, d.ep)
    if d.devices < world:
        raise ValueError(f"--devices {d.devices} does not match TP={d.tp}, EP={d.ep}: the runtime runs "
                         f"max(TP, EP) = {world} ranks, one per device")
    for name, size, what in (("TP", d.tp, "data-parallel attention replicas of TP devices each"),
                             ("EP", d.ep, "copies of the EP-way expert split")):
        if d.devices % size:
            raise ValueError(f"{name}={size} does not divide --devices {d.devices}: the devices form "
                             f"devices / {name} {what}")
    if not 0 < d.memory_fraction <= 1:
        raise ValueError(f"--memory-fraction must be in (0, 1], got {d.memory_fraction:g}")
    if d.max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"--max-model-len {d.max_model_len} exceeds max_position_embeddings "
                         f"({cfg.max_position_embeddings}) of {d.variant}")
    if d.kv_cache_bytes is not None and d.kv_cache_bytes < 0:
        raise ValueError(f"--kv-cache-bytes must not be negative, got {d.kv_cache_bytes}")
    expert_format(profile, d.expert_mode)
    return profile


def runtime_refusal(d: Deployment) -> str | None:
    """Why the runtime cannot launch this layout (None: it can). Its launcher runs one job of
    max(TP, EP) ranks, TP and EP each 1 or that world (lib/distributed/process_group.check_sizes);
    data-parallel attention replicas inside a job are not implemented."""
    try:
        world = check_sizes(variant_config(d.variant), d.tp, d.ep)
    except ValueError as err:
        return f"{err} (lib/distributed/process_group.check_sizes)"
    if world != d.devices:
        return (f"the runtime runs one job of max(TP, EP) = {world} ranks, not {d.devices} devices in "
                f"{d.dp} data-parallel attention replicas")
    return None


def expert_format(profile: Profile, mode: str | None) -> str:
    if mode is None:
        return profile.runtime_format("routed_expert")
    if not profile.expert_modes:
        raise ValueError(f"backend {profile.name} has no expert modes (its routed experts are always held as "
                         f"{profile.runtime_format('routed_expert')}); drop --expert-mode")
    if mode not in profile.expert_modes:
        raise ValueError(f"backend {profile.name} has no expert mode '{mode}' "
                         f"(accepted: {', '.join(profile.expert_modes)})")
    return profile.expert_modes[mode]


@functools.lru_cache(maxsize=None)
def field_bytes(runtime_format: str, shape: tuple[int, ...], group: int | None = None) -> Mapping[str, int]:
    """Field -> bytes of one tensor of logical `shape` held in `runtime_format` (spec/runtime.yaml);
    `group`: the width the format's `group` config key has (format_group). Read-only, as every
    caller shares the cached answer."""
    fmt = load_runtime_formats().formats[runtime_format]
    if not fmt.bytes:
        raise SpecError(f"spec/runtime.yaml: format '{runtime_format}' has no `bytes`; the planner cannot size it")
    env = {"numel": math.prod(shape)}
    if group is not None:
        env["group"] = group
    if len(shape) == 2:
        env["rows"], env["cols"] = shape
    try:
        return MappingProxyType({field: expr.evaluate(size, env) for field, size in fmt.bytes.items()})
    except expr.ExprError as err:
        raise SpecError(f"spec/runtime.yaml: format '{runtime_format}' cannot hold a tensor of shape "
                        f"{list(shape)}: {err}") from None


def format_group(runtime_format: str, cfg) -> int | None:
    """The config width a grouped format's sizes use (w8a8_group: o_lora_rank), None otherwise."""
    key = load_runtime_formats().formats[runtime_format].group
    return None if key is None else getattr(cfg, key)


def shard_shape(t: Logical, tp: int) -> tuple[int, ...]:
    """The part of `t` one TP rank holds (DSV4-REFERENCE §4.3: rows = dim 0, cols = dim 1)."""
    dim = {"rows": 0, "cols": 1}.get(t.entry.tp)
    if dim is None:
        return t.shape
    if t.shape[dim] % tp:
        raise ValueError(f"--tp {tp} does not divide dim {dim} ({t.shape[dim]}) of {t.key}, which tensors.yaml "
                         f"splits by {t.entry.tp}")
    return t.shape[:dim] + (t.shape[dim] // tp,) + t.shape[dim + 1:]


def _held_by_rank0(t: Logical, n_local: int) -> bool:
    # every rank holds the same amount; rank 0 holds experts [0, n_local)
    return t.expert is None or t.expert < n_local


def device_tensors(d: Deployment, routed_format: str, roles=("backbone", "mtp", "dspark")):
    """(logical, runtime format, {field: bytes}) of every tensor rank 0 holds, in runtime order:
    model-level first, then block by block (the parameter tree's order)."""
    profile = load_profile(d.backend)
    cfg = variant_config(d.variant)
    n_local = cfg.n_routed_experts // d.ep
    host = load_shared_kv().host          # classes held in host memory, never on the device (host_tables)
    held = [t for t in logicals(d.variant) if t.entry.tensor_class not in host
            and (t.layer is None or t.layer.role in roles) and _held_by_rank0(t, n_local)]
    held.sort(key=lambda t: -1 if t.layer is None else t.layer.index)       # stable: entry order within a block
    for t in held:
        cls = t.entry.tensor_class
        fmt = routed_format if cls == "routed_expert" else profile.runtime_format(cls)
        yield t, fmt, field_bytes(fmt, shard_shape(t, d.tp), format_group(fmt, cfg))


def weights(d: Deployment) -> Weights:
    profile = check_deployment(d)
    routed = expert_format(profile, d.expert_mode)
    sums: dict[tuple[bool, str], list[int]] = {}
    split: dict[tuple[str, str], int] = {}
    formats: dict[str, str] = {}
    for t, fmt, fields in device_tensors(d, routed):
        scale = fields.get("scale", 0)
        draft = t.layer is not None and t.layer.role != "backbone"
        row = sums.setdefault((draft, t.entry.tensor_class), [0, 0])
        row[0] += sum(fields.values()) - scale
        row[1] += scale
        if not draft:
            key = (SPLITS[t.entry.tp], t.entry.tensor_class)
            split[key] = split.get(key, 0) + sum(fields.values())
        formats[t.entry.tensor_class] = fmt
    target = tuple(ClassBytes(c, formats[c], *b) for (draft, c), b in sums.items() if not draft)
    draft = tuple(ClassBytes(c, formats[c], *b) for (is_draft, c), b in sums.items() if is_draft)
    one = [t for t in logicals(d.variant) if t.expert == 0 and t.layer.index == 0]   # w1, w3, w2 of one expert
    runs_as = load_runtime_formats().formats[routed].runs_as
    return Weights(target, draft, routed, sum(sum(field_bytes(routed, t.shape).values()) for t in one),
                   sum(sum(field_bytes(runs_as, t.shape).values()) for t in one) if runs_as else 0,
                   max(math.prod(t.shape) for t in one), variant_config(d.variant).n_routed_experts // d.ep,
                   tuple((s, c, b) for (s, c), b in sorted(split.items(), key=lambda kv: -kv[1])))


class HostTable(NamedTuple):
    """One host-resident tensor (a V4.1 Engram table): its bytes whole and on one rank."""
    key: str
    rows: int
    row_bytes: int
    total: int                  # rows x row_bytes: the whole table
    per_rank: int               # sharded: ceil(rows / world) rows; replicated: 0 (the host holds it whole)


class HostTables(NamedTuple):
    tensor_class: str
    doc: str
    placement: str              # spec/shared_kv.yaml: sharded_per_rank | replicated_per_host
    tables: tuple[HostTable, ...]
    devices_per_node: int
    source: str

    @property
    def total(self) -> int:
        return sum(t.total for t in self.tables)

    @property
    def per_rank(self) -> int:
        return sum(t.per_rank for t in self.tables)

    @property
    def per_host(self) -> int:
        """Host memory one node holds: its ranks' shards (rows padded to whole shards), or every table once."""
        if self.placement == "sharded_per_rank":
            return self.per_rank * self.devices_per_node
        return self.total


def host_tables(d: Deployment) -> tuple[HostTables, ...]:
    """The tensor classes spec/shared_kv.yaml keeps in host memory (V4.1's Engram tables), sized in
    its format: sharded by rows over every rank of the job (each rank's shard in its own host's
    memory), or whole once per host."""
    cfg = variant_config(d.variant)
    out = []
    for cls, spec in load_shared_kv().host.items():
        tables = []
        for t in logicals(d.variant):
            if t.entry.tensor_class != cls:
                continue
            rows, cols = t.shape
            row = sum(expr.evaluate(b, {"rows": 1, "cols": cols, "numel": cols}) for b in spec.bytes.values())
            shard = -(-rows // d.devices) * row if spec.placement == "sharded_per_rank" else 0
            tables.append(HostTable(t.key, rows, row, rows * row, shard))
        if tables:
            out.append(HostTables(cls, " ".join(spec.doc.split()), spec.placement, tuple(tables),
                                  d.devices_per_node, " ".join(spec.source.split())))
    return tuple(out)


def preconverted(d: Deployment) -> Preconverted:
    """Size and shard count of a per-rank preconverted target checkpoint: tensors in the parameter
    tree's granularity (experts stacked per block), packed greedily into shards of <= shard_bytes."""
    profile = check_deployment(d)
    fmt = profile.expert_modes.get("preconverted") or profile.runtime_format("routed_expert")
    tensors: dict[tuple, int] = {}                  # (block, runtime key, field) -> bytes, in tree order
    experts = 0
    for t, _, fields in device_tensors(d, fmt, roles=("backbone",)):
        block = t.layer.prefix if t.layer else ""
        for field, size in fields.items():
            key = (block, t.entry.key.replace("{expert}.", ""), field)
            tensors[key] = tensors.get(key, 0) + size
            experts += size if t.entry.tensor_class == "routed_expert" else 0
    shards, filled = 0, 0
    for size in tensors.values():
        if shards == 0 or filled + size > d.shard_bytes:      # a tensor is never split across shards
            shards, filled = shards + 1, 0
        filled += size
    has_mode = "preconverted" in profile.expert_modes
    return Preconverted(fmt, sum(tensors.values()), shards, d.devices, experts * d.ep if has_mode else None)


def workspace_bytes(d: Deployment, w: Weights) -> int:
    """Device memory a format converted at run time needs while its layer runs: the converted
    experts plus the fp32 decode of one stacked matrix (lib/wformats.packed_fp4_to_w8a8 decodes a
    whole stack at once). all_local converts every local expert; routed at most top_k per token of
    a full decode batch."""
    if not w.converted_expert_bytes:
        return 0
    profile = load_profile(d.backend)
    cfg = variant_config(d.variant)
    n = w.n_local
    if profile.expert_conversion.scope == "routed":
        n = min(n, cfg.num_experts_per_tok * d.max_num_seqs)
    return n * w.converted_expert_bytes + 4 * n * w.largest_expert_matrix
