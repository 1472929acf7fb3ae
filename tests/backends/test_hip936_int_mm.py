"""hip936's `_int_mm` shim with the DCU's quirk on (L28): M <= 16 rows refused, padding to 17 rows
fixes it, K and N multiples of 8, int8 only. CPU only; no DCU."""
import pytest
import torch

import backends.hip936.device_ops as hip
from tests.backends.device_inputs import dot as _dot, randint8

I32 = torch.int32


def test_l28_int_mm_raises_for_m_le_16_and_padding_to_17_fixes_it():
    w = randint8(32, 16, seed=36, lo=-128)
    for m in (1, 16):
        with pytest.raises(RuntimeError, match="greater than 16"):
            hip._int_mm(randint8(m, 32, seed=37, lo=-128), w)
    a17 = randint8(17, 32, seed=38, lo=-128)
    y = hip._int_mm(a17, w)
    assert y.dtype == I32 and all(int(y[i, j]) == _dot(a17[i], w[:, j]) for i in range(17) for j in range(16))
    a5 = a17[:5]
    padded = hip.pad_rows_to(a5, 17)
    assert padded.shape == (17, 32) and torch.equal(hip._int_mm(padded, w)[:5], y[:5])
    assert hip.pad_rows_to(a17) is a17
    with pytest.raises(RuntimeError, match="multiple of 8"):
        hip._int_mm(randint8(17, 12), randint8(12, 16))
    with pytest.raises(RuntimeError, match="multiple of 8"):
        hip._int_mm(a17, w[:, :12])
    with pytest.raises(RuntimeError, match="int8"):
        hip._int_mm(a17.float(), w)


def test_table_requant_gives_what_the_bit_decode_gives():
    """The per-step expert requantisation reads a byte table (one gather) and must give exactly the
    W8A8 rows of the codec's bit decode, for every byte value and the scale range, stacked experts included."""
    from backends.hip936 import lowerings
    from lib.quant.runtime_formats import PackedFP4, packed_fp4_to_w8a8, quantize_rows

    gen = torch.Generator().manual_seed(0)
    every_byte = torch.arange(-128, 128, dtype=torch.int8).view(4, 64).repeat(3, 1, 1)     # all 256 bytes per expert
    weight = torch.cat((every_byte, torch.randint(-128, 128, (3, 4, 64), generator=gen, dtype=torch.int8)), 1)
    scale = torch.randint(90, 160, (3, 8, 4), generator=gen).to(torch.uint8)
    packed = PackedFP4(weight, scale)
    got, want = lowerings._requant_fp4(packed, quantize_rows), packed_fp4_to_w8a8(packed)
    assert torch.equal(got.qweight, want.qweight) and torch.equal(got.scale, want.scale)
