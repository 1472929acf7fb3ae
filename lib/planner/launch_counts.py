"""`dsv4gen plan --ops`: kernel launches and host syncs of one decode step, per layer kind, and of
one DSpark round (target verify over the block, drafter ring rows, draft block).

Launch count is what bounds a real NPU (one 910C stack spends 85% of a step on ~2,900 launches),
and it depends on the layer schedule and expert fan-out, not on widths. So this runs the
DeepSeek-V4-Flash configuration (256 experts, top-6, the 3-stage DSpark drafter) with shrunken
widths, through the same checkpoint format, loader and generated code as any model, under the
capability guard, and counts every block's launches in a section of its layer kind. A layer's
launches depend on its kind only (the generated code is one function per kind), so the default
checkpoint keeps one backbone layer per kind the real schedule has (5 layers, ~4.5k tensors
instead of 36k) and the counts are scaled to the real 43-layer schedule;
`shrunk_flash(full_depth=True)` builds the whole schedule, which tests/planner/test_launches.py (slow)
checks gives the same counts. The step runs over the engine's paged cache (lib/runtime/paged_step.py):
`--batch B` prefills B sequences, then counts one decode step (and one DSpark round) of all B
together; the ops are batch-wide, so a step launches the same kernels at any B. Building the
step's addressing is host bookkeeping and is reported apart. `--record` keeps the counts in
data/decode-launches.json for the speed planner (lib/planner/speed.py); tests/planner/test_launches.py
fails when they go stale.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import NamedTuple

import torch

from lib.console.stages import Stages
from lib.emulation.relaxed import relaxed_widths
from lib.records.batch import make_batch
from lib.guard.capability import ONCE_PER_STEP, CapabilityGuard, rules_from_profile
from lib.engine.cache_sizing import blocks_for, make_store
from lib.runtime.loaded_model import load_model
from lib.runtime.paged_step import paged_step
from lib.weights.tiny_checkpoint import cache_root, make_tiny
from spec.config import RankConfig
from spec.fused import chosen
from spec.profile import load_profile
from spec.schedule import backbone, drafter_kind
from spec.tables import SPEC_DIR
from spec.variants import variant_config

RECORD = SPEC_DIR.parent / "data" / "decode-launches.json"

# flash-0731's schedule and expert counts with every width shrunk (launches do not depend on widths)
SHRUNK = {
    "vocab_size": 1024, "hidden_size": 128, "num_attention_heads": 8, "head_dim": 128, "q_lora_rank": 64,
    "o_lora_rank": 16, "index_n_heads": 4, "index_head_dim": 64, "moe_intermediate_size": 32,
    "dspark_markov_rank": 16, "dspark_noise_token_id": 15, "max_position_embeddings": 4096,
}
# one backbone layer of every kind flash-0731 has (SWA/hash, CSA/hash, HCA, CSA), then its 3 drafter stages
REDUCED_DEPTH = {"num_hidden_layers": 5, "compress_ratios": [0, 0, 4, 128, 4, 0, 0, 0],
                 "dspark_target_layer_ids": [2, 3, 4]}
PREFILL = 3      # the decode step runs at position 3, where a CSA (ratio 4) window completes


class KindRow(NamedTuple):
    kind: str          # "csa / learned"
    layers: int
    launches: int      # per layer
    syncs: int         # per layer


class LaunchReport(NamedTuple):
    backend: str
    rows: tuple[KindRow, ...]
    outside: int       # launches outside the blocks (embedding, hc_head, norm, head) and those made once per step
    total: int
    syncs: int
    # one DSpark round besides the decode step: "verify" (target forward over anchor + block),
    # "context" (drafter ring rows of committed positions), "draft" (the drafter's block); None
    # for a checkpoint without a DSpark drafter
    dspark: dict[str, int] | None = None
    batch: int = 1     # sequences that stepped together
    addressing: int = 0     # host ops building the decode step's Addressing (paged cache), not launches
    # of `total`: copies made by ops whose schema returns a view (a reshape or contiguous of rows that are strided,
    # a cast), the one part of a step that may grow with the batch (one row of a [T, k] expand is still a view)
    copies: int = 0


def shrunk_flash(full_depth: bool = False, stages: Stages | None = None) -> Path:
    """The shrunken Flash checkpoint (one layer per kind unless `full_depth`), made once into the
    cache (the official key set of its layers); `stages` says whether it is made or reused."""
    stages = stages or Stages.quiet()
    cfg = variant_config("flash-0731", SHRUNK if full_depth else {**SHRUNK, **REDUCED_DEPTH})
    tag = hashlib.sha256(repr(sorted(cfg.to_json_dict().items())).encode()).hexdigest()[:12]
    path = cache_root() / f"flash-shrunk-{tag}"
    what = f"the shrunk-width Flash-0731 checkpoint ({cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts)"
    if not (path / "config.json").exists():
        overrides = {k: v for k, v in cfg.to_json_dict().items() if k not in ("architectures", "model_type")}
        with stages(f"making {what} in {path} (once; cached)"):
            make_tiny(path, overrides=overrides, overwrite=True, shards=8, progress=True)
    else:
        stages.note(f"reusing {what} in {path}")
    return path


@contextlib.contextmanager
def _per_block_sections(module, guard: CapabilityGuard):
    original = module.block

    def block(lp, x, batch, cache, layer, cfg, rope):
        with guard.section(f"{layer.attention} / {layer.routing}"):
            return original(lp, x, batch, cache, layer, cfg, rope)

    module.block = block
    try:
        yield
    finally:
        module.block = original


def _greedy(logits, k):
    return logits.argmax(-1), None


def _kind_counts(cfg) -> dict[str, int]:
    layers: dict[str, int] = {}
    for layer in backbone(cfg):
        key = f"{layer.attention} / {layer.routing}"
        layers[key] = layers.get(key, 0) + 1
    return layers


def _prefilled(model, batch: int, gamma: int, spark: bool):
    """A paged cache of `batch` sequences of PREFILL positions each (and their drafter ring rows),
    prefilled together before anything is counted; room for a decode step or a verify after."""
    from lib.engine.drafting import context_rows

    store = make_store(model, blocks_for(model, batch, PREFILL + 1 + gamma), batch, rings=spark, slack=1 + gamma)
    ids = list(range(batch))
    for s in ids:
        store.add(s)
    prompts = make_batch([[20 + (s + i) % 100 for i in range(PREFILL)] for s in ids])   # routed differently
    _, hidden = paged_step(model, prompts, store, ids, with_hidden=True)
    if spark:
        rows = context_rows(model, hidden, prompts.positions)
        for s in ids:
            store.write_ring(s, 0, [r[s * PREFILL:(s + 1) * PREFILL] for r in rows])
    return store


class Counted(NamedTuple):
    """A model loaded to count launches on, and the schedule its counts are scaled to."""
    model: object          # lib.runtime.loaded_model.Model
    schedule: object       # spec.config.ModelConfig
    path: Path
    relaxed: bool = False  # fused kernels' width limits relaxed (the shrunk Flash runs Flash's fused path)


def load_counted(backend: str, path: Path | None = None) -> Counted:
    """The model at `path` on `backend`; by default the reduced-depth shrunk Flash, whose counts
    are scaled to the real flash-0731 schedule. The shrunk widths fail the fused kernels' width limits
    that Flash meets, so the shrunk model is loaded (and counted) with those relaxed for the emulation
    (lib/emulation/relaxed.py), and must then choose exactly the fused kernels Flash's own shapes choose."""
    if path is not None:
        model = load_model(path, backend, progress=True)
        return Counted(model, model.cfg, path)
    schedule, path = variant_config("flash-0731"), shrunk_flash()
    with relaxed_widths():
        model = load_model(path, backend, progress=True)
    flash = chosen(model.facts.fused, RankConfig.of(schedule))
    if model.cfg.fused != flash:
        raise AssertionError(f"{backend}: the shrunk Flash chose fused kernels {sorted(model.cfg.fused)} with "
                             f"widths relaxed, Flash's shapes choose {sorted(flash)}: a limit other than a width differs")
    return Counted(model, schedule, path, relaxed=True)


