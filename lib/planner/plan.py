"""`dsv4gen plan`: one deployment's memory and speed, assembled from the planner's parts.

Weights (lib/planner/memory.py), caches (lib/planner/cache_layout.py) and speed (lib/planner/speed.py) are each
derived from the spec and the backend profile; this module only budgets device memory between
them (vLLM's rule: a memory fraction of the device, less weights, workspace and runtime reserve,
is the KV pool), says what does not fit and why, and lays the result out as the JSON `dsv4gen plan
--json` prints. The KV pool is per device; every TP rank of a data-parallel attention replica holds
the replica's whole cache (one shared KV head), so context tokens are per replica, DP times that in all.
"""
from __future__ import annotations

from typing import NamedTuple

from lib.planner import cache_layout as plan_cache

from lib.planner import memory as plan_memory

from lib.planner import speed as plan_speed
from lib.planner.memory import Deployment
from lib.planner.shared_kv_layout import SharedKVLayout, shared_kv_layout
from spec.schedule import drafter_kind
from spec.variants import variant_config

GIB = 1 << 30


# model generations (config model_type) whose decode step the recorded launch counts describe
COUNTED_GENERATIONS = ("deepseek_v4",)

class Plan(NamedTuple):
    deployment: Deployment
    weights: plan_memory.Weights
    workspace: int                  # run-time expert conversion buffer
    reserve: int                    # the device's runtime reserve
    budget: int                     # memory_fraction x device memory
    pool_requested: int             # the KV pool the budget leaves (negative: the weights do not fit)
    layout: plan_cache.CacheLayout | SharedKVLayout     # SharedKVLayout: V4.1's shared compressed KV
    capacity: plan_cache.Capacity
    preconverted: plan_memory.Preconverted
    speed: plan_speed.SpeedPlan | None      # the prediction: eager, or captured under --graph-mode (None: V4.1)
    device: object                  # spec.hardware.Device
    eager: plan_speed.SpeedPlan | None = None      # every launch eager
    captured: plan_speed.SpeedPlan | None = None   # the step replayed as one captured graph (None: no capture)
    graph_mode: bool = False
    runtime_refusal: str | None = None              # why the runtime cannot launch this layout (None: it can)
    # why no decode step is predicted (V4.1: the recorded launch counts are V4-Flash's schedule's): memory only
    no_speed: str | None = None
    host: tuple[plan_memory.HostTables, ...] = ()   # tensors held in host memory (V4.1's Engram tables)

    @property
    def weights_bytes(self) -> int:
        return self.weights.rollup()["total"]

    @property
    def fits(self) -> bool:
        return self.pool_requested >= 0 and self.occupied <= self.device_memory

    @property
    def device_memory(self) -> int:
        return int(self.device.memory_bytes.value)

    @property
    def occupied(self) -> int:
        """What the device would show in use: weights, workspace, reserve and the KV pool."""
        return self.weights_bytes + self.workspace + self.reserve + self.capacity.pool_bytes

    @property
    def tokens_total(self) -> int:
        """Context tokens over every data-parallel attention replica."""
        return self.capacity.tokens * self.deployment.dp

    @property
    def sequences_total(self) -> int:
        return self.capacity.sequences * self.deployment.dp

    @property
    def does_not_fit(self) -> str | None:
        """Why the deployment cannot serve one sequence of max_model_len per device, or None when it can.
        The first shortfall in load order: weights, then the KV pool, then one sequence."""
        d, c, lay = self.deployment, self.capacity, self.layout
        pool = f"the KV pool of {gib(c.pool_bytes)} per device"
        pool += " (--kv-cache-bytes)" if d.kv_cache_bytes is not None else ""
        share = f"{d.memory_fraction:g} x {gib(self.device_memory)} = {gib(self.budget)}"
        if d.kv_cache_bytes is None and self.weights_bytes > self.budget:
            return f"weights {gib(self.weights_bytes)} per device > {share}"
        if d.kv_cache_bytes is None and self.pool_requested < 0:
            parts = [f"weights {gib(self.weights_bytes)}"]
            parts += [f"workspace {gib(self.workspace)}"] if self.workspace else []
            need = self.weights_bytes + self.workspace + self.reserve
            return (f"{' + '.join(parts)} + reserve {gib(self.reserve)} = {gib(need)} per device > {share}: "
                    f"no room for a KV pool")
        if self.occupied > self.device_memory:
            return (f"weights {gib(self.weights_bytes)} + workspace {gib(self.workspace)} + reserve "
                    f"{gib(self.reserve)} + KV pool {gib(c.pool_bytes)} (--kv-cache-bytes) = {gib(self.occupied)} "
                    f"per device > device memory {gib(self.device_memory)}")
        if c.limited_by == "pool":
            return (f"{pool} holds not even the ring slots of {lay.max_seqs} sequences + 1 trash slot and one "
                    f"block of {lay.block_tokens} positions ({gib(lay.total_bytes(1))})")
        if c.sequences == 0:
            return (f"{pool} holds {c.tokens:,} context tokens, not one sequence of --max-model-len "
                    f"{d.max_model_len:,} ({c.sequence_length:,} positions x {lay.kv_bytes_per_token:,.0f} bytes = "
                    f"{gib(c.sequence_length * lay.kv_bytes_per_token)})")
        return None


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def make_plan(d: Deployment, context: int | None = None, acceptance: float = 0.5, graph_mode: bool = False) -> Plan:
    """`graph_mode`: the prediction is the captured step (vLLM's default; `--enforce-eager` serves the
    eager one); both are computed where the device can capture."""
    profile = plan_memory.check_deployment(d)
    device = profile.device
    weights = plan_memory.weights(d)
    workspace = plan_memory.workspace_bytes(d, weights)
    reserve = int(device.runtime_reserve_bytes.value)
    budget = int(device.memory_bytes.value * d.memory_fraction)
    pool = d.kv_cache_bytes if d.kv_cache_bytes is not None else budget - weights.rollup()["total"] - workspace - reserve
    cfg = variant_config(d.variant)
    speculative = d.speculative and drafter_kind(cfg) != "none"
    no_speed = None if cfg.model_type in COUNTED_GENERATIONS else (
        f"the recorded launch counts (data/decode-launches.json) are of DeepSeek-V4-Flash's schedule, not of "
        f"{cfg.model_type}'s own ops and shared-KV layers")
    if cfg.kv_source_layer_ids is not None:     # V4.1's shared KV: spec/shared_kv.yaml's formats, not STATE
        layout = shared_kv_layout(d.backend, cfg, speculative, d.max_num_seqs, plan_cache.slack_of(cfg, speculative))
    else:
        layout = plan_cache.layout(d.backend, cfg, speculative, d.max_num_seqs)
    capacity = plan_cache.capacity(layout, pool, d.max_model_len)
    host = plan_memory.host_tables(d)
    if no_speed is not None:                    # no launch counts of this generation: memory only
        return Plan(d, weights, workspace, reserve, budget, pool, layout, capacity, plan_memory.preconverted(d),
                    None, device, None, None, graph_mode, plan_memory.runtime_refusal(d), no_speed, host)
    at = context or d.max_model_len
    eager = plan_speed.speed(d, weights, layout, at, acceptance)
    captured = plan_speed.speed(d, weights, layout, at, acceptance, graph=True) if device.graph_launch_s else None
    if graph_mode and captured is None:
        raise ValueError(f"--graph-mode: {d.backend} has no captured decode step ({device.no_graph})")
    return Plan(d, weights, workspace, reserve, budget, pool, layout, capacity, plan_memory.preconverted(d),
                captured if graph_mode else eager, device, eager, captured, graph_mode,
                plan_memory.runtime_refusal(d), None, host)


