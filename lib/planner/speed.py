"""Predicted single-stream decode speed: bytes read / memory bandwidth + kernel launches x launch
latency + collectives, for one plain decode step and for one DSpark round, eager (a launch costs the
profile's launch_latency_s) or captured (a kernel of a replayed graph costs its graph_launch_s).

Decode of one sequence is never compute-bound here (the 310P field saw the AI Core 4.2% busy and
HBM 2.2% used, seeds/000), so three terms remain and are added, not overlapped: an upper bound
for an eager stack, where the host issues launches while the device streams weights. Launch
counts are the recorded `dsv4gen plan --ops` counts of this runtime's generated code
(data/decode-launches.json); collectives follow the tensors.yaml TP/EP splits. Knows no backend
by name; device numbers come from the profile's `device:` section.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from lib.planner.launch_counts import recorded
from lib.planner.cache_layout import CacheLayout
from lib.planner.memory import Deployment, Weights
from spec.profile import load_profile
from spec.schedule import backbone, drafter
from spec.variants import variant_config

GATHERED = ("embedding", "hash_table")      # read one row per token, not streamed whole
LOGIT_BYTES = 4                             # logits are fp32 (DSV4-REFERENCE §3.4)


class StepTime(NamedTuple):
    bytes_read: int
    memory_s: float
    launches: int
    launch_s: float
    collectives: int
    collective_s: float

    @property
    def seconds(self) -> float:
        return self.memory_s + self.launch_s + self.collective_s


class SpeedPlan(NamedTuple):
    context: int                # context length the KV reads are sized at
    plain: StepTime             # one decode step: one token
    verify: StepTime | None     # DSpark: target forward over anchor + block
    draft: StepTime | None      # DSpark: drafter ring rows + draft block
    acceptance: float           # accepted / drafted, the field's measure (310P: 137/285)
    block: int                  # drafts per round (dspark_block_size)

    @property
    def tokens_per_round(self) -> float:
        return 1 + self.acceptance * self.block    # accepted drafts plus the target's own token

    @property
    def round_s(self) -> float | None:
        return None if self.verify is None else self.verify.seconds + self.draft.seconds

    @property
    def dspark_per_token_s(self) -> float | None:
        return None if self.round_s is None else self.round_s / self.tokens_per_round


def touched(n_local: int, n_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct local experts `tokens` tokens route to (each picks top_k of n_experts)."""
    return n_local * (1 - (1 - top_k / n_experts) ** tokens)


def _expert_bytes(w: Weights, scope: str | None, tokens: int, cfg, layers: int) -> float:
    """Routed-expert traffic of `layers` MoE layers: the GEMMs read the touched experts; a format
    converted at run time also reads the held experts it converts and writes their converted form."""
    hit = touched(w.n_local, cfg.n_routed_experts, cfg.num_experts_per_tok, tokens)
    if not w.converted_expert_bytes:
        return layers * hit * w.expert_bytes
    converted = w.n_local if scope == "all_local" else hit
    return layers * (converted * (w.expert_bytes + w.converted_expert_bytes) + hit * w.converted_expert_bytes)


Message = tuple[str, int, int]       # ("all_reduce" | "all_gather" | "all_to_all", bytes sent, group size)


def _tp(d: Deployment, kind: str, size: int) -> list[Message]:
    """A reduction over the TP group (split heads, vocab rows or wo_b columns); none without TP."""
    return [(kind, size, d.tp)] if d.tp > 1 else []


