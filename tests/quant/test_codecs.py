"""Bit-exactness tests for lib/quant/bit_codecs.py. Oracles are torch's own float8 conversions, literal tables
from DSV4-REFERENCE §4.2, and slow per-element Python loops; never the codec under test."""
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lib.quant import bit_codecs as C

ALL = torch.arange(256, dtype=torch.uint8)
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,  # DSV4-REFERENCE §4.2, literally
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _i32(x):
    return x.view(torch.int32)


def _assert_same_bits(got, want):
    """Equal float32 bits where not NaN (NaN payloads are arbitrary); NaN at the same places."""
    assert got.dtype == torch.float32
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(_i32(got)[ok], _i32(want)[ok])


# ---------------------------------------------------------------- E4M3

def test_e4m3_decode_all_codes_match_torch():
    want = ALL.view(torch.float8_e4m3fn).float()
    _assert_same_bits(C.e4m3_decode(ALL), want)
    _assert_same_bits(C.e4m3_decode(ALL.view(torch.float8_e4m3fn)), want)
    assert C.e4m3_decode(ALL)[[0x7F, 0xFF]].isnan().all()
    assert C.e4m3_decode(torch.tensor([1], dtype=torch.uint8)).item() == 2.0 ** -9  # subnormal
    assert C.e4m3_decode(torch.tensor([0x7E], dtype=torch.uint8)).item() == C.E4M3_MAX


def test_e4m3_decode_refuses_other_float8():
    with pytest.raises(TypeError, match="float8_e8m0fnu"):
        C.e4m3_decode(ALL.view(torch.float8_e8m0fnu))


def _e4m3_sweep():
    g = torch.Generator().manual_seed(0)
    n = 200_000
    mag = torch.exp2(torch.empty(n).uniform_(-12.0, math.log2(448.0), generator=g))
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    finite = C.e4m3_decode(ALL[ALL & 0x7F != 0x7F]).unique()  # sorted distinct values
    mids = (finite[1:] + finite[:-1]) / 2  # exact halfway points: ties-to-even territory
    ulp = torch.nextafter(mids, torch.full_like(mids, math.inf)) - mids
    return torch.cat([sign * mag, mids, mids + ulp, mids - ulp, torch.tensor([-0.0, 0.0, 448.0])])


def test_e4m3_encode_matches_torch_rne():
    x = _e4m3_sweep().clamp(-448.0, 448.0)
    want = x.to(torch.float8_e4m3fn).view(torch.uint8)
    got = C.e4m3_encode(x)
    assert got.dtype == torch.uint8
    bad = (got != want).nonzero()
    i = bad[0].item() if bad.numel() else None
    assert i is None, f"x={x[i].item()!r}: got {int(got[i]):#04x}, torch {int(want[i]):#04x}"


def test_e4m3_encode_inverts_decode_and_saturates():
    codes = ALL[ALL & 0x7F != 0x7F]  # incl. 0x00 and 0x80 (-0.0 keeps its sign)
    assert torch.equal(C.e4m3_encode(C.e4m3_decode(codes)), codes)
    sat = C.e4m3_encode(torch.tensor([449.0, 1e30, math.inf, -500.0, -math.inf, math.nan]))
    assert sat.tolist() == [0x7E, 0x7E, 0x7E, 0xFE, 0xFE, 0x7F]


# ---------------------------------------------------------------- E8M0

def test_e8m0_decode_all_codes_match_torch():
    want = ALL.view(torch.float8_e8m0fnu).float()
    _assert_same_bits(C.e8m0_decode(ALL), want)
    _assert_same_bits(C.e8m0_decode(ALL.view(torch.float8_e8m0fnu)), want)
    assert C.e8m0_decode(ALL)[0].item() == 2.0 ** -127  # fp32 subnormal, exact
    assert torch.isnan(C.e8m0_decode(ALL)[255])


def test_e8m0_round_trip_and_rejects():
    b = ALL[:255]
    assert torch.equal(C.e8m0_encode(C.e8m0_decode(b)), b)
    for bad in (3.0, 0.0, -2.0, math.nan, math.inf, 2.0 ** -128):
        with pytest.raises(ValueError, match=repr(bad) if bad == bad else "nan"):
            C.e8m0_encode(torch.tensor([1.0, bad]))
    with pytest.raises(ValueError, match="3.0"):
        C.e8m0_encode(torch.tensor(3.0))
    with pytest.raises(ValueError):  # rounds to 1.0 in float32 but is not a power of two
        C.e8m0_encode(torch.tensor([1.0 + 2.0 ** -40], dtype=torch.float64))