def count_launches(counted: Counted, batch: int = 1, with_round: bool = True) -> LaunchReport:
    """Counts of one decode step and (`with_round`, where the model drafts) one DSpark round of
    `batch` sequences stepping together. With batch-wide ops the kernels do not depend on `batch`, but for
    copies of rows that are strided only at more than one row (LaunchReport.copies);
    tests/planner/test_launches.py checks that for every backend."""
    if batch < 1:
        raise ValueError(f"--batch must be at least 1, got {batch}")
    with relaxed_widths() if counted.relaxed else contextlib.nullcontext():
        return _count(counted, batch, with_round)


def _count(counted: Counted, batch: int, with_round: bool) -> LaunchReport:
    from lib.engine.drafting import block_size, context_rows, propose

    model, schedule, path, _ = counted
    backend = model.backend
    spark = drafter_kind(model.cfg) == "dspark"
    gamma = block_size(model) if spark else 0
    store = _prefilled(model, batch, gamma, spark)
    ids = list(range(batch))
    guard = CapabilityGuard(rules_from_profile(load_profile(backend)), mode="count")
    # the batches are the scheduler's host-side input, made before the count (positions_of reads a length)
    decode = make_batch([[7]] * batch, [PREFILL] * batch, last_only=True)
    verify = make_batch([[7] + [model.cfg.dspark_noise_token_id] * gamma] * batch, [PREFILL] * batch)  # anchor + drafts
    with guard, _per_block_sections(model.module, guard):
        with guard.section("decode"):
            paged_step(model, decode, store, ids)
        if spark and with_round:
            for s in ids:       # the round starts from the state the decode step did (a one-position rewind)
                store.set_length(s, PREFILL)
            with guard.section("verify"):
                _, hid = paged_step(model, verify, store, ids, commit=False, with_hidden=True)
            with guard.section("context"):        # ring rows of each sequence's accepted anchor
                context_rows(model, hid[::1 + gamma], torch.full((batch,), PREFILL, dtype=torch.int64))
            with guard.section("draft"):
                propose(model, [7] * batch, store, ids, _greedy)
    sections = guard.report().sections
    held, real = _kind_counts(model.cfg), _kind_counts(schedule)
    if set(held) != set(real):
        raise ValueError(f"{path} has layer kinds {sorted(held)}, its schedule {sorted(real)}")

    def count_of(c, field: str) -> int:
        return _copies(c) if field == "copies" else getattr(c, field)

    def per_layer(part: str, kind: str, field: str) -> int:
        value, n = count_of(sections[f"{part}/{kind}"], field), held[kind]
        if value % n:
            raise AssertionError(f"{backend}: {n} '{kind}' layers made {value} {field} in {part}: not the same per layer")
        return value // n

    def once(part: str, field: str = "ops") -> int:
        """Launches outside the blocks, and those a step makes once in whichever layer first needs them (a tiling
        every layer of one shape reuses: lib/guard/capability.py ONCE_PER_STEP), never scaled by the layer count."""
        nested = (c for name, c in sections.items()
                  if name.startswith(f"{part}/") and name.endswith(f"/{ONCE_PER_STEP}"))
        return count_of(sections[part], field) + sum(count_of(c, field) for c in nested)

    def part_total(part: str, field: str = "ops") -> int:
        """A target forward on the real schedule: launches once per step + per layer x real layers."""
        return once(part, field) + sum(per_layer(part, k, field) * n for k, n in real.items())

    rows = tuple(KindRow(k, n, per_layer("decode", k, "ops"), per_layer("decode", k, "syncs")) for k, n in real.items())
    dspark = None
    if spark and with_round:      # the drafter's depth is the real one: its parts are plain sums
        dspark = {"verify": part_total("verify")}
        dspark |= {part: sum(c.ops for name, c in sections.items() if name.split("/")[0] == part)
                   for part in ("context", "draft")}
    return LaunchReport(backend, rows, once("decode"), part_total("decode"), part_total("decode", "syncs"),
                        dspark, batch, sections["decode/paged cache"].ops, part_total("decode", "copies"))


