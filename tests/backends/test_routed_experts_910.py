"""ascend910's routed experts on one EP rank (backends/ascend910/lowerings.py routed_experts): the rows quantised
once by the routing op, gate | up in one grouped GEMM (the loader merges them: profile merged_weights) and one
npu_clipped_swiglu, the down rows combined straight from the routing order, against the shared composite (dummy
slot, the merged GEMM's halves through the fp32 clipped SwiGLU, tail zeroing, pair-order combine) on the same
checkpoint weights, loaded through the real loader (B21); the launches that saves; and the merge itself."""
from __future__ import annotations

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
                           gmm=lowerings._gmm_w4a8, unpermute=device.npu_moe_token_unpermute, dtype=torch.bfloat16)


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
    limit = model.cfg.swiglu_limit
    guard = CapabilityGuard(rules_from_profile(load_profile("ascend910")), mode="count")
    with guard, guard.section("one rank"):
        got = lowerings.routed_experts(x, weights, ids, *args, limit)
    with guard, guard.section("composite"):
        want = _composite(x, weights, ids, *args, limit)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want) and want.abs().max() > 0      # the same quantisation, GEMMs and combine order
    sections = guard.report().sections
    assert sections["one rank"].launches["npu_dynamic_quant"] == 1              # before the down GEMM only
    assert sections["one rank"].launches["npu_grouped_matmul"] == 2 and sections["one rank"].launches[
        "npu_clipped_swiglu"] == 1
    assert sections["composite"].ops - sections["one rank"].ops >= 8, {n: s.ops for n, s in sections.items()}


def test_the_loader_merges_gate_and_up_where_the_profile_says(tiny_ckpt):
    plain, merged = (load_model(tiny_ckpt, b).params.layers[0] for b in ("cpu", "ascend910"))
    assert plain["ffn.experts.w3.weight"] is not None and merged["ffn.experts.w3.weight"] is None
    assert merged["ffn.shared_experts.w3.weight"] is None
    e, i, d = plain["ffn.experts.w1.weight"].shape                              # reference: [E, I, d] fp32
    w13 = merged["ffn.experts.w1.weight"]                                       # W4A8: [E, d, 2I / 8] packed, [E, 2I]
    assert w13.qweight.shape == (e, d, 2 * i // 8) and w13.scale.shape == (e, 2 * i)
    assert merged["ffn.shared_experts.w1.weight"].qweight.shape[0] == 2 * plain["ffn.shared_experts.w1.weight"].shape[0]


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