@pytest.mark.parametrize("qmax", [448.0, 6.0])
def test_e8m0_scale_for_edges(qmax):
    def sf(a):
        return int(C.e8m0_scale_for(torch.tensor([a], dtype=torch.float32), qmax)[0])

    def f32_next(a, toward):  # neighbours in float32, where the codec works
        return torch.nextafter(torch.tensor(a), torch.tensor(toward)).item()

    for k in (-100, -3, 0, 1, 20):
        exact = qmax * 2.0 ** k
        assert sf(exact) == 127 + k  # amax/s == qmax is allowed
        assert sf(f32_next(exact, math.inf)) == 128 + k  # a hair above needs the next scale
        assert sf(f32_next(exact, 0.0)) == 127 + k
        assert sf(exact / 2 + exact / 4) == 127 + k  # 0.75*qmax*2**k: ceil, not round
    above = torch.tensor([qmax * (1 + 2.0 ** -40)], dtype=torch.float64)  # float32 rounds it down
    assert int(C.e8m0_scale_for(above, qmax)[0]) == 128
    assert sf(0.0) == 1  # documented floor: 2**-126, smallest normal-fp32 scale
    assert sf(1e-45) == 1
    with pytest.raises(ValueError, match="amax"):
        C.e8m0_scale_for(torch.tensor([-1.0]), qmax)
    with pytest.raises(ValueError, match="amax"):
        C.e8m0_scale_for(torch.tensor([math.nan]), qmax)


def test_e8m0_scale_for_is_the_smallest_power_of_two():
    g = torch.Generator().manual_seed(1)
    amax = torch.exp2(torch.empty(20_000).uniform_(-120.0, 100.0, generator=g))
    for qmax in (448.0, 6.0):
        b = C.e8m0_scale_for(amax, qmax)
        s, a = C.e8m0_decode(b).double(), amax.double()  # float64: these divisions are exact
        assert (a / s <= qmax).all()
        above_floor = b > 1  # at the 2**-126 floor a smaller scale would also fit (documented)
        assert (a / (s / 2) > qmax)[above_floor].all() and above_floor.sum() > 15_000
        assert (a[~above_floor] <= qmax * 2.0 ** -126).all()


# ---------------------------------------------------------------- E2M1

def test_e2m1_table_with_signs():  # B02: codes 8..15 are negative
    codes = torch.arange(16, dtype=torch.uint8)
    got = C.e2m1_decode(codes)
    assert got.tolist() == E2M1_TABLE and list(C.E2M1_VALUES) == E2M1_TABLE
    assert torch.equal(torch.signbit(got), codes >= 8)  # incl. code 8 = -0.0
    assert torch.equal(C.e2m1_encode(got), codes)  # -0.0 -> 8, +0.0 -> 0
    with pytest.raises(ValueError, match="0..15"):
        C.e2m1_decode(torch.tensor([0x21], dtype=torch.uint8))


@pytest.mark.parametrize("x, code", [
    (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),  # ties to even
    (0.26, 1), (5.01, 7), (7.0, 7), (1e9, 7), (-5.0, 14), (-0.1, 8), (-7.0, 15),  # saturate
])
def test_e2m1_encode_rounding(x, code):
    assert int(C.e2m1_encode(torch.tensor([x]))[0]) == code


def test_b01_nibble_order_on_known_bytes():
    packed = torch.tensor([0x21, 0x43], dtype=torch.uint8).view(torch.int8)
    codes = C.unpack_e2m1(packed)
    assert codes.tolist() == [1, 2, 3, 4]
    assert C.e2m1_decode(codes).tolist() == [0.5, 1.0, 1.5, 2.0]
    wrong = torch.cat([packed.view(torch.uint8) & 0xF, packed.view(torch.uint8) >> 4])
    assert wrong.tolist() == [1, 3, 2, 4] and codes.tolist() != wrong.tolist()
    assert torch.equal(C.pack_e2m1(codes), packed)


def test_pack_unpack_batched_and_high_bit_bytes():
    b = ALL.view(torch.int8).reshape(4, 8, 8)  # int8 bytes >= 0x80 must not sign-extend
    codes = C.unpack_e2m1(b)
    assert codes.shape == (4, 8, 16) and int(codes.max()) == 15
    assert torch.equal(C.pack_e2m1(codes), b)


# ---------------------------------------------------------------- B04: scale bytes survive

def test_b04_e8m0_bits_survive_safetensors(tmp_path):
    raw = torch.tensor([0, 1, 100, 120, 127, 130, 200, 254], dtype=torch.uint8)
    save_file({"s": raw.view(torch.float8_e8m0fnu)}, str(tmp_path / "s.safetensors"))
    with safe_open(str(tmp_path / "s.safetensors"), framework="pt") as f:
        s = f.get_tensor("s")
    assert s.dtype == torch.float8_e8m0fnu
    assert torch.equal(C.as_bits(s), raw)
    assert C.e8m0_decode(s).tolist() == [2.0 ** (b - 127) for b in raw.tolist()]
    # The trap: .to() converts the *value* 120 to the nearest power of two (2**7 -> byte 134).
    trap = raw.to(torch.float8_e8m0fnu).view(torch.uint8)
    assert not torch.equal(trap, raw)
    assert torch.equal(C.as_bits(raw.view(torch.float8_e8m0fnu)), raw)