def _copies(c) -> int:
    """Launches in a guard section by aten ops whose schema returns a view (the guard counts one only when it
    copied: lib/guard/capability.py)."""
    def alias(op: str) -> bool:             # "aten.reshape.default"; a device op is a bare name
        parts = op.split(".")
        if len(parts) != 3 or parts[0] != "aten":
            return False
        return getattr(getattr(torch.ops.aten, parts[1]), parts[2]).is_view
    return sum(n for op, n in c.launches.items() if alias(op))


def format_report(r: LaunchReport) -> str:
    lines = [f"backend {r.backend}: one decode step of {r.batch} sequence(s) on the DeepSeek-V4-Flash schedule "
             f"(43 layers, 256 experts, top-6; widths shrunk)",
             f"  {'layer kind':<18} {'layers':>6} {'launches/layer':>15} {'syncs/layer':>12}"]
    lines += [f"  {row.kind:<18} {row.layers:>6} {row.launches:>15} {row.syncs:>12}" for row in r.rows]
    lines += [f"  {'outside / per step':<18} {'':>6} {r.outside:>15}",
              f"  total launches {r.total} ({r.copies} of them copies by view-schema ops: casts, strided reshapes), "
              f"host syncs {r.syncs}",
              f"  (besides: {r.addressing} host ops building the step's paged-cache addressing)"]
    if r.dspark:
        lines.append(f"  DSpark round: verify {r.dspark['verify']} + drafter ring rows {r.dspark['context']} + "
                     f"draft block {r.dspark['draft']} launches")
    return "\n".join(lines)


