"""Typed loading of backend profiles (`backends/<name>/profile.yaml`).

A profile is a capability table: the compute dtype, which dtypes the device has and lacks, how
each graph op lowers (reference, hand-written composite, or native device op) and why, the
runtime format of each tensor class, the device's quirks and the lessons it encodes — every
refusal and choice with a one-line reason. Lowering reads tables; it has no per-backend branches.
"""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

import msgspec

from spec import expr
from spec.config import RankConfig
from spec.hardware import Device, check_device
from spec.graph import load_graph
from spec.tables import SPEC_DIR, load_tensor_table
from spec.yamlio import SpecError, decode, load_yaml

BACKENDS_DIR = SPEC_DIR.parent / "backends"
LessonId = str


class Lowering(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    impl: Literal["reference", "composite", "native"]
    reason: str
    call: str | None = None                 # "module:function" with the op's port signature
    device_ops: tuple[str, ...] = ()        # device ops (backends/<name>/device_ops.py) that call launches
    lessons: tuple[LessonId, ...] = ()
    consumes: tuple[str, ...] = ()          # input ports the lowering overwrites in place (the build checks that
                                            # no later step of the program reads what is bound to them)


class OpLowering(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How one graph op lowers: one way, or one way per runtime format of its `dispatch_on` port."""
    impl: Literal["reference", "composite", "native"] | None = None
    reason: str | None = None
    call: str | None = None
    device_ops: tuple[str, ...] = ()
    lessons: tuple[LessonId, ...] = ()
    consumes: tuple[str, ...] = ()
    by_format: dict[str, Lowering] = {}

    def single(self) -> Lowering:
        return Lowering(self.impl, self.reason, self.call, self.device_ops, self.lessons, self.consumes)


class FusedLimit(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One shape limit of a fused kernel, on a key of the rank's config (spec/config.py RankConfig):
    its value (every element of a list-valued key) must be one of `one_of`, at least `min`, at most
    `max`, and a multiple of `multiple_of` (those given).
    `width`: a limit on a width only (a hidden size, a head count), which the emulation may relax
    to run the fused path at tiny widths (lib/emulation/relaxed.py); no other limit is ever relaxed."""
    key: str
    reason: str
    source: str
    one_of: tuple[int, ...] = ()
    min: int | None = None
    max: int | None = None
    multiple_of: int | None = None
    width: bool = False


class FusedKernel(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """A fused kernel (or a pair of them) that replaces the lowering of `ops` wherever the checkpoint's
    shapes meet every limit, chosen once per loaded model (RankConfig.fused); the ops' own lowerings
    stay the fallback, so every shape still runs."""
    doc: str
    source: str
    limits: dict[str, FusedLimit]
    ops: dict[str, Lowering]
    lessons: tuple[LessonId, ...] = ()


class DTypes(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    has: tuple[str, ...]
    lacks: dict[str, str] = {}              # dtype -> reason (with lesson id)


class Quirk(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    doc: str
    lessons: tuple[LessonId, ...] = ()


class RuntimeFormats(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    default: str
    classes: dict[str, str] = {}            # tensor class -> runtime format, overriding default


class DeviceOp(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    doc: str
    lessons: tuple[LessonId, ...] = ()


class Budget(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    budget: float
    why: str


class CacheGeometry(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Paged decode-state blocks (lib/runtime/paged_cache.py): a physical block of `block_tokens` positions is
    addressed by the attention kernel as block_tokens / logical_block_tokens logical blocks (L19)."""
    block_tokens: int               # positions per physical block (the allocation unit)
    logical_block_tokens: int       # positions per block-table entry the kernel reads
    reason: str
    lessons: tuple[LessonId, ...] = ()
    # ring pools (per-sequence state) get a multiple of this many rows: a kernel that reads a ring as one
    # paged block needs a block size it accepts (ascend910's fused attention: a multiple of 16)
    ring_rows_multiple: int = 1


class ExpertConversion(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Which routed experts a format with `runs_as` (spec/runtime.yaml) is converted for, each step:
    every expert the rank holds (fixed shapes) or only those tokens route to (the planner's traffic)."""
    scope: Literal["all_local", "routed"]
    reason: str
    lessons: tuple[LessonId, ...] = ()


class EpDispatch(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """How tokens reach the experts of other EP ranks (lib/distributed/expert_exchange.py): every rank runs its experts on
    every token and one all-reduce sums (allgather), or pairs travel to their expert's rank and
    back (alltoall)."""
    mode: Literal["allgather", "alltoall"] = "allgather"
    reason: str = "a single process holds every expert"
    lessons: tuple[LessonId, ...] = ()


class MergedWeights(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Two projections of one input held as one runtime weight (vLLM's gate_up_proj): the loader puts the second's
    output rows after the first's ("halves") or alternating with them ("interleaved") under the first key and holds
    None under the second; the ops that take both read one GEMM of the two (lib/weights/params.py merge_outputs)."""
    keys: tuple[str, str]       # block parameter keys (runtime keys: experts un-numbered), first then second
    reason: str
    source: str = ""
    # "halves": the second's output rows after the first's ([gate | up]); "interleaved": row 2j the first's j-th,
    # 2j+1 the second's (the even | odd columns a GPT-OSS-style SwiGLU kernel splits its input into); "stacked":
    # as halves, and the second is still held alone, as a view of its rows (a shared_inputs pair with one_gemm)
    layout: Literal["halves", "interleaved", "stacked"] = "halves"


class SharedInput(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Two `linear` steps of one program reading the same input with these two weights (in this runtime format)
    lower to one call returning both outputs, made where the first step is (its input quantised once)."""
    keys: tuple[str, str]       # the weights' parameter keys, the earlier step's first
    format: str                 # the runtime format both weights must have for the pair call
    call: str                   # "module:function" (x, first, second) -> (first's output, second's output)
    reason: str
    source: str = ""
    # the two weights held as one (the loader stacks the second's rows after the first's, layout "stacked"): the call
    # gets merged=True and makes one GEMM, its two outputs views of the one result; the second stays usable alone
    # (a view of its rows), the first is read only by the pair call (the build refuses a lone use)
    one_gemm: bool = False


class QuantisedNorm(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """An `rms_norm` step with this weight whose output only linears of this runtime format read lowers to one
    call returning the normed rows already quantised for them (the linears then skip their own quantisation)."""
    key: str                    # the norm's weight parameter key
    format: str                 # the runtime format every reader's weight must have
    call: str                   # "module:function" (x, weight, eps) -> quantised rows the format's linears take
    reason: str
    source: str = ""


class Profile(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    name: str
    doc: str
    compute_dtype: Literal["float32", "float16", "bfloat16"]
    dtypes: DTypes
    op_default: Lowering
    runtime_formats: RuntimeFormats
    # required in every profile.yaml (load_profile refuses one without it); the default only lets
    # code build a Profile by hand for tests that never page a cache
    cache: CacheGeometry | None = None
    ops: dict[str, OpLowering] = {}
    device_ops: dict[str, DeviceOp] = {}    # native ops of the device stack, each in device_ops.py
    fused: dict[str, FusedKernel] = {}      # fused kernels chosen by the checkpoint's shapes, by name
    forbidden_ops: dict[str, str] = {}      # aten ops the device must never see on a hot path -> why
    expert_modes: dict[str, str] = {}       # routed-expert mode -> runtime format of class routed_expert
    # required where a routed-expert format is converted when its layer runs (runtime.yaml `runs_as`)
    expert_conversion: ExpertConversion | None = None
    device: Device | None = None            # the planner's device numbers (spec/hardware.py); none on cpu
    ep_dispatch: EpDispatch = EpDispatch()  # expert-parallel token exchange (lib/distributed/expert_exchange.py)
    merged_weights: dict[str, MergedWeights] = {}   # name -> two weights the loader holds as one
    shared_inputs: dict[str, SharedInput] = {}      # name -> two linears of one input lowered as one call
    quantised_norms: dict[str, QuantisedNorm] = {}  # name -> a norm that hands its linears quantised rows
    quirks: dict[str, Quirk] = {}
    lessons: dict[LessonId, str] = {}       # lesson id -> how this backend handles it
    # conformance error budgets vs the cpu reference: "attention" / "ffn" (relative error of a
    # teacher-forced sub-layer output), "logits" (absolute logit error a top-1 comparison tolerates)
    conformance: dict[Literal["attention", "ffn", "logits"], Budget] = {}

    def lowering(self, op: str, fmt: str | None = None) -> Lowering:
        """The lowering of `op`; `fmt` is the runtime format of its dispatch port, if it has one."""
        entry = self.ops.get(op)
        if entry is None:
            return self.op_default
        if entry.by_format:
            if fmt not in entry.by_format:
                raise SpecError(f"backend '{self.name}' has no lowering of op '{op}' for runtime format "
                                f"'{fmt}' (has: {', '.join(entry.by_format)})")
            return entry.by_format[fmt]
        return entry.single()

    def fused_of(self, op: str) -> tuple[str, Lowering] | None:
        """(kernel name, lowering) of the fused kernel that can replace `op`, if any."""
        return next(((name, k.ops[op]) for name, k in self.fused.items() if op in k.ops), None)

    def runtime_format(self, tensor_class: str) -> str:
        return self.runtime_formats.classes.get(tensor_class, self.runtime_formats.default)


class RuntimeFormat(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    doc: str
    convert: str
    bytes: dict[str, str] = {}              # field -> size expression of numel / rows / cols
    runs_as: str | None = None              # the format it is converted to when its layer runs
    group: str | None = None                # config key of the column-group width `bytes` may use


BYTES_NAMES = frozenset({"numel", "rows", "cols", "group"})


class RuntimeSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    formats: dict[str, RuntimeFormat]


@functools.lru_cache(maxsize=None)
def load_runtime_formats(path: Path = SPEC_DIR / "runtime.yaml") -> RuntimeSpec:
    data, lines = load_yaml(path)
    spec = decode(data, RuntimeSpec, str(path), lines)
    for name, fmt in spec.formats.items():
        for field, size in fmt.bytes.items():
            what = f"{path}:{lines.get(('formats', name, 'bytes', field), '?')}: format '{name}' bytes of '{field}'"
            try:
                unknown = expr.unknown_name(size, BYTES_NAMES)
            except expr.ExprError as err:
                raise SpecError(f"{what}: {err}") from None
            if unknown:
                raise SpecError(f"{what} uses unknown name '{unknown}' (accepted: {', '.join(sorted(BYTES_NAMES))})")
            if fmt.group is None and expr.unknown_name(size, BYTES_NAMES - {"group"}):
                raise SpecError(f"{what} uses 'group' but the format names no `group` config key")
        if fmt.runs_as is not None and fmt.runs_as not in spec.formats:
            raise SpecError(f"{path}:{lines.get(('formats', name, 'runs_as'), '?')}: format '{name}' runs as "
                            f"unknown format '{fmt.runs_as}' (accepted: {', '.join(spec.formats)})")
    return spec


def backend_names() -> list[str]:
    return sorted(p.parent.name for p in BACKENDS_DIR.glob("*/profile.yaml"))


def profile_path(name: str) -> Path:
    path = BACKENDS_DIR / name / "profile.yaml"
    if not path.is_file():
        raise SpecError(f"unknown backend '{name}' (accepted: {', '.join(backend_names())})")
    return path


@functools.lru_cache(maxsize=None)
def load_profile(name: str, path: Path | None = None) -> Profile:
    path = path or profile_path(name)
    data, lines = load_yaml(path)
    prof = decode(data, Profile, str(path), lines)
    if prof.name != name:
        raise SpecError(f"{path}:{lines.get(('name',), '?')}: profile name '{prof.name}' does not match "
                        f"its folder '{name}'")
    ops = load_graph().graph.ops
    for op in prof.ops:
        if op not in ops:
            raise SpecError(f"{path}:{lines[('ops', op)]}: unknown op '{op}' (accepted: {', '.join(sorted(ops))})")
    table = load_tensor_table()
    classes = table.classes
    runtime = load_runtime_formats().formats
    keys = {e.key.replace("{expert}.", ""): e for e in table.entries if e.scope == "block"}
    for name, merged in prof.merged_weights.items():
        where = f"{path}:{lines[('merged_weights', name)]}"
        unknown = [k for k in merged.keys if k not in keys]
        if unknown:
            raise SpecError(f"{where}: merged weights '{name}': unknown block parameter '{unknown[0]}'")
        first, second = (keys[k] for k in merged.keys)
        if (first.tensor_class, first.shape[1:]) != (second.tensor_class, second.shape[1:]):
            raise SpecError(f"{where}: merged weights '{name}': {merged.keys[0]} and {merged.keys[1]} differ in class "
                            f"or input width, so one GEMM cannot hold both")
    for name, pair in prof.shared_inputs.items():
        where = f"{path}:{lines[('shared_inputs', name)]}"
        unknown = [k for k in pair.keys if k not in keys]
        if unknown or pair.format not in runtime:
            raise SpecError(f"{where}: shared input '{name}': " + (f"unknown parameter '{unknown[0]}'" if unknown else
                            f"unknown runtime format '{pair.format}' (accepted: {', '.join(runtime)})"))
    for name, norm in prof.quantised_norms.items():
        where = f"{path}:{lines[('quantised_norms', name)]}"
        if norm.key not in keys or norm.format not in runtime:
            raise SpecError(f"{where}: quantised norm '{name}': " + (f"unknown parameter '{norm.key}'" if norm.key not in
                            keys else f"unknown runtime format '{norm.format}' (accepted: {', '.join(runtime)})"))
    for cls, fmt in prof.runtime_formats.classes.items():
        where = f"{path}:{lines[('runtime_formats', 'classes', cls)]}"
        if cls not in classes:
            raise SpecError(f"{where}: unknown tensor class '{cls}' (accepted: {', '.join(classes)})")
        if fmt not in runtime:
            raise SpecError(f"{where}: unknown runtime format '{fmt}' (accepted: {', '.join(runtime)})")
    if prof.runtime_formats.default not in runtime:
        raise SpecError(f"{path}:{lines[('runtime_formats', 'default')]}: unknown runtime format "
                        f"'{prof.runtime_formats.default}' (accepted: {', '.join(runtime)})")
    for op, entry in prof.ops.items():
        where = f"{path}:{lines[('ops', op)]}"
        lows = entry.by_format.items() if entry.by_format else [(None, entry.single())]
        if entry.by_format and entry.impl is not None:
            raise SpecError(f"{where}: op '{op}' has both a single lowering and 'by_format'")
        if entry.by_format and ops[op].dispatch_on is None:
            raise SpecError(f"{where}: op '{op}' has no dispatch_on port in graph.yaml, so 'by_format' cannot apply")
        for fmt, low in lows:
            what = f"op '{op}'" + (f" for format '{fmt}'" if fmt else "")
            if fmt is not None and fmt not in runtime:
                raise SpecError(f"{where}: {what}: unknown runtime format (accepted: {', '.join(runtime)})")
            if low.impl is None or low.reason is None:
                raise SpecError(f"{where}: {what} needs 'impl' and 'reason'")
            if low.impl != "reference" and low.call is None:
                raise SpecError(f"{where}: {what} lowers to {low.impl} but names no 'call'")
            for dev in low.device_ops:
                if dev not in prof.device_ops:
                    raise SpecError(f"{where}: {what} launches device op '{dev}', which the profile's "
                                    f"device_ops does not list (accepted: {', '.join(prof.device_ops) or 'none'})")
    _check_fused(prof, path, lines, ops)
    for mode, fmt in prof.expert_modes.items():
        if fmt not in runtime:
            raise SpecError(f"{path}:{lines[('expert_modes', mode)]}: expert mode '{mode}' names unknown runtime "
                            f"format '{fmt}' (accepted: {', '.join(runtime)})")
    _check_expert_conversion(prof, path, lines, runtime)
    if prof.device is not None:
        check_device(prof.device, path, lines)
    geo = prof.cache
    if geo is None:
        raise SpecError(f"{path}:1: missing required key 'cache' (block_tokens, logical_block_tokens, reason)")
    if geo.ring_rows_multiple < 1:
        raise SpecError(f"{path}:{lines.get(('cache', 'ring_rows_multiple'), '?')}: cache ring_rows_multiple "
                        f"{geo.ring_rows_multiple} must be at least 1")
    if geo.logical_block_tokens <= 0 or geo.block_tokens <= 0 or geo.block_tokens % geo.logical_block_tokens:
        raise SpecError(f"{path}:{lines.get(('cache', 'block_tokens'), lines.get(('cache',), '?'))}: cache "
                        f"block_tokens {geo.block_tokens} must be a positive multiple of logical_block_tokens "
                        f"{geo.logical_block_tokens}")
    return prof


def _check_expert_conversion(prof: Profile, path: Path, lines: dict, runtime: dict) -> None:
    """A profile that can hold routed experts in a format converted at run time must say which
    experts it converts each step; one that cannot must not pretend to."""
    held = {prof.runtime_format("routed_expert"), *prof.expert_modes.values()}
    converted = sorted(f for f in held if runtime[f].runs_as is not None)
    if converted and prof.expert_conversion is None:
        raise SpecError(f"{path}:1: missing key 'expert_conversion' (scope: all_local | routed, reason): routed "
                        f"experts can be held as '{converted[0]}', which is converted when its layer runs")
    if prof.expert_conversion is not None and not converted:
        raise SpecError(f"{path}:{lines.get(('expert_conversion',), '?')}: 'expert_conversion' given, but no "
                        f"routed-expert format of this profile is converted at run time "
                        f"(formats: {', '.join(sorted(held))})")


def _check_fused(prof: Profile, path: Path, lines: dict, ops: dict) -> None:
    keys = {f.name for f in msgspec.structs.fields(RankConfig)}
    seen: dict[str, str] = {}
    for name, kernel in prof.fused.items():
        where = f"{path}:{lines.get(('fused', name), '?')}: fused kernel '{name}'"
        for lid, limit in kernel.limits.items():
            if limit.key not in keys:
                raise SpecError(f"{where}: limit '{lid}' reads unknown config key '{limit.key}' "
                                f"(accepted: {', '.join(sorted(keys))})")
            if not (limit.one_of or limit.min is not None or limit.max is not None or limit.multiple_of is not None):
                raise SpecError(f"{where}: limit '{lid}' sets none of one_of, min, max, multiple_of")
        for op, low in kernel.ops.items():
            if op not in ops:
                raise SpecError(f"{where}: unknown op '{op}' (accepted: {', '.join(sorted(ops))})")
            if op in seen:
                raise SpecError(f"{where}: op '{op}' is already replaced by fused kernel '{seen[op]}'")
            if op in prof.ops and prof.ops[op].by_format:
                raise SpecError(f"{where}: op '{op}' lowers by weight format; a fused kernel cannot replace it")
            seen[op] = name
            if low.impl == "reference" or low.call is None:
                raise SpecError(f"{where}: op '{op}' needs a 'call' of a native or composite lowering")
            for dev in low.device_ops:
                if dev not in prof.device_ops:
                    raise SpecError(f"{where}: op '{op}' launches device op '{dev}', which the profile's "
                                    f"device_ops does not list (accepted: {', '.join(prof.device_ops) or 'none'})")
