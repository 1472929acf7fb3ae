"""Device shims of ascend310p / ascend910 / hip936: emulated numerics against brute-force loop references
(signatures: test_device_schemas.py; hip936 _int_mm: test_hip936_int_mm.py), and every device quirk ON
(L02 L03 L05 L06 L07 L08 L09 L28). CPU only; no torch_npu, no DCU.
"""
from __future__ import annotations

import pytest
import torch

import backends.ascend310p.device_ops as p310
import backends.ascend910.device_ops as p910
from lib.emulation import int_numerics
from lib.emulation import npu_ops as emu
from tests.backends.device_inputs import dot as _dot, gen, randint8

F16, BF16, F32, I8, I32, I64 = torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.int32, torch.int64


# ---- quantised matmuls ------------------------------------------------------------------------------------
def test_quant_matmul_310p_matches_loops_with_transposed_weight():
    x1, w_nk = randint8(5, 32, seed=1), randint8(16, 32, seed=2)
    scale, bias = torch.rand(16, generator=gen(3)) / 100, torch.randint(-50, 50, (16,), generator=gen(4), dtype=I32)
    y = p310.npu_quant_matmul(x1, w_nk.t(), scale, bias=bias, output_dtype=F16)
    y8 = p310.npu_quant_matmul(x1, w_nk.t(), scale, offset=torch.tensor([3.0]))  # None means int8
    assert y.dtype == F16 and y8.dtype == I8 and y.shape == (5, 16)
    for m in range(5):
        for n in range(16):
            acc = _dot(x1[m], w_nk[n])
            assert y[m, n] == (torch.tensor(acc + int(bias[n]), dtype=F32) * scale[n]).half()
            v = float(torch.tensor(acc, dtype=F32) * scale[n] + 3.0)
            assert int(y8[m, n]) == max(-128, min(127, round(v)))  # Python round: half to even


def test_quant_matmul_910_pertoken_bf16_int32_and_int4():
    x1, w = randint8(4, 16, seed=5), randint8(16, 8, seed=6, lo=-8, hi=8)
    scale, pts = torch.rand(8, generator=gen(7)), torch.rand(4, generator=gen(8))
    y = p910.npu_quant_matmul(x1, w, scale, pertoken_scale=pts, output_dtype=BF16)
    acc = p910.npu_quant_matmul(x1, w, scale, output_dtype=3)  # ScalarType code of int32: raw accumulator
    for m in range(4):
        for n in range(8):
            assert int(acc[m, n]) == _dot(x1[m], w[:, n])
            assert y[m, n] == (torch.tensor(int(acc[m, n]), dtype=F32) * scale[n] * pts[m]).bfloat16()
    packed = int_numerics.pack_int4(w)  # (k, n // 8) int32
    assert packed.shape == (16, 1) and torch.equal(p910.npu_quant_matmul(x1, packed, scale, pertoken_scale=pts,
                                                                         output_dtype=BF16), y)


def test_quant_matmul_310p_refusals_l03_l02_pertoken():
    x1, w, s = randint8(2, 8), randint8(8, 4), torch.ones(4)
    with pytest.raises(ValueError, match="L03"):
        p310.npu_quant_matmul(x1, w, s, output_dtype=torch.int32)
    with pytest.raises(ValueError, match="L03"):
        p310.npu_quant_matmul(x1, w, s, output_dtype=3)
    with pytest.raises(ValueError, match="L02"):
        p310.npu_quant_matmul(x1, w, s, output_dtype=BF16)
    with pytest.raises(ValueError, match="pertoken_scale"):
        p310.npu_quant_matmul(x1, w, s, pertoken_scale=torch.ones(2), output_dtype=F16)
    with pytest.raises(ValueError, match="int8 only"):
        p310.npu_quant_matmul(int_numerics.pack_int4(randint8(2, 8, lo=-8, hi=8)), w, s, output_dtype=F16)
    assert p910.npu_quant_matmul(x1, w, s, output_dtype=torch.int32).dtype == I32  # 910 allows INT32