def as_record(r: LaunchReport, sixteen: LaunchReport) -> dict:
    """One backend's record: batch 1's counts, and the decode step of 16 sequences (`sixteen`)."""
    if (r.batch, sixteen.batch) != (1, 16) or r.backend != sixteen.backend:
        raise ValueError(f"a record is batch 1 and batch 16 of one backend, got {r.backend} batch {r.batch} and "
                         f"{sixteen.backend} batch {sixteen.batch}")
    return {"decode": r.total, "decode_batch16": sixteen.total, "host_syncs": r.syncs, "outside_blocks": r.outside,
            "per_layer_kind": {row.kind: {"layers": row.layers, "launches": row.launches} for row in r.rows},
            "dspark_round": r.dspark}


def record(reports: list[LaunchReport], sixteen: list[LaunchReport], path: Path = RECORD) -> Path:
    """Merge these backends' counts (batch 1, and `sixteen`: batch 16 of the same backends) into the record
    (atomically: a half-written record never loads)."""
    data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    data["doc"] = ("Kernel launches of one decode step and one DSpark round on the DeepSeek-V4-Flash-0731 schedule "
                   "with shrunk widths (lib/planner/launch_counts.py), per backend. Written by `dsv4gen plan --ops --record`; "
                   "read by `dsv4gen plan` (lib/planner/speed.py); tests/planner/test_launches.py checks it is fresh.")
    data.setdefault("backends", {}).update({r.backend: as_record(r, m) for r, m in zip(reports, sixteen, strict=True)})
    data["backends"] = dict(sorted(data["backends"].items()))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def recorded(backend: str, path: Path = RECORD) -> dict:
    """The recorded counts of `backend` (`dsv4gen plan --ops --record` writes them)."""
    data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {"backends": {}}
    if backend not in data["backends"]:
        raise ValueError(f"{path}: no recorded launch counts for backend {backend}; run "
                         f"`dsv4gen plan --ops --backend {backend} --record` (counting takes minutes)")
    return data["backends"][backend]