def nodes_that_fit(p: Plan, most: int = 64) -> Plan | None:
    """The plan on the fewest more nodes of the same size where it fits, TP kept and EP (when it spans
    every device) grown with them; None when no such layout fits within `most` nodes."""
    d = p.deployment
    n_experts = variant_config(d.variant).n_routed_experts
    if d.kv_cache_bytes is not None or d.ep != d.devices:       # more nodes would not shrink what is short
        return None
    for nodes in range(d.nodes + 1, most + 1):
        devices = nodes * d.devices_per_node
        ep = devices if d.ep == d.devices else d.ep
        if devices % d.tp or ep > n_experts or n_experts % ep:
            continue
        wider = make_plan(d._replace(nodes=nodes, devices=devices, ep=ep))
        if wider.does_not_fit is None:
            return wider
    return None


def _terms(step: plan_speed.StepTime | None) -> dict | None:
    if step is None:
        return None
    return {"bytes_read": step.bytes_read, "memory_s": step.memory_s, "launches": step.launches,
            "launch_s": step.launch_s, "collectives": step.collectives, "collective_s": step.collective_s,
            "seconds": step.seconds}


def as_json(p: Plan) -> dict:
    s = p.speed
    out = {
        "deployment": p.deployment._asdict(),
        "layout": {"nodes": p.deployment.nodes, "devices_per_node": p.deployment.devices_per_node,
                   "tp": p.deployment.tp, "dp": p.deployment.dp, "ep": p.deployment.ep,
                   "routed_experts_per_device": p.weights.n_local,
                   "launchable": p.runtime_refusal is None, "planning_only_reason": p.runtime_refusal,
                   "no_speed": p.no_speed},
        "fits": p.does_not_fit is None,
        "does_not_fit": p.does_not_fit,
        "device": {name: {"value": num.value, "basis": num.basis, "source": num.source}
                   for name in p.device.__struct_fields__ if name not in ("doc", "no_graph")
                   for num in [getattr(p.device, name)] if num is not None},
        "graph_mode": p.graph_mode,
        "host_bytes": {h.tensor_class: {"placement": h.placement, "total": h.total, "per_host": h.per_host,
                                        "per_rank": h.per_rank,
                                        "tables": {t.key: {"rows": t.rows, "row_bytes": t.row_bytes, "total": t.total,
                                                           "per_rank": t.per_rank} for t in h.tables}}
                       for h in p.host},
        "tokens_per_second_eager_and_captured": {
            mode: None if sp is None else {"plain": 1 / sp.plain.seconds,
                                           "dspark": 1 / sp.dspark_per_token_s if sp.verify else None}
            for mode, sp in (("eager", p.eager), ("captured", p.captured))},
        "weights_bytes_per_device": p.weights.rollup(),
        "weights_bytes_per_device_by_split": p.weights.by_split(),
        "weights_by_class": {f"{role}:{c.tensor_class}": {"format": c.runtime_format, "data": c.data, "scale": c.scale}
                             for role, classes in (("target", p.weights.target), ("draft", p.weights.draft))
                             for c in classes},
        "kv_bytes_per_token": p.layout.kv_bytes_per_token,
        "kv_fixed_bytes_per_sequence": p.layout.kv_fixed_bytes_per_sequence,
        "kv_bytes_per_token_by_kind": p.layout.per_token,
        "kv_fixed_bytes_per_sequence_by_kind": p.layout.per_sequence,
        "kv_slack": p.layout.slack,
        "kv_pool_bytes": p.capacity.pool_bytes,
        "kv_allocated_bytes": p.capacity.allocated_bytes,
        "kv_capacity_tokens": p.capacity.tokens,
        "kv_capacity_sequences": p.capacity.sequences,
        "kv_capacity_tokens_total": p.tokens_total,             # over the DP attention replicas
        "kv_capacity_sequences_total": p.sequences_total,
        "kv_capacity_limited_by": p.capacity.limited_by,
        "engine_num_blocks": p.capacity.num_blocks,
        "memory": {"device": p.device_memory, "budget": p.budget, "workspace": p.workspace, "reserve": p.reserve,
                   "occupied": p.occupied, "fits": p.fits},
        "preconverted_checkpoint_bytes": p.preconverted.total_bytes,
        "preconverted_checkpoint_shards": p.preconverted.shards_per_rank * p.preconverted.ranks,
        "convert_output_bytes": p.preconverted.convert_output_bytes,
    }
    if s is None:           # no launch counts of this generation (V4.1): no decode step is predicted
        return {**out, "decode_step_seconds": None, "tokens_per_second": None}
    return {**out,
            "decode_step_seconds": {"context": s.context, "plain": s.plain.seconds, "dspark_round": s.round_s,
                                    "dspark_per_token": s.dspark_per_token_s, "acceptance": s.acceptance,
                                    "tokens_per_round": s.tokens_per_round if s.verify else None,
                                    "terms": {"plain": _terms(s.plain), "verify": _terms(s.verify),
                                              "draft": _terms(s.draft)}},
            "tokens_per_second": {"plain": 1 / s.plain.seconds,
                                  "dspark": 1 / s.dspark_per_token_s if s.verify else None}}
