"""Compressor, lightning indexer and sparse sink attention as device composites (L10).

Same equations as the reference (backends/cpu/ops), with device numerics: fp32 pooling, scores
and softmax, KV and compressed entries in the compute dtype, int32 indices and float sort keys
(L13), and only fixed-shape ops — selections become masks by comparison, never by boolean
indexing or index_put (L12). Sequence layout comes from host metadata, so nothing syncs.
"""
from __future__ import annotations

import torch

from backends.common.rope import rope
from lib.distributed import process_group as parallel
from lib.records.batch import Batch
from lib.emulation import invariant_matmul as invariant
from lib.emulation.invariant_matmul import matmul
from lib.records.decode_state import CompressorState


def compress(h, batch: Batch, states: list[CompressorState], wkv, wgate, ape, norm, *, ratio: int,
             overlap: bool, eps: float, inv_freq, rope_dim: int) -> list[CompressorState]:
    """h [T, d] -> per-sequence compressor states with new entries (fp32 pooling, entries in h's dtype)
    and this call's A / Z + ape rows [n, C] fp32 in rows_kv / rows_gate (for paged storage)."""
    slot = (batch.positions % ratio).to(torch.int32)
    a_all = matmul(h.to(wkv.dtype), wkv.t()).float()                           # [T, C]
    z_all = matmul(h.to(wgate.dtype), wgate.t()).float() + ape.float().index_select(0, slot)
    out = []
    for seg in batch.segments():
        st = states[seg.index]
        kv = torch.cat((st.buf_kv.float(), a_all[seg.lo:seg.hi]))
        gate = torch.cat((st.buf_gate.float(), z_all[seg.lo:seg.hi]))
        first_window = (seg.start - st.buf_kv.shape[0]) // ratio
        full = kv.shape[0] // ratio
        entries, prev_kv, prev_gate = st.entries, st.prev_kv, st.prev_gate
        if full:
            wkv_ = kv[: full * ratio].unflatten(0, (full, ratio))
            wg_ = gate[: full * ratio].unflatten(0, (full, ratio))
            if overlap:
                new, prev_kv, prev_gate = _pool_overlapping(wkv_, wg_, prev_kv.float(), prev_gate.float())
            else:
                new = (torch.softmax(wg_, dim=1) * wkv_).sum(dim=1)
            new = new * torch.rsqrt(new.square().mean(-1, keepdim=True) + eps) * norm.float()
            pos = (first_window + torch.arange(full, dtype=torch.int32)) * ratio
            entries = torch.cat((entries.to(h.dtype), rope(new, pos, inv_freq, rope_dim).to(h.dtype)))
        rest = full * ratio
        out.append(CompressorState(kv[rest:], gate[rest:], prev_kv, prev_gate, entries,
                                   a_all[seg.lo:seg.hi], z_all[seg.lo:seg.hi]))
    return out


def _pool_overlapping(kv, gate, prev_kv, prev_gate):
    dc = kv.shape[-1] // 2
    a_kv, b_kv, a_g, b_g = kv[..., :dc], kv[..., dc:], gate[..., :dc], gate[..., dc:]
    rows = []
    for w in range(kv.shape[0]):
        left_kv, left_g = (prev_kv, prev_gate) if w == 0 else (a_kv[w - 1], a_g[w - 1])
        slots_kv, slots_g = torch.cat((left_kv, b_kv[w])), torch.cat((left_g, b_g[w]))
        rows.append((torch.softmax(slots_g, dim=0) * slots_kv).sum(dim=0))
    return torch.stack(rows), a_kv[-1], a_g[-1]


def compressed_entries(states: list[CompressorState]) -> list[torch.Tensor]:
    return [st.entries for st in states]


