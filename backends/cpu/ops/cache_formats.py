"""Reference of the cache formats DeepSeek-V4.1 was trained with, as the graph's `simulate_format` op
(V41-REFERENCE §3.9; the formats themselves: lib/quant/kv_simulation.py).

V4.1's own code quantises and dequantises what its caches hold, so the model reads those values; the reference
computes them in fp32 where they are made (the window KV before it is stored, the indexer's queries before they
are scored), and every backend computes the same values.
"""
from __future__ import annotations

import torch

from lib.quant.kv_simulation import simulated


def simulate_format(x: torch.Tensor, format: str) -> torch.Tensor:
    """x [..., D] -> the same values as `format` holds them, fp32."""
    return simulated(format)(x.float()).float()