def _moe(d: Deployment, tokens: int, hidden: int, top_k: int) -> list[Message]:
    """The MoE exchange of lib/distributed/expert_exchange.py, as the profile's `ep_dispatch` picks it. allgather: every rank
    runs its experts on every token and one all-reduce sums. alltoall: a rank's slice of the tokens
    sends its (token, expert) pairs to the experts' ranks and gets the weighted rows back in fp64
    (each all-to-all first swaps row counts), then the slices are all-gathered in fp64. Every
    collective is priced at the profile's one link bandwidth, also where its group spans nodes."""
    group = d.ep if d.ep > 1 else d.tp      # the EP group exchanges; without EP the TP group sums
    if group == 1:
        return []
    act = _act_bytes(d)
    if d.ep == 1 or load_profile(d.backend).ep_dispatch.mode == "allgather":
        return [("all_reduce", tokens * hidden * act, group)]
    slice_rows = -(-tokens // group)
    pairs, counts = slice_rows * top_k, 8 * group
    return [("all_to_all", counts, group), ("all_to_all", pairs * hidden * act, group),       # rows out
            ("all_to_all", counts, group), ("all_to_all", pairs * 2 * 8, group),             # weights, ids
            ("all_to_all", counts, group), ("all_to_all", pairs * hidden * 8, group),        # rows back
            ("all_gather", group * slice_rows * hidden * 8, group)]


def _collectives(device, messages: list[Message]) -> float:
    """Ring all-reduce moves 2(g-1)/g of the message per device, all-gather (g-1)/g; each call
    also pays the device's fixed collective latency."""
    seconds = 0.0
    for kind, size, group in messages:
        share = 2 * (group - 1) / group if kind == "all_reduce" else (group - 1) / group
        seconds += device.collective_latency_s.value + size * share / device.link_bandwidth_bytes_per_s.value
    return seconds


def _act_bytes(d: Deployment) -> int:
    """Bytes of one activation element: the profile's compute dtype travels in the collectives."""
    return getattr(torch, load_profile(d.backend).compute_dtype).itemsize


def _conversion_scope(d: Deployment) -> str | None:
    conversion = load_profile(d.backend).expert_conversion
    return conversion.scope if conversion else None


def per_launch(device, graph: bool) -> float:
    """Seconds one kernel costs: an eager launch, or a kernel of a replayed captured graph."""
    if not graph:
        return device.launch_latency_s.value
    if device.graph_launch_s is None:
        raise ValueError(f"no captured decode step on this device: {device.no_graph}")
    return device.graph_launch_s.value


def _step(d: Deployment, device, bytes_read: float, launches: int, messages: list[Message],
          graph: bool = False) -> StepTime:
    count, comm = len(messages), _collectives(device, messages)
    return StepTime(int(bytes_read), bytes_read / device.memory_bandwidth_bytes_per_s.value, launches,
                    launches * per_launch(device, graph), count, comm)


def _target(d: Deployment, w: Weights, lay: CacheLayout, context: int, tokens: int, launches: int, device,
            graph: bool = False) -> StepTime:
    cfg, scope = variant_config(d.variant), _conversion_scope(d)
    layers = backbone(cfg)
    dense = sum(c.data + c.scale for c in w.target if c.tensor_class not in (*GATHERED, "routed_expert"))
    csa_ratio = next((layer.ratio for layer in layers if layer.attention == "csa"), 4)
    entries = context // csa_ratio
    per, row = lay.per_token, lay.ring_row
    kv = (min(context, cfg.sliding_window) * row["window_ring"]                  # the window's live rows
          + context * (per["indexer_keys"] + per["hca_entries"])                # every key scored, every HCA entry
          + min(cfg.index_topk, entries) * csa_ratio * per["csa_entries"])      # the selected CSA entries
    hidden = tokens * cfg.hidden_size * _act_bytes(d)
    messages = _tp(d, "all_reduce", hidden)                                  # embedding (vocab rows split)
    for layer in layers:
        messages += _tp(d, "all_reduce", hidden)                            # attention output (wo_b)
        messages += _moe(d, tokens, cfg.hidden_size, cfg.num_experts_per_tok)
        if layer.attention == "csa":
            # the indexer's split heads (queries and head weights, one gather), not its scores
            messages += _tp(d, "all_gather", tokens * cfg.index_n_heads * (cfg.index_head_dim + 1) * _act_bytes(d))
    messages += _tp(d, "all_gather", tokens * cfg.vocab_size * LOGIT_BYTES)   # head (vocab rows split)
    experts = _expert_bytes(w, scope, tokens, cfg, len(layers))
    return _step(d, device, dense + experts + kv, launches, messages, graph)   # one sequence: its KV is read once


def _draft(d: Deployment, w: Weights, lay: CacheLayout, context: int, launches: int, device,
           graph: bool = False) -> StepTime:
    cfg, scope = variant_config(d.variant), _conversion_scope(d)
    stages, gamma = drafter(cfg), cfg.dspark_block_size
    dense = sum(c.data + c.scale for c in w.draft if c.tensor_class != "routed_expert")
    head = sum(c.data for c in w.target if c.tensor_class == "head")         # the drafter shares the target's head
    rings = min(context, cfg.sliding_window) * lay.ring_row["draft_rings"]     # read once for the whole block
    hidden = gamma * cfg.hidden_size * _act_bytes(d)
    messages = (_tp(d, "all_reduce", hidden) + _moe(d, gamma, cfg.hidden_size, cfg.num_experts_per_tok)) * len(stages)
    messages += _tp(d, "all_gather", gamma * cfg.vocab_size * LOGIT_BYTES)
    experts = _expert_bytes(w, scope, gamma, cfg, len(stages))
    return _step(d, device, dense + head + experts + rings, launches, messages, graph)


def speed(d: Deployment, w: Weights, lay: CacheLayout, context: int, acceptance: float, graph: bool = False,
          counts: dict | None = None) -> SpeedPlan:
    """The predicted decode of one sequence: eager launches, or (`graph`) the kernels of a replayed
    captured step. `counts`: launch counts in data/decode-launches.json's form ({"decode": n,
    "dspark_round": {...}}), by default this runtime's recorded ones; the calibration passes the
    field's own."""
    if not 0 <= acceptance <= 1:
        raise ValueError(f"--acceptance must be in [0, 1] (accepted drafts / drafted), got {acceptance:g}")
    if context < 1:
        raise ValueError(f"--context must be at least 1, got {context}")
    device = load_profile(d.backend).device
    counts = counts or recorded(d.backend)
    cfg = variant_config(d.variant)
    plain = _target(d, w, lay, context, 1, counts["decode"], device, graph)
    spark = counts.get("dspark_round") if d.speculative else None
    if not spark or cfg.dspark_block_size is None:
        return SpeedPlan(context, plain, None, None, acceptance, 0)
    gamma = cfg.dspark_block_size
    verify = _target(d, w, lay, context, gamma + 1, spark["verify"], device, graph)
    draft = _draft(d, w, lay, context, spark["context"] + spark["draft"], device, graph)
    return SpeedPlan(context, plain, verify, draft, acceptance, gamma)