def index_select(q, weights, batch: Batch, keys: list[torch.Tensor], *, topk: int, ratio: int,
                 weight_scale: float, group=None) -> torch.Tensor:
    """Top-k entries per query -> [T, topk] int32 sequence-local ids, -1 = none (fp32 scores).

    Under TP each rank holds Hi/tp heads of q [T, Hi/tp, Di] and weights [T, Hi/tp]. They are
    gathered, not the scores: summed per rank and all-reduced, the fp32 head sum would be grouped
    by TP size and could flip a near-tie at the top-k boundary, while every rank summing all heads
    in one process's order selects exactly what one process selects. The gather (T x Hi x (Di+1))
    is also smaller than the partial scores (T x E) once E > Hi x (Di+1)."""
    q, weights = parallel.gather_heads(q, weights, group)
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32)
    for seg in batch.segments():
        k = keys[seg.index]
        if k.shape[0] == 0:
            continue
        ws = weights[seg.lo:seg.hi].float() * weight_scale
        dots = matmul(q[seg.lo:seg.hi].float(), k.float().t())                         # [n, H, E]
        scores = (ws.unsqueeze(-1) * torch.relu(dots)).sum(1)                          # [n, E]
        ready = ((batch.positions[seg.lo:seg.hi] + 1) // ratio).to(torch.int32)
        visible = torch.arange(k.shape[0], dtype=torch.int32)[None, :] < ready[:, None]
        scores = torch.where(visible, scores, float("-inf"))
        top = scores.topk(min(topk, k.shape[0]), dim=-1)                              # float sort keys
        picked = torch.where(torch.isfinite(top.values), top.indices.to(torch.int32), -1)
        out[seg.lo:seg.hi, : picked.shape[1]] = picked
    return out


def sparse_attention(q, kv, batch: Batch, windows: list[torch.Tensor], entries, selection, sink, *,
                     window: int, ratio: int):
    """Window + compressed entries + sink, one fp32 softmax; o and new windows in kv's dtype.

    Every query gets its own key rows in one canonical layout: slot k of its W window slots holds
    position t-W+1+k (slots before position 0 masked), then the sequence's entries in order.
    A query's sums therefore run over the same operands in the same order whether it is decoded
    alone or verified with five drafts after it: batch invariance, which lossless speculative
    decoding needs, holds by construction instead of by luck of the reduction order."""
    d = q.shape[-1]
    outs, new_windows = [], []
    for seg in batch.segments():
        old = windows[seg.index].to(kv.dtype)
        n, w0 = seg.hi - seg.lo, old.shape[0]
        keys = torch.cat((old, kv[seg.lo:seg.hi]))                                    # positions start-w0 ..
        padded = torch.cat((keys.new_zeros(window - 1, keys.shape[1]), keys))
        slots = padded.unfold(0, window, 1)[w0: w0 + n].transpose(1, 2)              # [n, W, D]
        pos = batch.positions[seg.lo:seg.hi].to(torch.int32)
        slot_pos = pos[:, None] - window + 1 + torch.arange(window, dtype=torch.int32)[None, :]
        mask = slot_pos >= 0                                                           # [n, W]
        if entries is not None:
            comp = entries[seg.index].to(kv.dtype)
            ids = torch.arange(comp.shape[0], dtype=torch.int32)
            visible = ids[None, :] < ((pos + 1) // ratio)[:, None]
            if selection is not None:
                sel = selection[seg.lo:seg.hi].to(torch.int32)
                visible = visible & (sel[:, :, None] == ids[None, None, :]).any(dim=1)
            slots = torch.cat((slots, comp.unsqueeze(0).expand(n, -1, -1)), dim=1)     # [n, W + E, D]
            mask = torch.cat((mask, visible), dim=1)
        kf = slots.float()
        logits = invariant.bmm(q[seg.lo:seg.hi].float(), kf.transpose(1, 2)) / d ** 0.5      # [n, H, W + E]
        logits = torch.where(mask[:, None, :], logits, float("-inf"))
        sk = sink.float()[None, :, None]
        top = torch.maximum(logits.amax(-1, keepdim=True), sk)
        e = torch.exp(logits - top)
        p = e / (e.sum(-1, keepdim=True) + torch.exp(sk - top))
        outs.append(invariant.bmm(p, kf).to(kv.dtype))                                 # [n, H, D]
        new_windows.append(keys[-window:])
    return torch.cat(outs), new_windows
