"""ascend910's routed experts on one EP rank (backends/ascend910/lowerings.py routed_experts): the rows quantised
once by the routing op, gate | up in one grouped GEMM (the loader merges them, interleaved: profile merged_weights)
and one npu_dequant_swiglu_quant for the activation and the down GEMM's quantisation, the down rows combined straight
from the routing order with the shared expert's rows added (npu_moe_finalize_routing), against the shared
composite (dummy slot, the same activation, tail zeroing, pair-order combine, then an add) and against separate
gate and up GEMMs through the fp32 clipped SwiGLU, on the same checkpoint weights, loaded through the real loader
(B21); the launches that saves; the combine kernel's index arrangements; and the merge itself."""
from __future__ import annotations

import functools

import pytest
import torch

from backends.ascend910 import device_ops as device
from backends.ascend910 import lowerings
from backends.common import moe
from lib.guard.capability import CapabilityGuard, rules_from_profile
from lib.runtime.loaded_model import load_model
from spec.profile import load_profile


def _composite(x, weights, ids, w1, w3, w2, placement, limit):
    return moe.grouped_moe(x, weights, ids, w1, w3, w2, placement, limit, init_routing=device.npu_moe_init_routing_v2,
                           gmm=lowerings._gmm_w4a8, unpermute=device.npu_moe_token_unpermute, dtype=torch.bfloat16,
                           merged_swiglu=functools.partial(lowerings.clipped_swiglu_quant, limit=limit))


def test_one_rank_routes_as_the_composite_with_fewer_launches(tiny_ckpt):
    model = load_model(tiny_ckpt, "ascend910")
    lp = next(lp for lp in model.params.layers if "ffn.experts.placement" in lp)
    args = [lp[f"ffn.experts.{w}.weight"] for w in ("w1", "w3", "w2")] + [lp["ffn.experts.placement"]]
    assert args[-1].ep_size == 1 and args[1] is None                             # w3's rows live in w1 now
    g = torch.Generator().manual_seed(3)
    t, e, k = 5, args[-1].n_experts, model.cfg.num_experts_per_tok
    x = torch.randn(t, model.cfg.hidden_size, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    weights = torch.rand(t, k, generator=g)
    shared = torch.randn(t, model.cfg.hidden_size, generator=g).bfloat16()
    limit = model.cfg.swiglu_limit
    guard = CapabilityGuard(rules_from_profile(load_profile("ascend910")), mode="count")
    with guard, guard.section("one rank"):
        got = lowerings.routed_experts(x, weights, ids, *args, shared, limit)
    with guard, guard.section("composite"):
        want = moe.add_shared(_composite(x, weights, ids, *args, limit), shared)
    assert got.dtype == want.dtype == torch.bfloat16
    # the combine weights the rows by the router's fp32 weights and rounds once (the composite: bf16 weights, the
    # unpermute's rounding, then the add's): within two roundings of each other ...
    routed = want.float() - shared.float()
    assert routed.abs().max() > 0
    assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=2 ** -7 * routed.abs().max().item())
    # ... and equal where those agree (weights bf16 already, no shared rows): the same quantisation, GEMMs and order
    exact = weights.bfloat16().float()
    assert torch.equal(lowerings.routed_experts(x, exact, ids, *args, torch.zeros_like(shared), limit),
                       _composite(x, exact, ids, *args, limit))
    sections = guard.report().sections
    one = sections["one rank"].launches
    assert "npu_dynamic_quant" not in one                        # routing quantises the rows, the activation its own
    assert one["npu_grouped_matmul"] == 2 and one["npu_dequant_swiglu_quant"] == 1
    # one combine kernel takes the fp32 weights and adds the shared rows: no unpermute, weight cast or add
    assert one["npu_moe_finalize_routing"] == 1 and "npu_moe_token_unpermute" not in one
    assert not {"aten.add.Tensor", "aten.to.dtype"} & set(one), one
    # the composite's placement-map and row gathers, its own activation quantisation and its tail zeroing
    assert sections["composite"].ops - sections["one rank"].ops >= 8, {n: s.ops for n, s in sections.items()}
    # the interleaved merge computes what separate gate and up GEMMs through the fp32 clipped SwiGLU compute
    w1, w3, w2, placement = args
    gate, up = (lowerings.W4A8(w.qweight, w.scale) for w in _split_interleaved(w1))
    separate = moe.grouped_moe(x, weights, ids, gate, up, w2, placement, limit, init_routing=device.npu_moe_init_routing_v2,
                               gmm=lowerings._gmm_w4a8, unpermute=device.npu_moe_token_unpermute, dtype=torch.bfloat16)
    assert (separate.float() + shared.float() - got.float()).norm() <= 0.02 * separate.float().norm()


