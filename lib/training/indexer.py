"""The lightning indexer trained the way DeepSeek's sparse attention trains it: distilled from the attention it
serves.

The indexer's top-k passes no gradient, so its weights learn only from this loss: for every CSA query, the KL
divergence from the main attention's distribution over all the compressed entries it could see (each head's
softmax of q . entry / sqrt(D), summed over heads and renormalised: where the heads would look if nothing were left
out) to the softmax of the indexer's scores over the same entries. The target is detached; the main attention
itself still runs on the indexer's current top-k, as it will at inference, so the two meet as the indexer learns
(DeepSeek-V3.2 trains a dense warm-up first; a tiny model's few entries make that stage unnecessary).

Installed for one forward by `distilling()`, which wraps the reference backend's `index_select` (to score every
visible entry with the gradient kept) and `sparse_attention` (to take the target from the same q and entries the
attention reads). Must not know the optimiser or the task mix.
"""
from __future__ import annotations

import contextlib

import torch

import backends.cpu.ops.attention as reference_attention
from backends.cpu.ops import indexer as reference_indexer
from backends.cpu.ops.basic import wide
from lib.training.data_parallel import Share


class Distillation:
    """The KL terms of a batch's CSA layers, summed over the forwards that compute the batch (a training step runs a
    second one when conversations share a prompt opening: lib/training/target.py prefill)."""

    def __init__(self):
        self.pending: list[tuple[torch.Tensor, int]] = []     # (indexer scores [T, E], ratio) awaiting their attention
        self.sums: list[torch.Tensor] = []       # per CSA layer: the KL summed over the queries that see an entry
        self.rows: list[int] = []                # and how many queries those are
        self._forward, self._layer = None, 0     # the Addressing of the forward running, and its CSA layers so far

    def loss(self, share: Share = Share()) -> torch.Tensor | None:
        """The mean over CSA layers of each layer's mean KL per query. `share` (lib/training/data_parallel.py):
        this forward is one rank's share of the batch, so each layer's sum is divided by the queries of every
        rank; the ranks' losses then add up to the whole batch's."""
        kept = [s / n for s, n in zip(self.sums, share.total(self.rows)) if n]
        return torch.stack(kept).sum() / len(kept) if kept else None

    @torch.no_grad()
    def target(self, q: torch.Tensor, batch, entries: torch.Tensor, ratio: int) -> torch.Tensor:
        """[T, E] the main attention's distribution over the visible entries (no gradient)."""
        addr = batch.state
        ids = torch.arange(addr.max_entries[ratio], dtype=torch.int64)
        block = reference_attention._entries(addr, entries, ratio, ids, slice(None)).detach().to(wide.dtype)
        spec = "thd,ed->the" if block.dim() == 2 else "thd,ted->the"
        logits = torch.einsum(spec, q.detach().to(wide.dtype), block) * q.shape[-1] ** -0.5        # [T, H, E]
        visible = ids[None, :] < ((batch.positions + 1) // ratio)[:, None]                          # [T, E]
        logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
        p = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(dim=1)                              # [T, E]
        return p / p.sum(dim=-1, keepdim=True).clamp_min(1e-30)

    def add(self, scores: torch.Tensor, target: torch.Tensor, forward) -> None:
        """One CSA layer's terms; `forward`: the Addressing of the forward it belongs to (each forward meets the
        CSA layers in the same order, so the i-th layer of every forward adds to the same sum)."""
        if forward is not self._forward:
            self._forward, self._layer = forward, 0
        layer, self._layer = self._layer, self._layer + 1
        if layer == len(self.sums):     # recorded even without queries: data-parallel ranks reduce one count per layer
            self.sums.append(scores.new_zeros(()))
            self.rows.append(0)
        rows = torch.isfinite(scores).any(dim=-1)               # queries that see at least one entry
        self.rows[layer] += int(rows.sum())
        if not rows.any():
            return
        log_q = torch.log_softmax(scores[rows], dim=-1)
        p = target[rows]
        kl = torch.where(p > 0, p * (torch.log(p.clamp_min(1e-30)) - log_q), torch.zeros_like(p)).sum(dim=-1)
        self.sums[layer] = self.sums[layer] + kl.sum()


@contextlib.contextmanager
def distilling():
    """Collect the indexer's distillation loss of the reference forwards run inside."""
    record = Distillation()
    select, attend = reference_attention.index_select, reference_attention.sparse_attention

    def index_select(q, weights, batch, keys, *, topk, ratio, weight_scale, group=None):
        chosen = select(q.detach(), weights.detach(), batch, keys.detach(), topk=topk, ratio=ratio,
                        weight_scale=weight_scale, group=group)
        scores = reference_indexer.all_scores(q, weights, batch, keys, ratio=ratio, weight_scale=weight_scale)
        record.pending.append((scores, ratio))
        return chosen

    def sparse_attention(q, kv, batch, windows, entries, selection, sink, *, window, ratio):
        if selection is not None and record.pending:
            scores, scored_ratio = record.pending.pop()
            if scored_ratio != ratio:
                raise AssertionError(f"indexer scores of ratio {scored_ratio} met an attention of ratio {ratio}")
            record.add(scores, record.target(q, batch, entries, ratio), batch.state)
        return attend(q, kv, batch, windows, entries, selection, sink, window=window, ratio=ratio)

    reference_attention.index_select, reference_attention.sparse_attention = index_select, sparse_attention
    try:
        yield record
    finally:
        reference_attention.index_select, reference_attention.sparse_attention = select, attend
