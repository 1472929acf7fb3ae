"""Reference MoE (DSV4-REFERENCE §3.10): routers, clipped-SwiGLU experts, shared expert.

Routers return (weights [T, k], ids [T, k]) with weights already renormalised over the selected
experts and multiplied by routed_scaling_factor; the caller adds the shared expert once (B09).
Computed in fp64, rounded to fp32 (backends/cpu/ops/basic.py says why).
"""
from __future__ import annotations

import functools

import torch

from backends.cpu.ops.basic import wide
import torch.nn.functional as F

from lib.distributed import expert_exchange as ep
from lib.records.expert_placement import local_ids


def _scores(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """sqrt(softplus(W_g x)) (scoring_func sqrtsoftplus), fp64."""
    return torch.sqrt(F.softplus(x.to(wide.dtype) @ gate.to(wide.dtype).t()))


def _weights(scores: torch.Tensor, ids: torch.Tensor, route_scale: float) -> torch.Tensor:
    picked = scores.gather(1, ids)
    return (route_scale * picked / picked.sum(-1, keepdim=True)).float()


def route_hash(x: torch.Tensor, gate: torch.Tensor, tid2eid: torch.Tensor, tokens: torch.Tensor,
               route_scale: float):
    """Hash layers: experts = tid2eid[token] (B07), weights from the learned gate's scores."""
    ids = tid2eid.index_select(0, tokens).long()                         # [T, k]
    return _weights(_scores(x, gate), ids, route_scale), ids


def route_learned(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, topk: int, route_scale: float):
    """Learned layers: experts = top-k of scores + bias; the bias steers selection only (noaux_tc)."""
    scores = _scores(x, gate)
    ids = torch.topk(scores + bias.to(wide.dtype), topk, dim=-1).indices
    return _weights(scores, ids, route_scale), ids


def clipped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(min(gate, L)) * clamp(up, -L, L) (swiglu_limit; B08)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def _expert(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    """W2 (SiLU(min(W1 x, L)) * clamp(W3 x)) in fp64; w1, w3 [I, d], w2 [d, I]."""
    return clipped_swiglu(x @ w1.to(wide.dtype).t(), x @ w3.to(wide.dtype).t(), limit) @ w2.to(wide.dtype).t()


def swiglu_mlp(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    """The shared expert (weight 1)."""
    return _expert(x.to(wide.dtype), w1, w3, w2, limit).float()


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor,
                   w3: torch.Tensor, w2: torch.Tensor, placement, shared: torch.Tensor, limit: float) -> torch.Tensor:
    """shared + sum_e g_e * expert_e(x) over each token's selected experts; w1, w3 [E, I, d], w2 [E, d, I];
    shared [T, d] the shared expert's output (weight 1), added in fp64 to the routed sum rounded to fp32.

    `placement` (EP) decides where experts run, not what they compute: a process holding only its
    EP rank's experts computes their pairs' rows, and lib/distributed/expert_exchange.py brings every token its rows."""
    routed = ep.exchange(placement, x, weights, ids, ep.Experts(
        lambda xs, es: _routed_rows(xs, es, w1, w3, w2, placement, limit),
        functools.partial(ep.weighted_sum, out_dtype=torch.float32), wide.dtype, torch.float32))
    return (routed.to(wide.dtype) + shared.to(wide.dtype)).float()


def _routed_rows(x, ids, w1, w3, w2, placement, limit: float) -> torch.Tensor:
    """fp64 [T*k, d] expert rows of the (token, expert) pairs, t-major; zero for pairs whose expert
    another EP rank holds."""
    held = None
    if placement.ep_size > 1 and len(placement.ranks) == 1:     # one EP rank's share of a real EP group
        local = local_ids(ids, placement.local_of[placement.ranks[0]]).long()
        held = local < placement.n_local
        if w1.shape[0] == placement.n_local:        # only this rank's experts are loaded: local ids
            ids = local.clamp(max=placement.n_local - 1)
    x = x.to(wide.dtype)
    t, k = ids.shape
    if t * k < w1.shape[0]:
        rows = _pair_rows(x, ids, w1, w3, w2, limit)
    elif t <= DENSE_MAX_TOKENS:
        rows = _dense_rows(x, ids, w1, w3, w2, limit)
    else:                                      # only pairs whose expert this process holds
        rows = _hit_expert_rows(x, ids if held is None else torch.where(held, ids, -1), w1, w3, w2, limit)
    return rows if held is None else torch.where(held.reshape(-1, 1), rows, 0.0)


# Three ways to the same rows; which one runs follows from shapes alone, so a decode step stays
# free of host syncs (tests/planner/test_launches.py) and the choice never depends on the routing:
# - fewer pairs than experts (batch-1 decode): copy each pair's expert out of the fp64 weights;
# - a decode batch (up to DENSE_MAX_TOKENS tokens): every expert on every token, picked by id,
#   which reads each expert's weights once instead of copying one per pair;
# - a prefill chunk: one pass per expert hit, over its rows (the expert list is a host sync).
# Per-token results differ between them only in fp64 summation order, far below the fp32
# rounding of the combined output (basic.py).
DENSE_MAX_TOKENS = 64


def _pair_rows(x, ids, w1, w3, w2, limit: float) -> torch.Tensor:
    flat = ids.reshape(-1)
    xs = x.repeat_interleave(ids.shape[1], dim=0)                                       # [P, d]
    g1, g3, g2 = (w.index_select(0, flat) for w in (w1, w3, w2))                        # [P, ...]
    act = clipped_swiglu(torch.einsum("pd,pid->pi", xs, g1), torch.einsum("pd,pid->pi", xs, g3), limit)
    return torch.einsum("pi,pdi->pd", act, g2)


def _dense_rows(x, ids, w1, w3, w2, limit: float) -> torch.Tensor:
    act = clipped_swiglu(torch.einsum("td,eid->eti", x, w1), torch.einsum("td,eid->eti", x, w3), limit)
    every = torch.einsum("eti,edi->etd", act, w2)                                       # [E, T, d]
    token = torch.arange(ids.shape[0]).repeat_interleave(ids.shape[1])                 # [P]
    return every[ids.reshape(-1), token]


def _hit_expert_rows(x, run, w1, w3, w2, limit: float) -> torch.Tensor:
    k = run.shape[1]
    rows = x.new_zeros(run.numel(), x.shape[-1])
    for e in torch.unique(run[run >= 0]).tolist():
        token, slot = torch.where(run == e)
        rows.index_copy_(0, token * k + slot, _expert(x[token], w1[e], w3[e], w2[e], limit))
    return rows
