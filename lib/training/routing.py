"""Expert load balancing without an auxiliary loss, as DeepSeek-V3 and V4 train their learned routers (noaux_tc).

A learned layer picks its top-k experts by score + bias, and the bias only steers that choice. No gradient reaches
it: after each optimiser step, each learned layer's bias rises by BIAS_RATE for every expert that took fewer than
the mean number of tokens in that step and falls by it for every expert that took more, so that experts stay in use
without a loss term pulling the scores. Installed for the forwards of one batch by `balancing()`, which wraps the reference
backend's `route_learned` to count the tokens each expert was chosen for. Hash layers route by token id and are left
alone. Must not know the optimiser or the task mix.
"""
from __future__ import annotations

import contextlib

import torch

import backends.cpu.ops.moe as reference_moe
from lib.training.data_parallel import Share

BIAS_RATE = 1e-3           # DeepSeek-V3's bias update speed


class Loads:
    """Tokens routed to each expert of each learned layer in one batch's forwards, keyed by the layer's bias tensor
    (a shared prompt opening's tokens once: lib/training/target.py prefill)."""

    def __init__(self):
        self.counts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}     # id(bias) -> (bias, tokens per expert)

    def add(self, bias: torch.Tensor, ids: torch.Tensor) -> None:
        counts = torch.bincount(ids.reshape(-1), minlength=bias.shape[0]).to(torch.float64)
        if id(bias) in self.counts:
            counts = counts + self.counts[id(bias)][1]
        self.counts[id(bias)] = (bias, counts)

    @torch.no_grad()
    def update_biases(self, share: Share = Share()) -> None:
        """Each bias one BIAS_RATE step towards balance; `share` (lib/training/data_parallel.py): the loads
        are summed over the ranks first, so every rank moves its biases alike."""
        entries = list(self.counts.values())
        if share.group is not None and entries:
            summed = share.sum(torch.cat([c for _, c in entries])).split([len(c) for _, c in entries])
            entries = [(bias, c) for (bias, _), c in zip(entries, summed)]
        for bias, counts in entries:
            bias += BIAS_RATE * torch.sign(counts.mean() - counts).to(bias.dtype)


@contextlib.contextmanager
def balancing():
    """Count the experts the learned routers choose in the reference forwards run inside."""
    loads = Loads()
    route = reference_moe.route_learned

    def route_learned(x, gate, bias, topk, route_scale):
        weights, ids = route(x, gate, bias, topk, route_scale)
        loads.add(bias, ids)
        return weights, ids

    reference_moe.route_learned = route_learned
    try:
        yield loads
    finally:
        reference_moe.route_learned = route
