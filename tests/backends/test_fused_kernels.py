"""Fused kernels chosen by the checkpoint's shapes (profile `fused`, spec/fused.py): the limit check on
the real Flash configuration, the choice load_model makes (through the real loader and generated
code, B21), the emulated kernels' own refusals and their semantics against the composites."""
from __future__ import annotations


import pytest
import torch

from backends.ascend910 import device_ops as p910
from backends.common import hc
from lib.emulation.relaxed import relaxed_widths
from lib.guard.capability import CapabilityGuard, rules_from_profile
from lib.records.batch import make_batch
from lib.runtime.loaded_model import load_model
from lib.runtime.paged_cache import PagedCache
from lib.runtime.paged_step import paged_step
from spec.config import RankConfig
from spec.fused import chosen, unmet
from spec.profile import load_profile, profile_path
from spec.variants import variant_config
from spec.yamlio import SpecError

PROFILE = load_profile("ascend910")
MHC = PROFILE.fused["mhc"].limits.values()


def _rank(variant: str, **overrides) -> RankConfig:
    return RankConfig.of(variant_config(variant, overrides or None))


def test_flash_shapes_choose_the_fused_mhc_and_tiny_ones_do_not():
    kernels = {name: k.limits.values() for name, k in PROFILE.fused.items()}
    assert chosen(kernels, _rank("flash-0731")) == {"mhc", "gating", "compressor", "sparse_attn", "indexer"} == chosen(
        kernels, _rank("flash-preview"))
    assert chosen(kernels, _rank("tiny")) == {"gating"}
    assert unmet(PROFILE.fused["gating"].limits.values(), _rank("flash-0731", n_routed_experts=4096)) == [
        "n_routed_experts <= 2048 (found 4096)"]
    assert unmet(MHC, _rank("tiny")) == [f"hidden_size in {{4096, 7168}} (found {_rank('tiny').hidden_size})"]
    # V4.1-Flash's hidden size 5120 is not one the kernels are built for; relaxing widths lets only widths pass
    assert unmet(MHC, _rank("flash-0731", hidden_size=5120)) == ["hidden_size in {4096, 7168} (found 5120)"]
    # the indexer's limits other than widths hold at tiny; the attention's window 16 and the attention's and the
    # compressor's ratio 8 do not (not relaxed)
    assert chosen(kernels, _rank("tiny"), relax_widths=True) == {"mhc", "gating", "indexer"}
    assert unmet(MHC, _rank("tiny", hc_mult=2), relax_widths=True) == ["hc_mult == 4 (found 2)"]
    assert {lim.key for lim in MHC if lim.width} == {"hidden_size"} and all(lim.source for lim in MHC)


def _decode(model):
    store = PagedCache.for_lengths(model, [16])
    store.add(0)
    paged_step(model, make_batch([list(range(20, 31))], [0]), store, [0])
    guard = CapabilityGuard(rules_from_profile(load_profile(model.backend)), mode="count")
    with guard:
        (logits,) = paged_step(model, make_batch([[7]], [11], last_only=True), store, [0])
    return logits, guard.report().total.launches


def test_the_loader_chooses_by_shape_and_the_generated_code_follows(tiny_ckpt):
    plain = load_model(tiny_ckpt, "ascend910")
    assert plain.cfg.fused == {"gating"}            # the router kernel has no width limit: tiny meets it
    with relaxed_widths():
        fused = load_model(tiny_ckpt, "ascend910")
        assert fused.cfg.fused == {"mhc", "gating", "indexer"}
        logits, launches = _decode(fused)
    ref, composite = _decode(plain)
    sub_layers = 2 * len(fused.layers)
    assert launches["npu_hc_post"] == sub_layers
    assert launches["npu_hc_pre_v2"] == sub_layers + 1        # and the head's reduction (hc_head_fused)
    assert "npu_hc_pre_v2" not in composite and sum(launches.values()) < sum(composite.values()) - 50 * sub_layers
    assert launches["moe_gating_top_k_hash"] == composite["moe_gating_top_k_hash"] == len(fused.layers)
    assert logits.dtype == ref.dtype and torch.isfinite(logits).all()
    # outside the relaxed block the fused choice at a tiny width is refused by the kernel, not run wrong
    with pytest.raises(ValueError, match="hidden size .* not one the fused mHC kernel is built for"):
        _decode(fused)


def _hc_inputs(t=5, n=4, d=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, n, d, generator=gen).bfloat16()
    mix = (2 + n) * n
    fn = torch.randn(mix, n * d, generator=gen) * 0.05
    return x, fn, torch.randn(3, generator=gen) * 0.5 + 1, torch.randn(mix, generator=gen) * 0.1