def test_finalize_routing_reads_its_index_by_row_or_by_column_and_adds_the_skips():
    """aclnnMoeFinalizeRoutingV2: out[i] = x1[i] + x2[i] + sum_k scales[i, k] rows[idx[r(i, k)]], r = i * K + k in
    drop_pad_mode 2 (npu_moe_init_routing_v2's arrangement), i + k * N in mode 0; fp32 scales beside bf16 rows."""
    rows = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4).bfloat16()          # N = 3 tokens, K = 2
    by_row = torch.tensor([5, 0, 3, 1, 4, 2], dtype=torch.int32)          # token i's k-th row: by_row[2i + k]
    scales = torch.tensor([[1.0, 0.5], [2.0, 0.0], [0.25, 1.0]])
    skip = torch.full((3, 4), 100.0).bfloat16()
    out = device.npu_moe_finalize_routing(rows, skip, None, None, scales, by_row, None, drop_pad_mode=2)
    picked = rows.float()[by_row.long().view(3, 2)]
    want = (picked * scales.unsqueeze(-1)).sum(1) + 100.0
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.bfloat16())
    by_column = by_row.view(3, 2).t().contiguous().view(-1)                         # the same pairs, k-major
    both = device.npu_moe_finalize_routing(rows, skip, skip, None, scales, by_column, None, drop_pad_mode=0)
    assert torch.equal(both, (want + 100.0).bfloat16())
    with pytest.raises(ValueError, match="skip2 needs skip1"):
        device.npu_moe_finalize_routing(rows, None, skip, None, scales, by_row, None, drop_pad_mode=2)
    with pytest.raises(ValueError, match="scales"):
        device.npu_moe_finalize_routing(rows.half(), skip.half(), None, None, scales, by_row, None, drop_pad_mode=2)
    with pytest.raises(NotImplementedError, match="drop_pad_mode 1"):
        device.npu_moe_finalize_routing(rows, skip, None, None, scales, by_row, None, drop_pad_mode=1)


def _split_interleaved(w):
    """A merged interleaved W4A8 weight back into its two projections (even | odd output columns)."""
    from lib.emulation.int_numerics import pack_int4, unpack_int4

    codes = unpack_int4(w.qweight)
    return [lowerings.W4A8(pack_int4(codes[..., j::2].contiguous()), w.scale[..., j::2].contiguous()) for j in (0, 1)]