# ---------------------------------------------------------------- weight layouts

def _slow_fp8(wq, sc, bo, bi):
    vals, sb = wq.view(torch.float8_e4m3fn).float().tolist(), sc.tolist()
    return torch.tensor([[v * 2.0 ** (sb[i // bo][j // bi] - 127) for j, v in enumerate(row)]
                         for i, row in enumerate(vals)], dtype=torch.float32)


def _rand_fp8(shape, block, seed):
    g = torch.Generator().manual_seed(seed)
    wq = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    wq = torch.where(wq & 0x7F == 0x7F, wq ^ 1, wq)  # no NaN codes
    sshape = tuple(-(-n // b) for n, b in zip(shape, block))
    return wq, torch.randint(100, 150, sshape, dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("shape, block", [((200, 300), (128, 128)), ((7, 130), (4, 64))])
def test_dequant_fp8_block_vs_slow_loop(shape, block):
    wq, sc = _rand_fp8(shape, block, 2)
    got = C.dequant_fp8_block(wq.view(torch.float8_e4m3fn), sc.view(torch.float8_e8m0fnu), block)
    assert got.shape == shape and torch.equal(_i32(got), _i32(_slow_fp8(wq, sc, *block)))
    assert torch.equal(C.dequant_fp8_block(wq, sc, block), got)  # raw bytes work too


def test_dequant_fp8_block_shape_errors():
    with pytest.raises(ValueError, match=r"expected shape \(2, 3\).*found \(2, 2\)"):
        C.dequant_fp8_block(torch.zeros(200, 300, dtype=torch.uint8),
                            torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(TypeError):  # weight and scale swapped
        C.dequant_fp8_block(torch.zeros(2, 2, dtype=torch.float8_e8m0fnu),
                            torch.zeros(1, 1, dtype=torch.float8_e4m3fn))


def test_quant_fp8_block_round_trip():
    wq, sc = _rand_fp8((200, 300), (128, 128), 3)
    w = C.dequant_fp8_block(wq, sc)
    q, s = C.quant_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu and s.shape == (2, 3)
    assert torch.equal(C.dequant_fp8_block(q, s), w)  # representable -> exact
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(4)) * 3e-3
    q, s = C.quant_fp8_block(w)
    err = (C.dequant_fp8_block(q, s) - w).abs()
    amax = torch.nn.functional.pad(w.abs(), (0, 84, 0, 56)).view(2, 128, 3, 128).amax(dim=(1, 3))
    bound = 2.0 ** -4 * amax.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
    assert (err <= bound).all()  # 3 mantissa bits: half-ulp <= 2**-4 of the value <= amax


def _slow_fp4(wp, sc, group):
    bytes_, sb = wp.view(torch.uint8).tolist(), sc.tolist()
    def nibble(row, j):  # element 2k in the low nibble of byte k, 2k+1 in the high one
        return (row[j // 2] >> (4 * (j % 2))) & 0xF
    return torch.tensor([[E2M1_TABLE[nibble(row, j)] * 2.0 ** (sb[i][j // group] - 127)
                          for j in range(2 * len(row))] for i, row in enumerate(bytes_)])


def test_dequant_fp4_expert_vs_slow_loop_and_shapes():
    g = torch.Generator().manual_seed(5)
    wp = torch.randint(-128, 128, (24, 64), dtype=torch.int8, generator=g)
    sc = torch.randint(110, 140, (24, 4), dtype=torch.uint8, generator=g)
    got = C.dequant_fp4_expert(wp, sc.view(torch.float8_e8m0fnu))
    assert got.shape == (24, 128) and torch.equal(_i32(got), _i32(_slow_fp4(wp, sc, 32)))
    with pytest.raises(ValueError, match=r"expected shape \(24, 4\).*found \(4, 24\)"):
        C.dequant_fp4_expert(wp, sc.T.contiguous())


def test_quant_fp4_expert_round_trip_and_b03_cosine():
    g = torch.Generator().manual_seed(6)
    wp = torch.randint(-128, 128, (32, 64), dtype=torch.int8, generator=g)
    w = C.dequant_fp4_expert(wp, torch.randint(110, 140, (32, 4), dtype=torch.uint8, generator=g))
    q, s = C.quant_fp4_expert(w)
    assert q.dtype == torch.int8 and q.shape == (32, 64) and s.dtype == torch.float8_e8m0fnu
    assert torch.equal(C.dequant_fp4_expert(q, s), w)  # representable -> exact
    w, x = torch.randn(256, 512, generator=g), torch.randn(512, 16, generator=g)
    y = C.dequant_fp4_expert(*C.quant_fp4_expert(w)) @ x
    cos = torch.nn.functional.cosine_similarity(y.flatten(), (w @ x).flatten(), dim=0)
    assert cos > 0.99  # an inverted scale (B03) quantises everything to 0 or ±6 and fails this