def _ref_dynamic_row(row: torch.Tensor, qmax: int):
    """Per-row symmetric quantisation with Python loops; Python's round is half to even."""
    s = row.float().abs().max() / qmax
    return [max(-qmax, min(qmax, round(float(v / s)))) for v in row.float()], s


def test_quant_matmul_dequant_310p_matches_loops_and_rounds_half_to_even():
    x = torch.randn(4, 32, generator=gen(9)).half()
    x[0, :3] = torch.tensor([127.0, 2.5, -3.5])  # s = 1 exactly: 2.5 -> 2 and -3.5 -> -4 (half to even)
    w, ws = randint8(16, 32, seed=10), torch.rand(16, generator=gen(11)) / 50
    out = p310.npu_quant_matmul_dequant(x, w, ws)
    assert out.dtype == F16 and out.shape == (4, 16)
    for m in range(4):
        q, s = _ref_dynamic_row(x[m], 127)
        if m == 0:
            assert (q[1], q[2]) == (2, -4)
        for n in range(16):
            assert out[m, n] == (torch.tensor(_dot(torch.tensor(q), w[n]), dtype=F32) * ws[n] * s).half()


def test_quant_dequant_refusals():
    x, w, ws = torch.randn(2, 8).half(), randint8(4, 8), torch.ones(4)
    with pytest.raises(ValueError, match="L02"):
        p310.npu_quant_matmul_dequant(x.bfloat16(), w, ws)
    with pytest.raises(ValueError, match="int8"):
        p310.npu_quant_matmul_dequant(x, w.half(), ws)
    with pytest.raises(ValueError, match="weight_scale"):
        p310.npu_quant_matmul_dequant(x, w, ws.half())


# ---- grouped matmuls and the unwritten tail (L05, L09) -----------------------------------------------------
def _expert_of_row(ends):
    rows = []
    for g, e in enumerate(ends):
        rows += [g] * (e - len(rows))
    return rows


def test_quant_grouped_matmul_dequant_310p_groups_tail_and_single_expert():
    x, w = torch.randn(7, 32, generator=gen(12)).half(), randint8(3, 16, 32, seed=13)
    ws, gl = torch.rand(3, 16, generator=gen(14)) / 50, torch.tensor([2, 2, 5])  # expert 1 empty, rows 5-6 tail
    out = p310.npu_quant_grouped_matmul_dequant(x, w, ws, gl)
    for m, g in enumerate(_expert_of_row([2, 2, 5])):
        q, s = _ref_dynamic_row(x[m], 127)
        for n in range(16):
            assert out[m, n] == (torch.tensor(_dot(torch.tensor(q), w[g, n]), dtype=F32) * ws[g, n] * s).half()
    assert out[5:].isnan().any(dim=1).all()  # L05
    with pytest.raises(ValueError, match="L09"):
        p310.npu_quant_grouped_matmul_dequant(x, w[:1], ws[:1], torch.tensor([7]))
    with pytest.raises(ValueError, match="non-decreasing"):
        p310.npu_quant_grouped_matmul_dequant(x, w, ws, torch.tensor([2, 1, 2]))  # counts passed as cumsum


def _gmm_ref(x, w, ends):
    out = torch.zeros(len(_expert_of_row(ends)), w.shape[2])
    for m, g in enumerate(_expert_of_row(ends)):
        for n in range(w.shape[2]):
            out[m, n] = sum(float(x[m, k]) * float(w[g, k, n]) for k in range(w.shape[1]))
    return out


