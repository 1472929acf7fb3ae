"""Integer weight codecs: symmetric per-row int8 / int4 quantisation and ModelSlim's int4 packing.

The one row quantiser both the load-time conversion of an official checkpoint (runtime W8A8 /
W4A8) and the ModelSlim writer call, so a converted checkpoint holds exactly the integers and
scales a load would have computed. Must not know tensor names, the model graph or any backend.
"""
from __future__ import annotations

import torch


def quant_sym_rows(w: torch.Tensor, qmax: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., N, K] -> (int8 [..., N, K] in [-qmax, qmax], float32 scale [..., N]) with
    W ~= q * scale; scale = amax / qmax per row (an all-zero row keeps scale 1), round half to even."""
    amax = w.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    q = torch.round(w / scale.unsqueeze(-1)).clamp(-qmax, qmax).to(torch.int8)
    return q, scale.float()


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """int4 values held in int8 [N, K] -> int8 [N/2, K], two codes per byte along the output dim:
    row 2j in the low nibble, row 2j+1 in the high one (ModelSlim's W4A8 weight layout)."""
    if q.dim() != 2 or q.shape[0] % 2:
        raise ValueError(f"int4 row packing needs an [N, K] tensor with N even, found {tuple(q.shape)}")
    if bool(((q < -8) | (q > 7)).any()):
        raise ValueError("int4 row packing: values must lie in [-8, 7]")
    nib = q.to(torch.int16) & 0xF
    return (nib[0::2] | (nib[1::2] << 4)).to(torch.uint8).view(torch.int8)


def unpack_int4_rows(p: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4_rows: int8 [N/2, K] -> int8 [N, K] in [-8, 7] (nibbles sign-extended)."""
    if p.dim() != 2 or p.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"int4 row unpacking expects int8 [N/2, K], found {p.dtype} {tuple(p.shape)}")
    b = p.view(torch.uint8).to(torch.int16)
    lo, hi = b & 0xF, b >> 4
    both = torch.stack((lo, hi), dim=1).reshape(2 * p.shape[0], p.shape[1])   # rows 2j, 2j+1 interleaved
    return torch.where(both >= 8, both - 16, both).to(torch.int8)


def scale_bias(q: torch.Tensor, scale: torch.Tensor, chunks: int) -> torch.Tensor:
    """8 * sum_k q[n, k] * scale[n] over `chunks` equal parts of K: float32 [N, chunks] (ModelSlim's
    `.scale_bias` of a W4A8 weight: one chunk for gate / up, 16 for down projections)."""
    n, k = q.shape
    if k % chunks:
        raise ValueError(f"scale_bias: input dim {k} does not split into {chunks} equal chunks")
    sums = q.to(torch.float32).reshape(n, chunks, k // chunks).sum(-1)
    return 8.0 * sums * scale.reshape(n, 1).float()
