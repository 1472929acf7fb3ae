"""V4.1's cache simulations (lib/quant/kv_simulation.py) against values worked out by hand from V41-REFERENCE §3.9."""
from __future__ import annotations

import pytest
import torch

from lib.quant.kv_simulation import fp4_index, fp4_main, fp8_window


def _block(head: list[float], width: int) -> torch.Tensor:
    return torch.tensor(head + [0.0] * (width - len(head)))


def test_fp8_window_rounds_each_32_channels_to_e4m3_under_a_power_of_two_scale():
    # amax 1.0: s = 2**ceil(log2(1 / 448)) = 2**-8, so x / s = 256 x; E4M3 has 8 steps per binade:
    # 256 stays; 76.8 lies in [64, 128) (step 8) -> 80; -3.1488 in [2, 4) (step 0.25) -> -3.25
    x = torch.stack((_block([1.0, 0.3, -0.0123], 32), _block([], 32))).flatten()
    y = fp8_window(x)
    assert y[:3].tolist() == [1.0, 80 / 256, -3.25 / 256]
    assert bool((y[3:32] == 0).all()) and bool((y[32:] == 0).all())          # a zero block stays zero (floor 1e-4)
    # the second block has its own scale: amax 448 -> s = 1, and 300 -> 288 (step 32 in [256, 512))
    z = fp8_window(torch.cat((_block([1.0], 32), _block([448.0, 300.0], 32))))
    assert z[0].item() == 1.0 and z[32:34].tolist() == [448.0, 288.0]


def test_fp4_index_rounds_each_32_channels_to_e2m1_ties_to_even():
    # amax 3: s = 2**ceil(log2(3 / 6)) = 0.5; x / s: 6 -> 6, 2.2 -> 2, 0.6 -> 0.5, 0.25 -> 0 (tie: even), -2.5 -> -2 (tie)
    x = _block([3.0, 1.1, 0.3, 0.125, -1.25], 32)
    assert fp4_index(x)[:5].tolist() == [3.0, 1.0, 0.25, 0.0, -1.0]
    assert fp4_index(torch.zeros(32)).abs().sum().item() == 0.0              # scale floor 6 * 2**-126: no 0 / 0


def test_fp4_main_uses_an_e4m3_scale_per_16_channels():
    # amax 0.9: s = e4m3(0.9 / 6 = 0.15) = 10 * 2**-6 = 0.15625; x / s: 5.76 -> 6, 1.28 -> 1.5, -0.32 -> -0.5
    x = _block([0.9, 0.2, -0.05], 16)
    assert fp4_main(x)[:3].tolist() == [6 * 0.15625, 1.5 * 0.15625, -0.5 * 0.15625]
    # a block below the floor: s = e4m3(2**-9) = 2**-9, and 1e-6 / 2**-9 rounds to 0
    assert fp4_main(_block([1e-6], 16)).abs().sum().item() == 0.0
    # blocks of 16: the second half of 32 channels has its own scale (amax 6 -> s = 1)
    y = fp4_main(torch.cat((_block([0.9], 16), _block([6.0, 2.6], 16))))
    assert y[16:18].tolist() == [6.0, 3.0]


def test_the_simulations_keep_the_dtype_and_refuse_a_partial_block():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    for sim in (fp8_window, fp4_index, fp4_main):
        y = sim(x)
        assert y.dtype == torch.bfloat16 and y.shape == x.shape
        assert torch.equal(sim(y), y)                                         # idempotent: already representable
    with pytest.raises(ValueError, match="fp4_main: the last dim \\(24\\) must be a multiple of the block \\(16\\)"):
        fp4_main(torch.zeros(24))


def _codec_round_trips():
    """The same simulations through the checkpoint codecs (encode to codes, decode), what the rounding must equal."""
    from lib.quant.bit_codecs import e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, e8m0_decode, e8m0_scale_for

    def window(x):
        b = x.float().unflatten(-1, (-1, 32))
        s = e8m0_decode(e8m0_scale_for(b.abs().amax(-1, keepdim=True).clamp(min=1e-4), 448.0))
        return (e4m3_decode(e4m3_encode((b / s).clamp(-448, 448))) * s).flatten(-2)

    def index(x):
        b = x.float().unflatten(-1, (-1, 32))
        s = e8m0_decode(e8m0_scale_for(b.abs().amax(-1, keepdim=True), 6.0))
        return (e2m1_decode(e2m1_encode((b / s).clamp(-6, 6))) * s).flatten(-2)

    def main(x):
        b = x.float().unflatten(-1, (-1, 16))
        s = e4m3_decode(e4m3_encode(b.abs().amax(-1, keepdim=True).clamp(min=6 * 2.0 ** -9) / 6))
        return (e2m1_decode(e2m1_encode((b / s).clamp(-6, 6))) * s).flatten(-2)
    return {fp8_window: window, fp4_index: index, fp4_main: main}


def test_the_value_rounding_equals_the_codecs_round_trip_on_every_binade():
    """The simulations round the values themselves (no codes, no check that reads a value back, so devices run
    them too); on blocks spanning 2**-30 .. 2**12, ties and exact grid points included, they equal encode then
    decode through lib/quant/bit_codecs.py bit for bit."""
    g = torch.Generator().manual_seed(3)
    mags = torch.pow(2.0, torch.randint(-30, 13, (64, 64), generator=g).float())
    x = torch.randn(64, 64, generator=g) * mags
    x[0, :32] = torch.tensor([0.5, 0.75, 1.25, 2.5, 3.5, 5.0, -0.25, 6.0] * 4)      # ties and grid points at s = 1
    x[1] = 0.0
    for sim, codec in _codec_round_trips().items():
        got, want = sim(x), codec(x)
        assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want)), sim.__name__