def test_grouped_matmul_310p_fp16_groups_cumsum_and_counts():
    x, w = torch.randn(7, 16, generator=gen(15)).half(), torch.randn(3, 16, 32, generator=gen(16)).half()
    kw = dict(split_item=2, group_type=0)
    cum = p310.npu_grouped_matmul([x], [w], group_list=torch.tensor([2, 3, 5]), group_list_type=0, **kw)[0]
    cnt = p310.npu_grouped_matmul([x], [w], group_list=torch.tensor([2, 1, 2]), group_list_type=1, **kw)[0]
    assert cum.dtype == F16 and torch.equal(cum[:5], cnt[:5])
    # fp16 output of an fp32 sum taken in another order: within ~1 fp16 ulp
    torch.testing.assert_close(cum[:5].float(), _gmm_ref(x, w, [2, 3, 5]), rtol=2e-3, atol=2e-3)


def test_l05_tail_rows_are_garbage_that_only_torch_where_clears():
    x, w, gl = torch.randn(12, 16, generator=gen(17)).half(), torch.randn(2, 16, 16, generator=gen(18)).half(), \
        torch.tensor([3, 5])
    kw = dict(group_list=gl, split_item=3, group_type=0)
    y = p310.npu_grouped_matmul([x], [w], **kw)[0]
    tail = y[5:]
    assert tail[0].isnan().all() and not torch.isfinite(tail).all()
    assert ((tail.abs() > 1e4) | tail.isnan()).all()  # every unwritten row is NaN or huge
    valid = torch.arange(12) < int(gl[-1])
    assert (y * valid[:, None]).isnan().any()  # multiplying by a 0 mask keeps NaN (NaN * 0 = NaN)
    fixed = torch.where(valid[:, None], y, torch.zeros((), dtype=y.dtype))
    torch.testing.assert_close(fixed[:5].float(), _gmm_ref(x, w, [3, 5]), rtol=2e-3, atol=2e-3)
    assert (fixed[5:] == 0).all()
    # the garbage repeats for identical inputs but changes with the batch (B10)
    again = p310.npu_grouped_matmul([x], [w], **kw)[0]
    assert torch.equal(again[5:].isnan(), tail.isnan()) and torch.equal(again.nan_to_num(), y.nan_to_num())
    x2 = x.clone()
    x2[0, 0] += 1
    other = p310.npu_grouped_matmul([x2], [w], **kw)[0][5:]
    assert not torch.equal(other.nan_to_num(), tail.nan_to_num())
    # not documented as 310P-only: the 910 emulation leaves the tail unwritten too
    assert p910.npu_grouped_matmul([x], [w], **kw)[0][5:].isnan().any()


def test_grouped_matmul_310p_refusals_l09_l02_n16_quant():
    x, w, gl = torch.randn(4, 16).half(), torch.randn(2, 16, 32).half(), torch.tensor([2, 4])
    kw = dict(group_list=gl, split_item=2, group_type=0)
    with pytest.raises(ValueError, match="L09"):
        p310.npu_grouped_matmul([x], [w[:1]], group_list=torch.tensor([4]), split_item=2, group_type=0)
    with pytest.raises(ValueError, match="L02"):
        p310.npu_grouped_matmul([x.bfloat16()], [w.bfloat16()], **kw)
    with pytest.raises(ValueError, match="multiple of 16"):
        p310.npu_grouped_matmul([x], [w[..., :24]], **kw)
    with pytest.raises(ValueError, match="npu_quant_grouped_matmul_dequant"):
        p310.npu_grouped_matmul([randint8(4, 16)], [randint8(2, 16, 32)], scale=[torch.ones(2, 32)], **kw)
    with pytest.raises(ValueError, match="group_type must be 0"):
        p310.npu_grouped_matmul([x], [w], group_list=gl, split_item=0, group_type=0)
    assert p910.npu_grouped_matmul([x], [w[:1]], group_list=torch.tensor([4]), split_item=2,
                                   group_type=0)[0].shape == (4, 32)  # 910 takes E == 1