def test_fused_hc_pre_and_post_compute_what_the_composites_do():
    x, fn, scale, base = _hc_inputs()
    with relaxed_widths():
        u, post, comb = p910.npu_hc_pre_v2(x, fn, scale, base, 4, 20, 1e-6, 1e-6)
        y = torch.randn(5, 64).bfloat16()
        out = p910.npu_hc_post(y[None], x[None], post[None], comb[None])[0]
    u_ref, post_ref, comb_ref = hc.hc_pre(x.float(), fn, base, scale, 20, 1e-6, 1e-6, dtype=torch.float32)
    assert (u.dtype, post.dtype, comb.dtype, out.dtype) == (torch.bfloat16, torch.float32, torch.float32, torch.bfloat16)
    torch.testing.assert_close(post, post_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(comb, comb_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(u.float(), u_ref, rtol=8e-3, atol=8e-3)        # one bf16 rounding
    torch.testing.assert_close(comb.sum(-2), torch.ones(5, 4), atol=1e-4, rtol=0)   # a column step ends it
    want = hc.hc_post(y, x.float(), post, comb)
    torch.testing.assert_close(out.float(), want, rtol=8e-3, atol=8e-3)


def test_the_head_reduction_through_the_fused_hc_pre_is_the_composite_hc_head():
    """hc_head_fused hands npu_hc_pre_v2 the head's 4 mixing rows as its pre rows and zero post / comb rows; its
    collapse is the head's y to one bf16 rounding, and the padded weights are made once per head weight."""
    from backends.ascend910 import lowerings as l910

    x, fn24, scale3, base24 = _hc_inputs()
    fn, base, scale = fn24[:4].contiguous(), base24[:4].contiguous(), scale3[:1].contiguous()
    want = hc.hc_head(x.float(), fn, base, scale, 1e-6, 1e-6, dtype=torch.float32)
    with relaxed_widths():
        y = l910.hc_head_fused(x, fn, base, scale, 1e-6, 1e-6)
        guard = CapabilityGuard(rules_from_profile(PROFILE), mode="count")
        with guard:
            again = l910.hc_head_fused(x, fn, base, scale, 1e-6, 1e-6)
        shifted = l910.hc_head_fused(x, fn, base + 1, scale, 1e-6, 1e-6)       # same fn, another base: its own rows
    assert y.dtype == torch.bfloat16 and y.shape == (5, 64) and torch.equal(again, y)
    assert guard.report().total.launches == {"npu_hc_pre_v2": 1}
    torch.testing.assert_close(y.float(), want, rtol=8e-3, atol=8e-3)        # one bf16 rounding
    torch.testing.assert_close(shifted.float(), hc.hc_head(x.float(), fn, base + 1, scale, 1e-6, 1e-6, dtype=torch.float32),
                               rtol=8e-3, atol=8e-3)
    assert not torch.equal(shifted, y)


def test_fused_kernels_refuse_what_the_device_refuses():
    x, fn, scale, base = _hc_inputs()
    with pytest.raises(ValueError, match="hidden size 64 is not one"):
        p910.npu_hc_pre_v2(x, fn, scale, base, 4, 20, 1e-6, 1e-6)
    with relaxed_widths():                       # only the width yields
        with pytest.raises(ValueError, match="the kernel takes 4"):
            x2, fn2, scale2, base2 = _hc_inputs(n=2)
            p910.npu_hc_pre_v2(x2, fn2, scale2, base2, 2, 20, 1e-6, 1e-6)
        with pytest.raises(ValueError, match="x must be bf16"):
            p910.npu_hc_pre_v2(x.float(), fn, scale, base, 4, 20, 1e-6, 1e-6)
        with pytest.raises(ValueError, match="hc_fn must be fp32"):
            p910.npu_hc_pre_v2(x, fn.bfloat16(), scale, base, 4, 20, 1e-6, 1e-6)


def test_a_bad_fused_entry_in_a_profile_is_refused_with_its_line(tmp_path):
    src = profile_path("ascend910").read_text()
    for old, new, msg in (("key: hc_mult", "key: hc_streams", "reads unknown config key 'hc_streams'"),
                          ("      hc_post: {impl: native", "      hc_postt: {impl: native", "unknown op 'hc_postt'"),
                          ("device_ops: [npu_hc_post]", "device_ops: [npu_hc_postx]", "device op 'npu_hc_postx'")):
        path = tmp_path / "profile.yaml"
        path.write_text(src.replace(old, new, 1))
        with pytest.raises(SpecError, match=msg) as err:
            load_profile("ascend910", path)
        assert str(path) in str(err.value)


def test_plan_md_says_which_variants_run_the_fused_kernels():
    from codegen.build import generated_dir

    plan = (generated_dir("ascend910") / "PLAN.md").read_text()
    section = plan.split("## Fused kernels", 1)[1].split("## Tensors", 1)[0]
    assert "| `flash-0731` | fused |" in section and "| `tiny` | composite: hidden_size in {4096, 7168}" in section
    assert "`hc_pre` |  | native, fused `mhc` where the shapes allow" in plan


def test_fused_router_routes_as_the_composite_does():
    from backends.ascend910 import lowerings
    from backends.common import moe

    gen = torch.Generator().manual_seed(3)
    x, gate = torch.randn(6, 32, generator=gen), torch.randn(16, 32, generator=gen) * 0.2
    bias, tid2eid = torch.randn(16, generator=gen) * 0.1, torch.randint(0, 16, (50, 4), generator=gen).int()
    tokens = torch.tensor([3, 9, 49, 0, 3, 17])
    for fused, ref in ((lowerings.route_learned_fused(x, gate, bias, 4, 1.5), moe.route_learned(x, gate, bias, 4, 1.5)),
                       (lowerings.route_hash_fused(x, gate, tid2eid, tokens, 1.5),
                        moe.route_hash(x, gate, tid2eid, tokens, 1.5))):
        assert torch.equal(fused[1], ref[1]) and fused[1].dtype == torch.int32
        torch.testing.assert_close(fused[0], ref[0], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="expert_num .* must be in 1..2048"):
        p910.moe_gating_top_k_hash(torch.zeros(2, 4096), 4, norm_type=2)
    with pytest.raises(ValueError, match="renorm 1"):
        p910.moe_gating_top_k_hash(torch.zeros(2, 16), 4, renorm=1, norm_type=2)
