"""Reference DSpark drafter ops (DSV4-REFERENCE §5.2): context features and block attention.

The drafter reads the target through `main_hidden` (mean over streams of the tapped layers'
outputs) and attends, per stage, over a ring of the target's committed positions plus its own
draft block with no causal mask. fp64 inside, fp32 out, as every reference op
(backends/cpu/ops/basic.py says why).
"""
from __future__ import annotations

import torch

from backends.cpu.ops.basic import gather_rows, wide

from backends.cpu.ops.attention import _softmax_with_sink
from lib.records.batch import Batch


def stream_mean(x: torch.Tensor) -> torch.Tensor:
    """[T, n, d] -> [T, d]: the plain mean over the hyper-connection streams."""
    return x.to(wide.dtype).mean(dim=1).float()


def context_features(taps: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Tapped features [T, d] each, in tap order -> main_hidden [T, k*d]; without taps the final
    streams x [T, n, d] themselves (an MTP layer's input)."""
    return torch.cat(taps, dim=-1) if taps else x


def streams_as_rows(x: torch.Tensor) -> torch.Tensor:
    """[T, n, d] -> [T*n, d]."""
    return x.reshape(-1, x.shape[-1])


def add_streams(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [T, n, d] + rows [T*n, d] viewed as streams, in x's dtype (fp64 sum)."""
    return (x.to(wide.dtype) + rows.to(wide.dtype).view_as(x)).to(x.dtype)


def ring_keys(batch: Batch, ring: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every draft row's ring: keys [T, W, D] of committed positions L-W..L-1 of its sequence
    (L = batch.state.seq_start) and which of them exist [T, W]."""
    addr, w = batch.state, ring.shape[1]
    seq = addr.row_seq
    pos = addr.seq_start[seq][:, None] - w + torch.arange(w)                            # [T, W]
    rows = addr.ring_rows(seq[:, None].expand_as(pos), pos.clamp(min=0), w)
    return gather_rows(ring.view(-1, ring.shape[-1]), rows), pos >= 0


def dspark_attention(q: torch.Tensor, kv: torch.Tensor, batch: Batch, rings: torch.Tensor,
                     sink: torch.Tensor) -> torch.Tensor:
    """q [T, H, D], kv [T, D] of the draft blocks (every sequence's block has the same size);
    rings: the stage's ring pool -> o [T, H, D].

    Every query of a block sees its sequence's filled ring slots and its whole block: the drafts
    are predicted jointly, so there is no causal mask."""
    d, s = q.shape[-1], len(batch.seq_lens)
    ring, filled = ring_keys(batch, rings)
    block = kv.to(wide.dtype).view(s, -1, kv.shape[-1])                                        # [S, G, D]
    keys = torch.cat((ring.to(wide.dtype), block[batch.state.row_seq]), dim=1)                # [T, W + G, D]
    logits = torch.einsum("thd,tkd->thk", q.to(wide.dtype), keys) / d ** 0.5
    mask = torch.cat((filled, torch.ones(q.shape[0], block.shape[1], dtype=torch.bool)), dim=1)
    p = _softmax_with_sink(logits.masked_fill(~mask[:, None, :], float("-inf")), sink.to(wide.dtype))
    return torch.einsum("thk,tkd->thd", p, keys).float()