def test_the_loader_merges_gate_and_up_where_the_profile_says(tiny_ckpt):
    plain, merged = (load_model(tiny_ckpt, b).params.layers[0] for b in ("cpu", "ascend910"))
    assert plain["ffn.experts.w3.weight"] is not None and merged["ffn.experts.w3.weight"] is None
    assert merged["ffn.shared_experts.w3.weight"] is None
    e, i, d = plain["ffn.experts.w1.weight"].shape                              # reference: [E, I, d] fp32
    w13 = merged["ffn.experts.w1.weight"]                                       # W4A8: [E, d, 2I / 8] packed, [E, 2I]
    assert w13.qweight.shape == (e, d, 2 * i // 8) and w13.scale.shape == (e, 2 * i)
    assert merged["ffn.shared_experts.w1.weight"].qweight.shape[0] == 2 * plain["ffn.shared_experts.w1.weight"].shape[0]


def test_merge_outputs_interleaves_where_the_layout_says_and_the_gemm_output_alternates():
    from lib.emulation.int_numerics import pack_int4, unpack_int4
    from lib.quant.runtime_formats import W4A8, W8A8
    from lib.weights.params import merge_outputs

    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    m = merge_outputs(a, b, "interleaved")
    assert torch.equal(m[:, 0::2], a) and torch.equal(m[:, 1::2], b)
    qa, qb = (torch.randint(-127, 128, (3, 4), generator=g, dtype=torch.int8) for _ in range(2))
    w = merge_outputs(W8A8(qa, torch.arange(3.0)), W8A8(qb, 10 + torch.arange(3.0)), "interleaved")
    assert torch.equal(w.qweight[0::2], qa) and torch.equal(w.qweight[1::2], qb)
    assert torch.equal(w.scale, torch.tensor([0.0, 10, 1, 11, 2, 12]))
    ca, cb = (torch.randint(-8, 8, (2, 4, 16), generator=g, dtype=torch.int8) for _ in range(2))   # [E, K, N] codes
    p = merge_outputs(W4A8(pack_int4(ca), torch.ones(2, 16)), W4A8(pack_int4(cb), torch.zeros(2, 16)), "interleaved")
    codes = unpack_int4(p.qweight)
    assert p.qweight.shape == (2, 4, 4) and torch.equal(codes[..., 0::2], ca) and torch.equal(codes[..., 1::2], cb)
    assert torch.equal(p.scale[..., 0::2], torch.ones(2, 16)) and torch.equal(p.scale[..., 1::2], torch.zeros(2, 16))
    with pytest.raises(ValueError, match="one shape"):
        merge_outputs(torch.ones(3, 4), torch.ones(5, 4), "interleaved")
    with pytest.raises(ValueError, match="layout 'zipped'"):
        merge_outputs(a, b, "zipped")


def test_merge_outputs_puts_the_second_rows_after_the_first():
    from lib.quant.runtime_formats import W4A8, W8A8
    from lib.weights.params import merge_outputs

    a, b = torch.ones(2, 3, 4), torch.zeros(2, 5, 4)
    assert torch.equal(merge_outputs(a, b), torch.cat((a, b), dim=1))
    w = merge_outputs(W8A8(torch.ones(3, 4, dtype=torch.int8), torch.ones(3)), W8A8(torch.zeros(5, 4, dtype=torch.int8),
                                                                                     torch.zeros(5)))
    assert w.qweight.shape == (8, 4) and torch.equal(w.scale, torch.tensor([1.0] * 3 + [0.0] * 5))
    p = merge_outputs(W4A8(torch.ones(2, 4, 1, dtype=torch.int32), torch.ones(2, 8)),
                      W4A8(torch.zeros(2, 4, 2, dtype=torch.int32), torch.zeros(2, 16)))
    assert p.qweight.shape == (2, 4, 3) and p.scale.shape == (2, 24)
    with pytest.raises(TypeError, match="one runtime format"):
        merge_outputs(a, W8A8(torch.ones(3, 4, dtype=torch.int8), torch.ones(3)))


@pytest.mark.parametrize("variant", ["tiny", "v41-tiny"])
def test_an_ep_layout_computes_what_one_rank_computes(tmp_path, variant):
    """Under EP the pair rows that come back are combined by the same npu_moe_finalize_routing as on one rank (fp32
    router weights, the shared rows added, one rounding): two EP ranks (simulated in one process) give one rank's
    logits bit for bit, V4 and V4.1 alike (an unpermute with bf16 weights and an add after it moved them by a
    logit or more, and flipped V4.1's FP4-simulated selections)."""
    from lib.runtime.paged_step import prefill_logits
    from lib.weights.params import LoadOptions
    from lib.weights.tiny_checkpoint import make_tiny

    path = make_tiny(tmp_path / "ckpt", variant=variant)
    ids = list(range(3, 27))
    one = prefill_logits(load_model(path, "ascend910"), ids)
    two = prefill_logits(load_model(path, "ascend910", options=LoadOptions(ep_size=2, ep_simulate=True)), ids)
    assert torch.equal(one, two)
