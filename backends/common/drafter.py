"""Drafter ops as device composites: DSpark (DSV4-REFERENCE §5.2; L10: no fused op on any target) and the
MTP layer's input fusion (§5.1: per-stream rows, plain elementwise work).

The block attention is one fixed-shape fp32 softmax over [ring ; block] with the sink for every
draft row of the batch at once; unfilled ring slots (a sequence shorter than the window) are
masked. Features are averaged in fp32 (the residual streams are fp32 on every device backend, L02).
"""
from __future__ import annotations

import torch

from lib.emulation import invariant_matmul as invariant
from lib.records.batch import Batch


def stream_mean(x: torch.Tensor) -> torch.Tensor:
    """[T, n, d] streams -> [T, d] fp32: the mean accumulates in fp32 itself, so bf16 streams (ascend910's fused
    mHC state) take one launch, not a widening copy and then the mean."""
    return x.mean(dim=1, dtype=torch.float32)


def context_features(taps: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """DSpark's main_hidden [T, k*d], or without taps the final streams [T, n, d] (MTP's input)."""
    return torch.cat(taps, dim=-1) if taps else x


def streams_as_rows(x: torch.Tensor) -> torch.Tensor:
    """[T, n, d] -> [T*n, d] (a view)."""
    return x.reshape(-1, x.shape[-1])


def add_streams(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [T, n, d] (fp32 streams) + rows [T*n, d] in the compute dtype, summed in fp32, kept in x's dtype."""
    return (x.float() + rows.float().view(x.shape)).to(x.dtype)


def dspark_attention(q, kv, batch: Batch, rings, sink) -> torch.Tensor:
    """q [T, H, D], kv [T, D] (compute dtype), rings: the stage's ring pool -> o [T, H, D] in kv's dtype."""
    addr, d, s, w = batch.state, q.shape[-1], len(batch.seq_lens), rings.shape[1]
    seq = addr.row_seq
    pos = addr.seq_start[seq][:, None] - w + torch.arange(w, device=q.device)                      # [T, W]
    rows = addr.ring_rows(seq[:, None].expand_as(pos), pos.clamp(min=0), w).reshape(-1)
    ring = rings.view(-1, d).index_select(0, rows).view(q.shape[0], w, d).to(kv.dtype)
    block = kv.view(s, -1, d).index_select(0, seq)                               # [T, G, D]
    keys = torch.cat((ring, block), dim=1).float()
    mask = torch.cat((pos >= 0, torch.ones(q.shape[0], block.shape[1], dtype=torch.bool, device=q.device)), dim=1)
    logits = invariant.bmm(q.float(), keys.transpose(1, 2)) / d ** 0.5
    logits = torch.where(mask[:, None, :], logits, float("-inf"))
    sk = sink.float()[None, :, None]
    top = torch.maximum(logits.amax(-1, keepdim=True), sk)
    e = torch.exp(logits - top)
    return invariant.bmm(e / (e.sum(-1, keepdim=True) + torch.exp(sk - top)), keys).to(kv.dtype)
