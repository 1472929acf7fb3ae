"""V4.1's cached rows from a pooled latent (backends/cpu/ops/latent_entries.py), worked by hand (V41-REFERENCE §3.4-3.6)."""
from __future__ import annotations

import torch

from backends.cpu.ops.latent_entries import latent_entries


def test_main_entry_and_index_key_of_one_latent():
    # pooled 2.0 everywhere: RMS 2, so the latent is all ones (norm weight 1); the rotation is 90 degrees on the
    # last 4 lanes, each pair (1, 1) -> (-1, 1)
    pooled = torch.full((1, 32), 2.0)
    angles = (torch.zeros(1, 2), torch.ones(1, 2))                        # cos 0, sin 1
    wk = 3 * torch.eye(32)
    wk[0] = 0
    wk[0, 28] = 3.0                   # key lane 0 reads latent lane 28, a RoPE lane: +1 before the rotation, -1 after
    main, keys = latent_entries(pooled, torch.ones(32), wk, torch.ones(32), angles, rope_dim=4, eps=1e-20)
    # keys: W_k of the pre-RoPE latent is 3 everywhere, normed to 1, rotated, FP4 with s = 2**ceil(log2(1/6)) =
    # 1/4: +-4 codes are exact
    assert keys[0].tolist() == [1.0] * 28 + [-1.0, 1.0, -1.0, 1.0]
    # main: the rotated latent in FP4 blocks of 16: s = e4m3(1/6) = 11 * 2**-6 = 0.171875 and 1 / s = 5.82 -> 6
    step = 6 * 0.171875
    assert main[0].tolist() == [step] * 28 + [-step, step, -step, step]
