"""The reference Engram lookup and gate (backends/cpu/ops/engram.py) against V41-REFERENCE §4.5-4.6 worked by hand."""
from __future__ import annotations

import math

import pytest
import torch

from backends.cpu.ops.engram import engram_inject, engram_rows


def _table() -> tuple[torch.Tensor, torch.Tensor]:
    """3 rows of 64 channels: row r's first values, scale bytes per 32 channels (127 = 2**0, 128 = 2**1)."""
    values = torch.zeros(3, 64)
    values[1, :2] = torch.tensor([0.5, -3.0])
    values[2, :2], values[2, 32] = torch.tensor([1.0, 2.0]), 1.5
    scale = torch.tensor([[127, 127], [128, 127], [127, 126]], dtype=torch.uint8)
    return values.to(torch.float8_e4m3fn), scale


def test_engram_rows_dequantise_only_the_rows_read_with_their_own_scale_per_32_channels():
    weight, scale = _table()
    rows = engram_rows(torch.tensor([[2, 1], [0, 2]]), weight, scale)
    assert rows.shape == (2, 2, 64) and rows.dtype == torch.float32
    assert rows[0, 0, :2].tolist() == [1.0, 2.0] and rows[0, 0, 32].item() == 0.75      # 1.5 x 2**-1
    assert rows[0, 1, :2].tolist() == [1.0, -6.0]                                        # x 2**1
    assert rows[1, 0].abs().sum().item() == 0.0 and torch.equal(rows[1, 1], rows[0, 0])
    with pytest.raises(ValueError, match="hash id 3 is outside the table's 3 rows"):
        engram_rows(torch.tensor([[3]]), weight, scale)


def _gate(dot: float) -> float:
    s = -1.0 if dot < 0 else 1.0
    return 1 / (1 + math.exp(-s * math.sqrt(max(abs(dot), 1e-6))))


def test_engram_inject_gates_the_value_per_token_and_stream():
    # one column row r = [1, 2, 0 ...] (32 channels); W_e picks key_0 = [1, 2], key_1 = [1, -2], value = [0.5, 0]
    rows = torch.zeros(1, 1, 32)
    rows[0, 0, :2] = torch.tensor([1.0, 2.0])
    wkv = torch.zeros(6, 32)
    wkv[0, 0], wkv[1, 1], wkv[2, 0], wkv[3, 1], wkv[4, 0] = 1.0, 1.0, 1.0, -1.0, 0.5
    x = torch.tensor([[[1.0, 2.0], [3.0, 0.0]]])                                        # [T=1, n=2, D=2]
    ones = torch.ones(2, 2)
    out = engram_inject(x, rows, wkv, ones, ones, eps=1e-20)
    # stream 0: dot = (1*1 + 2*2) / sqrt(2.5) / sqrt(2.5) / sqrt(2) = sqrt(2); stream 1: 3 / sqrt(4.5 * 2.5) / sqrt(2)
    g0, g1 = _gate(math.sqrt(2)), _gate(3 / math.sqrt(4.5 * 2.5) / math.sqrt(2))
    expected = [[[1 + 0.5 * g0, 2.0], [3 + 0.5 * g1, 0.0]]]
    assert torch.allclose(out, torch.tensor(expected), rtol=0, atol=1e-6)
    # q_weight * k_weight weighs the dot: -1 on stream 1 flips its sign, so its gate falls below one half
    q = torch.tensor([[1.0, 1.0], [-1.0, 1.0]])
    flipped = engram_inject(x, rows, wkv, q, ones, eps=1e-20)
    assert abs(flipped[0, 1, 0].item() - (3 + 0.5 * _gate(-3 / math.sqrt(4.5 * 2.5) / math.sqrt(2)))) < 1e-6
    # a zero dot gates by sigmoid(1e-3), an image position (mask False) not at all
    zero = engram_inject(torch.tensor([[[0.0, 1.0], [3.0, 0.0]]]), rows, wkv, torch.tensor([[1.0, 0.0], [1.0, 1.0]]),
                         ones, eps=1e-20)
    assert abs(zero[0, 0, 0].item() - 0.5 * _gate(0.0)) < 1e-7 and abs(_gate(0.0) - 1 / (1 + math.exp(-1e-3))) < 1e-12
    assert torch.equal(engram_inject(x, rows, wkv, ones, ones, eps=1e-20, mask=torch.tensor([False])), x)
    with pytest.raises(ValueError, match="does not map 1 x 32 row channels to 2 keys and a value of 2"):
        engram_inject(x, rows, wkv[:5], ones, ones, eps=1e-20)