def test_grouped_matmul_910_w8a8_and_w4a8_per_token():
    m, k, n, ends = 6, 16, 16, [2, 6]
    x, w = randint8(m, k, seed=19), randint8(2, k, n, seed=20, lo=-8, hi=8)
    sc, pts = torch.rand(2, n, generator=gen(21)), torch.rand(m, generator=gen(22))
    kw = dict(scale=[sc], per_token_scale=[pts], group_list=torch.tensor(ends), split_item=2, group_type=0,
              output_dtype=BF16)
    y8 = p910.npu_grouped_matmul([x], [w], **kw)[0]
    for row, g in enumerate(_expert_of_row(ends)):
        for col in range(n):
            acc = _dot(x[row], w[g, :, col])
            assert y8[row, col] == (torch.tensor(acc, dtype=F32) * sc[g, col] * pts[row]).bfloat16()
    w4 = int_numerics.pack_int4(w)  # [E, K, N // 8]
    assert w4.shape == (2, k, n // 8) and w4.dtype == I32
    assert torch.equal(p910.npu_grouped_matmul([x], [w4], weight_dtype=torch.quint4x2, **kw)[0], y8)
    assert torch.equal(p910.npu_grouped_matmul([x], [w4], weight_dtype=285, **kw)[0], y8)
    with pytest.raises(ValueError, match="packed int4"):
        p910.npu_grouped_matmul([x], [w4], **kw)


# ---- routing, combine -------------------------------------------------------------------------------------
def _route_ref(ids, start, end):
    """Brute force: (expert, pair) sorted; pair = t*K + k."""
    n_tok, k = ids.shape
    pairs = sorted((int(ids[t, j]), t * k + j) for t in range(n_tok) for j in range(k) if start <= ids[t, j] < end)
    row_of_pair = [-1] * (n_tok * k)
    for i, (_, p) in enumerate(pairs):
        row_of_pair[p] = i
    counts = [sum(1 for e, _ in pairs if e == ex) for ex in range(start, end)]
    return pairs, row_of_pair, counts


def _cumsum(v):
    out, s = [], 0
    for c in v:
        s += c
        out.append(s)
    return out


@pytest.mark.parametrize("module", [p310, p910])
def test_init_routing_matches_brute_force_and_round_trips_through_unpermute(module):
    n_tok, k, e, h = 6, 3, 4, 128
    ids = torch.randint(0, e, (n_tok, k), generator=gen(23), dtype=I32)
    x = torch.randn(n_tok, h, generator=gen(24)).half()
    ex, row_idx, tokens, _ = module.npu_moe_init_routing_v2(x, ids, expert_num=e, active_num=n_tok * k,
                                                            expert_tokens_num_type=0, expert_tokens_num_flag=True)
    pairs, row_of_pair, counts = _route_ref(ids, 0, e)
    assert row_idx.dtype == I32 and tokens.dtype == I64 and row_idx.tolist() == row_of_pair
    assert tokens.tolist() == _cumsum(counts)
    for i, (_, pair) in enumerate(pairs):
        assert torch.equal(ex[i], x[pair // k])
    _, scatter_idx, _, _ = module.npu_moe_init_routing_v2(x, ids, expert_num=e, row_idx_type=1)
    assert scatter_idx.tolist() == [p for _, p in pairs]
    probs = torch.rand(n_tok, k, generator=gen(25)).half()
    out = module.npu_moe_token_unpermute(ex, row_idx, probs)
    ref = torch.stack([sum(float(probs[t, j]) * x[t].float() for j in range(k)) for t in range(n_tok)])
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)  # fp16 output of an fp32 sum


def test_l06_310p_ignores_active_expert_range_and_raises_on_foreign_ids_910_honours_it():
    ids = torch.tensor([[1, 0], [2, 1], [0, 3], [1, 1]], dtype=I32)
    x = torch.arange(4.0).unsqueeze(1).repeat(1, 128)
    kw = dict(expert_num=4, active_expert_range=[1, 3], expert_tokens_num_type=1, expert_tokens_num_flag=True)
    ex, row_idx, tokens, _ = p310.npu_moe_init_routing_v2(x, ids, **kw)
    pairs, row_of_pair, counts = _route_ref(ids, 0, 4)  # the range was ignored: all 4 experts routed
    assert row_idx.tolist() == row_of_pair and tokens.tolist() == _cumsum(counts) == [2, 6, 7, 8]
    with pytest.raises(ValueError, match="L06"):
        p310.npu_moe_init_routing_v2(x, ids, expert_num=3, active_expert_range=[0, 3])  # id 3 is not local
    ex, row_idx, tokens, _ = p910.npu_moe_init_routing_v2(x, ids, **kw)
    pairs, row_of_pair, counts = _route_ref(ids, 1, 3)
    assert row_idx.tolist() == row_of_pair and -1 in row_of_pair and tokens.tolist() == counts == [4, 1]
    assert torch.equal(ex[:5], x[[p // 2 for _, p in pairs]]) and ex[5:].isnan().any()  # unused tail unwritten
    ids_out = ids.clone()
    ids_out[0, 0] = 9  # outside [0, expert_num): dropped on 910, not an error
    assert p910.npu_moe_init_routing_v2(x, ids_out, expert_num=4)[1][0] == -1


def test_l07_310p_counts_are_cumulative_even_when_counts_are_requested():
    ids = torch.tensor([[0, 2], [2, 1], [2, 0]], dtype=I32)
    x = torch.randn(3, 128).half()
    *_, counts = _route_ref(ids, 0, 3)
    got310 = p310.npu_moe_init_routing_v2(x, ids, expert_num=3, expert_tokens_num_type=1,
                                          expert_tokens_num_flag=True)[2]
    got910 = p910.npu_moe_init_routing_v2(x, ids, expert_num=3, expert_tokens_num_type=1,
                                          expert_tokens_num_flag=True)[2]
    assert got310.tolist() == _cumsum(counts) == [2, 3, 6] and got910.tolist() == counts == [2, 1, 3]


def test_l08_unpermute_hidden_multiple_of_128_on_310p_only():
    tok, idx, probs = torch.randn(4, 64).half(), torch.tensor([1, 0, 3, 2], dtype=I32), torch.rand(2, 2).half()
    with pytest.raises(ValueError, match="L08"):
        p310.npu_moe_token_unpermute(tok, idx, probs)
    out = p910.npu_moe_token_unpermute(tok, idx, probs)
    ref = torch.stack([sum(float(probs[t, j]) * tok[int(idx[t * 2 + j])].float() for j in range(2)) for t in range(2)])
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)
    assert p310.npu_moe_token_unpermute(torch.randn(4, 128).half(), idx, probs).shape == (2, 128)
    with pytest.raises(ValueError, match="mask before combine"):
        p910.npu_moe_token_unpermute(tok, torch.tensor([1, -1, 3, 2], dtype=I32), probs)


# ---- norm, rotary, scatter, dynamic quant -----------------------------------------------------------------
@pytest.mark.parametrize("module, dtype", [(p310, F16), (p310, F32), (p910, BF16)])
def test_rms_norm_matches_loops(module, dtype):
    x, gamma = torch.randn(3, 2, 8, generator=gen(26)).to(dtype), torch.randn(2, 8, generator=gen(27)).to(dtype)
    y, rstd = module.npu_rms_norm(x, gamma, 1e-5)
    assert y.dtype == dtype and rstd.dtype == F32 and rstd.shape == (3, 1, 1)
    for b in range(3):
        vals = [float(v) for v in x[b].flatten()]
        r = (sum(v * v for v in vals) / len(vals) + 1e-5) ** -0.5
        assert abs(float(rstd[b, 0, 0]) - r) <= 1e-5 * r
        ref = torch.tensor([[float(x[b, i, j]) * r * float(gamma[i, j]) for j in range(8)] for i in range(2)])
        torch.testing.assert_close(y[b].float(), ref.to(dtype).float(), rtol=1e-2, atol=1e-2)  # 1 ulp of bf16


def test_l02_310p_ops_reject_bf16():
    b = torch.randn(4, 128).bfloat16()
    calls = [
        lambda: p310.npu_rms_norm(b, torch.ones(128).bfloat16()),
        lambda: p310.npu_moe_token_unpermute(b, torch.arange(4, dtype=I32)),
        lambda: p310.npu_scatter_nd_update_(b, torch.tensor([[0]]), b[:1]),
        lambda: p310.npu_moe_init_routing_v2(b, torch.zeros(4, 1, dtype=I32), expert_num=2),
        lambda: p310.npu_quant_matmul_dequant(b, randint8(4, 128), torch.ones(4)),
        lambda: p310.npu_quant_grouped_matmul_dequant(b, randint8(2, 4, 128), torch.ones(2, 4), torch.tensor([2, 4])),
        lambda: p310.npu_grouped_matmul([b], [torch.randn(2, 128, 16).bfloat16()], group_list=torch.tensor([2, 4]),
                                        split_item=2, group_type=0),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="L02"):
            call()
    assert p910.npu_rms_norm(b, torch.ones(128).bfloat16())[0].dtype == BF16


def test_dequant_swiglu_quant_910_is_the_documented_clipped_formula_then_a_per_row_int8_quantisation():
    x = torch.randn(3, 8, generator=gen(31)) * 4
    glu, lin = x[:, 0::2], x[:, 1::2]                                     # swiglu_mode 1: even | odd columns
    for alpha, limit, bias in ((1.702, 7.0, 1.0), (1.0, 2.5, 0.0)):
        g = glu.clamp(max=limit)
        y = g * torch.sigmoid(alpha * g) * (lin.clamp(-limit, limit) + bias)
        q, s = p910.npu_dequant_swiglu_quant(x.bfloat16(), activate_left=True, quant_mode=1, swiglu_mode=1,
                                             clamp_limit=limit, glu_alpha=alpha, glu_bias=bias)
        yb = (lambda g, u: g.clamp(max=limit) * torch.sigmoid(alpha * g.clamp(max=limit))
              * (u.clamp(-limit, limit) + bias))(x.bfloat16().float()[:, 0::2], x.bfloat16().float()[:, 1::2])
        assert q.dtype == torch.int8 and s.shape == (3,)
        torch.testing.assert_close(s, yb.abs().amax(-1) / 127)             # the row's amax maps to 127
        assert torch.equal(q, torch.round(yb / s[:, None]).to(torch.int8))
        assert (q.float() * s[:, None] - y).abs().max() <= s.max() * 0.5 + 0.05 * y.abs().max()
    # DeepSeek-V4's clipped SwiGLU (B08) at alpha 1, bias 0: silu(min(gate, L)) * clamp(up, -L, L)
    silu = torch.nn.functional.silu(glu.clamp(max=2.5)) * lin.clamp(-2.5, 2.5)
    q, s = p910.npu_dequant_swiglu_quant(x.bfloat16(), activate_left=True, quant_mode=1, swiglu_mode=1, clamp_limit=2.5,
                                         glu_alpha=1.0, glu_bias=0.0)
    torch.testing.assert_close(q.float() * s[:, None], silu, atol=float(s.max()), rtol=0.02)
    # an int32 GEMM output is dequantised first (weight scale per column, activation scale per row)
    acc = torch.randint(-500, 500, (3, 8), generator=gen(32), dtype=torch.int32)
    ws, xs = torch.rand(8, generator=gen(33)) / 50, torch.rand(3, generator=gen(34)) / 50
    left = {"activate_left": True, "quant_mode": 1, "swiglu_mode": 1, "clamp_limit": 7.0, "glu_alpha": 1.0,
            "glu_bias": 0.0}
    qi, si = p910.npu_dequant_swiglu_quant(acc, weight_scale=ws, activation_scale=xs, **left)
    qf, sf = p910.npu_dequant_swiglu_quant((acc.float() * ws * xs[:, None]).bfloat16(), **left)
    torch.testing.assert_close(qi.float() * si[:, None], qf.float() * sf[:, None], atol=float(sf.max()) * 2, rtol=0.02)
    for bad in ({"swiglu_mode": 0}, {"quant_mode": 0}, {"group_index": torch.tensor([2])}):
        with pytest.raises(NotImplementedError, match="swiglu_mode 1"):
            p910.npu_dequant_swiglu_quant(x.bfloat16(), **{"activate_left": True, "quant_mode": 1, "swiglu_mode": 1, **bad})
    with pytest.raises(ValueError, match="activate_left"):             # the doc: swiglu_mode 1 needs activate_left
        p910.npu_dequant_swiglu_quant(x.bfloat16(), quant_mode=1, swiglu_mode=1)


def test_inplace_partial_rotary_mul_910_rotates_its_slice_as_loops_do():
    t, n, d, rd = 3, 2, 12, 8
    x = torch.randn(t, 1, n, d, generator=gen(28))
    r1, r2 = torch.randn(t, 1, 1, rd, generator=gen(29)), torch.randn(t, 1, 1, rd, generator=gen(30))
    out = x.clone()
    assert p910.inplace_partial_rotary_mul(out, r1, r2, "interleave", [d - rd, d]) is None      # in place
    for i in range(t):
        for h in range(n):
            v = x[i, 0, h, d - rd:].tolist()
            rot = [-v[k + 1] if k % 2 == 0 else v[k - 1] for k in range(rd)]
            ref = [float(r1[i, 0, 0, k]) * v[k] + float(r2[i, 0, 0, k]) * rot[k] for k in range(rd)]
            torch.testing.assert_close(out[i, 0, h, d - rd:], torch.tensor(ref), rtol=1e-6, atol=1e-6)
    assert torch.equal(out[..., : d - rd], x[..., : d - rd])                                    # the rest untouched
    same = x.clone()
    p910.inplace_partial_rotary_mul(same, r1, r2, "interleaved", [d - rd, d])    # a name the binding does not know:
    assert torch.equal(same, x)                                                  # it returns without rotating
    with pytest.raises(ValueError, match="mode only support interleave"):
        p910.inplace_partial_rotary_mul(x.clone(), r1, r2, "half", [d - rd, d])
    with pytest.raises(ValueError, match="must be \\[3, 1 or 1, 1, 8\\]"):
        p910.inplace_partial_rotary_mul(x.clone(), r1[:1], r2[:1], "interleave", [d - rd, d])


@pytest.mark.parametrize("module", [p310, p910])
def test_scatter_nd_update_in_place_tf_semantics(module):
    x = torch.randn(4, 5, 6, generator=gen(31)).half()
    before, idx = x.clone(), torch.tensor([[0, 1], [3, 4], [2, 0]])
    upd = torch.randn(3, 6, generator=gen(32)).half()
    assert module.npu_scatter_nd_update_(x, idx, upd) is x
    for a in range(4):
        for c in range(5):
            hit = [j for j, (i0, i1) in enumerate(idx.tolist()) if (i0, i1) == (a, c)]
            assert torch.equal(x[a, c], upd[hit[0]] if hit else before[a, c])
    with pytest.raises(ValueError, match="updates"):
        module.npu_scatter_nd_update_(x, idx, upd[:2])


def test_scatter_dtypes_per_chip():
    with pytest.raises(ValueError):
        p310.npu_scatter_nd_update_(torch.zeros(3, 2, dtype=I64), torch.tensor([[1]]), torch.ones(1, 2, dtype=I64))
    x = torch.zeros(3, 2, dtype=I64)
    assert p910.npu_scatter_nd_update_(x, torch.tensor([[1]]), torch.ones(1, 2, dtype=I64))[1].tolist() == [1, 1]


def test_dynamic_quant_910_per_token_int8_and_int4_round_trip():
    x = torch.randn(2, 3, 16, generator=gen(33)).half()
    x[0, 0, :2] = torch.tensor([127.0, 0.5])  # s = 1: 0.5 rounds to 0 (half to even)
    y, s = p910.npu_dynamic_quant(x)
    assert y.dtype == I8 and s.dtype == F32 and s.shape == (2, 3) and int(y[0, 0, 1]) == 0
    for i in range(2):
        for j in range(3):
            q, sr = _ref_dynamic_row(x[i, j], 127)
            assert y[i, j].tolist() == q and float(s[i, j]) == float(sr)
    y4, s4 = p910.npu_dynamic_quant(x, dst_type=torch.quint4x2)
    assert y4.dtype == I32 and y4.shape == (2, 3, 2) and s4.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            assert int_numerics.unpack_int4(y4[i, j]).tolist() == _ref_dynamic_row(x[i, j], 7)[0]
    smooth = torch.rand(16, generator=gen(34)) + 0.5
    ys, ss = p910.npu_dynamic_quant(x, smooth_scales=smooth.half())
    assert torch.equal(ss, (x.float() * smooth.half().float()).abs().amax(-1) / 127)
    assert p910.npu_dynamic_quant(x, quant_mode="pertensor")[1].shape == (1,)


def test_int4_packing_order_is_low_nibble_first_and_round_trips():
    assert int_numerics.pack_int4(torch.tensor([1, 2, 3, 4, 5, 6, 7, -1], dtype=I8)).tolist() == [0xF7654321 - 2 ** 32]
    q = torch.randint(-8, 8, (3, 5, 32), generator=gen(35), dtype=I8)
    assert torch.equal(int_numerics.unpack_int4(int_numerics.pack_int4(q)), q)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        int_numerics.pack_int4(torch.full((8,), 9, dtype=I8))


def test_int_matmul_is_exact_and_wraps_like_an_int32_accumulator():
    # int8 operands run in fp64 (every partial sum an integer below 2**53): equal to the int64 product in any
    # layout, and wrapped to int32 past 2**31 as the device's accumulator is
    a, b = randint8(7, 300, seed=36), randint8(300, 24, seed=37)
    assert torch.equal(int_numerics.int_matmul(a, b), torch.matmul(a.to(I64), b.to(I64)).to(I32))
    assert torch.equal(int_numerics.int_matmul(a, b.t().contiguous().t()), int_numerics.int_matmul(a, b))
    k = 2 ** 17 + 8                                   # (-128)^2 * k = 2**31 + 2**17: past int32
    big = int_numerics.int_matmul(torch.full((1, k), -128, dtype=I8), torch.full((k, 1), -128, dtype=I8))
    assert int(big) == 2 ** 14 * k - 2 ** 32


def test_int4_unpacking_reads_each_nibble_of_the_word():
    words = torch.tensor([[-2 ** 31, 2 ** 31 - 1, -1, 0, 0x12345678, -0x789ABCDF]], dtype=I32)
    want = [[((w & 0xFFFFFFFF) >> (4 * i) & 0xF) - 16 * (((w & 0xFFFFFFFF) >> (4 * i) & 0xF) >= 8)
             for i in range(8)] for w in words[0].tolist()]
    got = int_numerics.unpack_int4(words)
    assert got.dtype == I8 and got.shape == (1, 48)
    assert got.reshape(6, 8).tolist() == want
    assert torch.equal(int_numerics.unpack_int4(words[:, 1::2]), got.reshape(6, 8)[1::2].reshape(1, 24))   # a strided view
