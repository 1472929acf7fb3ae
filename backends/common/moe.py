"""MoE composites shared by the device backends: routers, clipped SwiGLU, expert dispatch helpers.

Routers score in fp32 and return int32 expert ids (L13); "gathers" over the expert axis are
one-hot contractions (fixed shape, no int64 index tensors). Dispatch sorts (token, expert) pairs
by float keys and builds cumulative group lists (L07) without host syncs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from backends.common import dense
from lib.distributed import expert_exchange as ep
from lib.emulation.invariant_matmul import matmul
from lib.records.expert_placement import local_ids


def _scores(x, gate) -> torch.Tensor:
    return torch.sqrt(F.softplus(matmul(x.float(), gate.float().t())))                 # [T, E] fp32


def _pick(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """values[t, ids[t, j]] for [T, E] values and [T, k] int32 ids, as a one-hot contraction (no gather: a
    gather is an AI-CPU op on 310P, L14)."""
    onehot = ids[:, :, None] == dense.arange(values.shape[-1], torch.int32, values.device)[None, None, :]
    return (onehot * values[:, None, :]).sum(-1)


def pick_gathered(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """values[t, ids[t, j]] in one gather, for a device whose gather runs on the device itself; the same values
    as the one-hot contraction bit for bit (a product with one and sums of exact zeros)."""
    return torch.gather(values, 1, ids.long())


def _weights(scores, ids, route_scale, pick=_pick):
    picked = pick(scores, ids)
    return route_scale * picked / picked.sum(-1, keepdim=True)


def route_hash(x, gate, tid2eid, tokens, route_scale: float, pick=_pick):
    """Hash layers: experts = tid2eid[token] (B07); weights from the gate's scores of those experts."""
    ids = tid2eid.index_select(0, tokens.to(torch.int32)).to(torch.int32)
    return _weights(_scores(x, gate), ids, route_scale, pick), ids


def route_learned(x, gate, bias, topk: int, route_scale: float, pick=_pick):
    scores = _scores(x, gate)
    ids = torch.topk(scores + bias.float(), topk, dim=-1).indices.to(torch.int32)
    return _weights(scores, ids, route_scale, pick), ids


def clipped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(min(gate, L)) * clamp(up, -L, L) in fp32 (B08: the clamp keeps fp16 finite)."""
    return F.silu(gate.float().clamp(max=limit)) * up.float().clamp(-limit, limit)


def gate_up_swiglu(product, w1, w3, limit: float) -> torch.Tensor:
    """The clipped SwiGLU of an input's gate and up projections, `product(w)` being one projection of it. w3 None:
    w1 holds gate | up (profile merged_weights, layout halves), so one product makes both, widened to fp32 once
    (nothing to widen when it is fp32 already) and split in halves."""
    if w3 is None:
        return clipped_swiglu(*product(w1).float().chunk(2, dim=-1), limit)
    return clipped_swiglu(product(w1), product(w3), limit)


def valid_rows(group_list: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, 1] bool: rows a grouped matmul actually wrote (before the list's last cumulative end)."""
    return (dense.arange(rows, torch.int64, group_list.device) < group_list[-1])[:, None]


def grouped_moe(x, weights, ids, w1, w3, w2, placement, limit: float, *, init_routing, gmm, unpermute,
                dtype: torch.dtype, unpermute_multiple: int = 1, zero_tail: bool = True,
                merged_swiglu=None, combine=None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Routed experts through a device's routing / grouped-GEMM / unpermute ops, exchanged over the
    EP group when there is one (lib/distributed/expert_exchange.py). `zero_tail=False` leaves the rows
    past the group list as the kernel wrote them (L05): only conformance renders that, as B10. When w1 holds
    gate | up (a backend's merged weights, w3 None), `merged_swiglu` turns that GEMM's output [T*k, 2I] into the
    down GEMM's input (the backend knows the layout and may quantise there); by default its halves go through
    the fp32 clipped SwiGLU. `combine`: the device's own weighted sum of each token's pair rows [T*k, d] (t-major)
    with the router's weights [T, k], instead of its unpermute op, returning `out_dtype` (default `dtype`)."""
    def rows(xs, es):
        return _grouped_rows(xs, es, w1, w3, w2, placement, limit, init_routing=init_routing, gmm=gmm, dtype=dtype,
                             zero_tail=zero_tail, merged_swiglu=merged_swiglu)

    def unpermuted(pair_rows, ws):
        return _combine(pair_rows, ws, unpermute=unpermute, dtype=dtype, unpermute_multiple=unpermute_multiple)
    return ep.exchange(placement, x, weights, ids, ep.Experts(rows, combine or unpermuted, dtype, out_dtype or dtype))


def _grouped_rows(x, ids, w1, w3, w2, placement, limit: float, *, init_routing, gmm, dtype: torch.dtype,
                  zero_tail: bool = True, merged_swiglu=None) -> torch.Tensor:
    """[T*k, d] expert rows of the (token, expert) pairs, t-major, for the EP ranks this process runs
    (one normally; all when EP is simulated); zero rows for pairs held elsewhere. Per rank: local
    ids with a dummy slot (L06), cumulative group list (L07), tail rows zeroed (L05): a pair routed
    to the dummy slot reads a zeroed tail row, so adding the ranks' rows is exact."""
    from lib.records.expert_placement import rank_experts

    t, k = ids.shape
    out = None
    for rank in placement.ranks:
        m1, m3, m2 = (None if w is None else rank_experts(w, placement, rank) for w in (w1, w3, w2))
        local = local_ids(ids, placement.local_of[rank])
        expanded, row_idx, cumsum, _ = init_routing(
            x.to(dtype), local, active_num=t * k, expert_num=placement.n_local + 1, expert_tokens_num_type=0,
            expert_tokens_num_flag=True)
        group_list = cumsum[:placement.n_local]                    # the dummy slot is not computed
        if m3 is None and merged_swiglu is not None:     # w1 holds gate | up in the backend's own layout
            act = merged_swiglu(gmm(expanded, m1, group_list))
        else:
            act = gate_up_swiglu(lambda w: gmm(expanded, w, group_list), m1, m3, limit).to(dtype)
        down = gmm(act, m2, group_list)                            # [T*k, d], sorted by local expert
        if zero_tail:                # False only to re-introduce B10 (conformance)
            down = torch.where(valid_rows(group_list, down.shape[0]), down, 0.0)
        mine = down.index_select(0, row_idx)                       # pair p's row (row_idx: [pair] -> row)
        out = mine if out is None else out + mine                  # a pair's row is zero on every other rank
    return out


def _combine(rows, weights, *, unpermute, dtype: torch.dtype, unpermute_multiple: int) -> torch.Tensor:
    """Each token's weighted sum of its k pair rows [T*k, d] (t-major) with the device's unpermute
    op (identity order); a hidden size the op refuses falls back to an fp32 sum (L08)."""
    t, k = weights.shape
    if rows.shape[-1] % unpermute_multiple == 0:
        return unpermute(rows, dense.arange(t * k, torch.int32, rows.device), weights.to(dtype))
    return (rows.float().reshape(t, k, -1) * weights.float().unsqueeze(-1)).sum(1).to(dtype)


def add_shared(routed: torch.Tensor, shared: torch.Tensor, shared_weight: float = 1.0) -> torch.Tensor:
    """routed + shared_weight * shared in the routed rows' dtype, one kernel. The model's weight is 1 (the route
    scale is the routed part's alone); `shared_weight` is a fault site, conformance renders B09 through it."""
    return torch.add(routed, shared.to(routed.dtype), alpha=shared_weight)
