"""Reference KV compressor (DSV4-REFERENCE §3.7, §3.8 for the indexer's own), with decode state.

Each sequence's compressor folds its new tokens into the buffered partial window, emits one entry
per window that completes, and keeps the remainder (and, overlapping CSA, the last full window's
"a" half) for the next call — so prefill in any chunking equals one long prefill (§3.12, L24).
"""
from __future__ import annotations

import torch

from backends.cpu.ops.basic import rms_norm
from backends.cpu.ops.rope import rope
from lib.records.batch import Batch
from lib.records.decode_state import CompressorState


def compress(h: torch.Tensor, batch: Batch, states: list[CompressorState], wkv: torch.Tensor,
             wgate: torch.Tensor, ape: torch.Tensor, norm: torch.Tensor, *, ratio: int, overlap: bool,
             eps: float, inv_freq: torch.Tensor, rope_dim: int) -> list[CompressorState]:
    """h [T, d] -> new per-sequence states with entries appended; rows_kv / rows_gate carry this
    call's A and Z + ape rows [n, C] fp32 (what paged storage keeps per position).

    wkv, wgate [C, d] with C = 2*Dc when `overlap` (CSA: series a = [:Dc], b = [Dc:]) else Dc;
    ape [ratio, C] biases the gate by position within the window.
    """
    a_all = (h.double() @ wkv.double().t()).float()                   # [T, C]
    z_all = (h.double() @ wgate.double().t() + ape.double()[batch.positions % ratio]).float()
    out = []
    for seg in batch.segments():
        st = states[seg.index]
        kv = torch.cat((st.buf_kv, a_all[seg.lo:seg.hi]))               # [b + n, C]
        gate = torch.cat((st.buf_gate, z_all[seg.lo:seg.hi]))
        first_window = (seg.start - st.buf_kv.shape[0]) // ratio
        full = kv.shape[0] // ratio
        entries, prev_kv, prev_gate = st.entries, st.prev_kv, st.prev_gate
        if full:
            wkv_ = kv[: full * ratio].unflatten(0, (full, ratio))          # [W, m, C]
            wg_ = gate[: full * ratio].unflatten(0, (full, ratio))
            if overlap:
                new, prev_kv, prev_gate = _pool_overlapping(wkv_, wg_, prev_kv, prev_gate)
            else:
                new = (torch.softmax(wg_.double(), dim=1) * wkv_.double()).sum(dim=1).float()   # [W, Dc]
            new = rms_norm(new, norm, eps)
            pos = (first_window + torch.arange(full)) * ratio              # RoPE at each window's first token
            entries = torch.cat((entries, rope(new, pos, inv_freq, rope_dim)))
        rest = full * ratio
        out.append(CompressorState(kv[rest:], gate[rest:], prev_kv, prev_gate, entries,
                                   a_all[seg.lo:seg.hi], z_all[seg.lo:seg.hi]))
    return out


def _pool_overlapping(kv: torch.Tensor, gate: torch.Tensor, prev_kv: torch.Tensor, prev_gate: torch.Tensor):
    """CSA pooling: entry w = softmax-gated sum over {a of window w-1} u {b of window w}, per channel.

    kv, gate [W, m, 2*Dc]; prev_* [m or 0, Dc] are the "a" half of the window before these ones
    (absent for the very first window: those slots get weight zero).
    """
    dc = kv.shape[-1] // 2
    a_kv, b_kv = kv[..., :dc], kv[..., dc:]
    a_g, b_g = gate[..., :dc], gate[..., dc:]
    entries = []
    for w in range(kv.shape[0]):
        left_kv = prev_kv if w == 0 else a_kv[w - 1]
        left_g = prev_gate if w == 0 else a_g[w - 1]
        slots_kv = torch.cat((left_kv, b_kv[w]))                        # [m or 2m, Dc]
        slots_g = torch.cat((left_g, b_g[w]))
        entries.append((torch.softmax(slots_g.double(), dim=0) * slots_kv.double()).sum(dim=0).float())
    return torch.stack(entries), a_kv[-1], a_g[-1]


def compressed_entries(states: list[CompressorState]) -> list[torch.Tensor]:
    """Each sequence's compressed entries [E_s, Dc]."""
    return [st.entries for st in states]
