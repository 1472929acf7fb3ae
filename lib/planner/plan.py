"""`dsv4gen plan`: one deployment's memory and speed, assembled from the planner's parts.

Weights (lib/planner/memory.py), caches (lib/planner/cache_layout.py) and speed (lib/planner/speed.py) are each
derived from the spec and the backend profile; this module only budgets device memory between
them (vLLM's rule: a memory fraction of the device, less weights, workspace and runtime reserve,
is the KV pool) and lays the result out as the JSON `dsv4gen plan --json` prints.
"""
from __future__ import annotations

from typing import NamedTuple

from lib.planner import cache_layout as plan_cache

from lib.planner import memory as plan_memory

from lib.planner import speed as plan_speed
from lib.planner.memory import Deployment
from spec.schedule import drafter_kind
from spec.variants import variant_config


class Plan(NamedTuple):
    deployment: Deployment
    weights: plan_memory.Weights
    workspace: int                  # run-time expert conversion buffer
    reserve: int                    # the device's runtime reserve
    budget: int                     # memory_fraction x device memory
    pool_requested: int             # the KV pool the budget leaves (negative: the weights do not fit)
    layout: plan_cache.CacheLayout
    capacity: plan_cache.Capacity
    preconverted: plan_memory.Preconverted
    speed: plan_speed.SpeedPlan     # the prediction: eager, or captured under --graph-mode
    device: object                  # spec.hardware.Device
    eager: plan_speed.SpeedPlan | None = None      # every launch eager
    captured: plan_speed.SpeedPlan | None = None   # the step replayed as one captured graph (None: no capture)
    graph_mode: bool = False

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
    layout = plan_cache.layout(d.backend, cfg, d.speculative and drafter_kind(cfg) == "dspark", d.max_num_seqs)
    capacity = plan_cache.capacity(layout, pool, d.max_model_len)
    at = context or d.max_model_len
    eager = plan_speed.speed(d, weights, layout, at, acceptance)
    captured = plan_speed.speed(d, weights, layout, at, acceptance, graph=True) if device.graph_launch_s else None
    if graph_mode and captured is None:
        raise ValueError(f"--graph-mode: {d.backend} has no captured decode step ({device.no_graph})")
    return Plan(d, weights, workspace, reserve, budget, pool, layout, capacity, plan_memory.preconverted(d),
                captured if graph_mode else eager, device, eager, captured, graph_mode)


def _terms(step: plan_speed.StepTime | None) -> dict | None:
    if step is None:
        return None
    return {"bytes_read": step.bytes_read, "memory_s": step.memory_s, "launches": step.launches,
            "launch_s": step.launch_s, "collectives": step.collectives, "collective_s": step.collective_s,
            "seconds": step.seconds}


def as_json(p: Plan) -> dict:
    s = p.speed
    return {
        "deployment": p.deployment._asdict(),
        "device": {name: {"value": num.value, "basis": num.basis, "source": num.source}
                   for name in p.device.__struct_fields__ if name not in ("doc", "no_graph")
                   for num in [getattr(p.device, name)] if num is not None},
        "graph_mode": p.graph_mode,
        "tokens_per_second_eager_and_captured": {
            mode: None if sp is None else {"plain": 1 / sp.plain.seconds,
                                           "dspark": 1 / sp.dspark_per_token_s if sp.verify else None}
            for mode, sp in (("eager", p.eager), ("captured", p.captured))},
        "weights_bytes_per_device": p.weights.rollup(),
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
        "kv_capacity_limited_by": p.capacity.limited_by,
        "engine_num_blocks": p.capacity.num_blocks,
        "memory": {"device": p.device_memory, "budget": p.budget, "workspace": p.workspace, "reserve": p.reserve,
                   "occupied": p.occupied, "fits": p.fits},
        "preconverted_checkpoint_bytes": p.preconverted.total_bytes,
        "preconverted_checkpoint_shards": p.preconverted.shards_per_rank * p.preconverted.ranks,
        "convert_output_bytes": p.preconverted.convert_output_bytes,
        "decode_step_seconds": {"context": s.context, "plain": s.plain.seconds, "dspark_round": s.round_s,
                                "dspark_per_token": s.dspark_per_token_s, "acceptance": s.acceptance,
                                "tokens_per_round": s.tokens_per_round if s.verify else None,
                                "terms": {"plain": _terms(s.plain), "verify": _terms(s.verify),
                                          "draft": _terms(s.draft)}},
        "tokens_per_second": {"plain": 1 / s.plain.seconds,
                              "dspark": 1 / s.dspark_per_token_s if s.verify else None},
    }
