"""ascend910's fused DeepSeek-V4 compressor (profile `fused: compressor`; backends/ascend910/fused_attention.py
compress_fused): its limits on the Flash configuration, the emulated kernel against the composite over the same
state pools, its refusals and its skipped block 0, and a tiny model with Flash's compress ratios through the
real loader (B21)."""
from __future__ import annotations

import pytest
import torch

from backends.ascend910 import device_ops as p910
from backends.ascend910 import fused_attention as module
from backends.ascend910 import lowerings
from lib.emulation.relaxed import relaxed_widths
from lib.records.batch import make_batch
from lib.runtime.loaded_model import load_model
from lib.runtime.paged_cache import PagedCache
from lib.runtime.paged_step import paged_step
from spec.config import RankConfig
from spec.fused import unmet
from spec.profile import load_profile
from spec.variants import variant_config

PROFILE = load_profile("ascend910")
LIMITS = PROFILE.fused["compressor"].limits.values()


def test_flash_meets_the_compressor_limits_and_only_widths_relax():
    flash = RankConfig.of(variant_config("flash-0731"))
    assert unmet(LIMITS, flash) == []
    tiny = RankConfig.of(variant_config("tiny"))
    assert unmet(LIMITS, tiny, relax_widths=True) == [f"compress_ratios in {{0, 4, 128}} (found {tiny.compress_ratios})"]
    assert unmet(LIMITS, RankConfig.of(variant_config("flash-0731", {"index_head_dim": 64}))) == [
        "index_head_dim == 128 (found 64)"]
    assert unmet(LIMITS, RankConfig.of(variant_config("flash-0731", {"hidden_size": 4000}))) == [
        "hidden_size <= 10240 and hidden_size % 512 == 0 (found 4000)"]
    assert {lim.key for lim in LIMITS if not lim.width} == {"compress_ratios"} and all(l.source for l in LIMITS)


def _step(model, store, tokens, start, seq=0, **kw):
    return paged_step(model, make_batch([tokens], [start], **kw), store, [seq])


def test_the_fused_compressor_writes_what_the_composite_writes(long_tiny):
    """The same pools and the same step through the kernel and through the composite: the same state rows
    (A | Z + ape of the step's positions) and the same entries, to bf16 rounding of the projections."""
    with relaxed_widths():
        model = load_model(long_tiny, "ascend910")
        assert "compressor" in model.cfg.fused
        store = PagedCache.for_lengths(model, [400], slack=6)
        store.add(0)
        _step(model, store, [20 + (i * 7) % 90 for i in range(254)], 0)       # a long chunk: the composite
        seen = []

        def both(h, batch, pools, *args, ratio, **kw):
            twin = pools._replace(state=pools.state.clone(), entries=pools.entries.clone())
            lowerings.compress(h, batch, twin, *args, ratio=ratio, **kw)
            original(h, batch, pools, *args, ratio=ratio, **kw)
            written = batch.state.writes[ratio].slots
            entry_err = (pools.entries[written].float() - twin.entries[written].float()).abs()
            seen.append((ratio, written.numel(), (pools.state - twin.state).abs().max().item(),
                         entry_err.max().item() if written.numel() else 0.0))
            return pools

        original, module.compress_fused = module.compress_fused, both
        try:
            for p in range(254, 258):                                      # decodes across a ratio-4 boundary
                _step(model, store, [7 + p % 5], p, last_only=True)
            _step(model, store, [7, 15, 15, 15, 15, 15], 258)              # a verify: anchor + 5 drafts
        finally:
            module.compress_fused = original
    assert {r for r, *_ in seen} == {4, 128} and any(n for r, n, *_ in seen if r == 4)
    assert any(n for r, n, *_ in seen if r == 128)                        # position 255 completes entry 1 of 128
    for ratio, _, state_err, entry_err in seen:
        assert state_err <= 2e-2 and entry_err <= 3e-2, (ratio, state_err, entry_err)


def _call(**over):
    """One decode token of each of two sequences at positions 7 and 5 (ratio 4, overlap: position 7 completes
    entry 1), state blocks 1 and 2 of 16 rows, through the registered op."""
    t, hid, d, m = 2, 1024, 128, 4
    g = torch.Generator().manual_seed(0)
    args = dict(x=torch.randn(t, hid, generator=g).bfloat16(), wkv=torch.randn(2 * d, hid, generator=g).bfloat16() / 32,
                wgate=torch.randn(2 * d, hid, generator=g).bfloat16() / 32,
                state_cache=torch.randn(3, 16, 4 * d, generator=g), ape=torch.randn(m, 2 * d, generator=g),
                norm_weight=torch.ones(d).bfloat16(), rope_sin=torch.zeros(2, 64).bfloat16(),
                rope_cos=torch.ones(2, 64).bfloat16(), state_block_table=torch.tensor([[1], [2]], dtype=torch.int32),
                cu_seqlens=torch.tensor([0, 1, 2], dtype=torch.int32), seqused=None,
                start_pos=torch.tensor([7, 5], dtype=torch.int32), rope_head_dim=64, cmp_ratio=m, coff=2,
                norm_eps=1e-6, rotary_mode=2, cache_mode=1)
    args.update(over)
    return p910.compressor(**args), args


def test_the_kernel_pools_its_state_and_skips_block_zero():
    out, args = _call()
    state = args["state_cache"]
    assert out.shape == (2, 128) and out.dtype == torch.bfloat16
    assert out[1].eq(0).all() and out[0].abs().sum() > 0                       # one entry completes: row 0, then pad
    a = args["x"][0].float() @ args["wkv"].float().t()
    assert torch.allclose(state[1, 7, :256], a, atol=1e-4)                      # position 7 at row 7 of block 1
    assert torch.allclose(state[1, 7, 256:], args["x"][0].float() @ args["wgate"].float().t() + args["ape"][3], atol=1e-4)
    kept = torch.randn(3, 16, 512)
    _call(state_cache=kept.clone(), state_block_table=torch.tensor([[0], [2]], dtype=torch.int32))
    written = kept.clone()
    _call(state_cache=written, state_block_table=torch.tensor([[0], [2]], dtype=torch.int32))
    assert torch.equal(written[0], kept[0]) and not torch.equal(written[2, 5], kept[2, 5])   # block 0 never written


def test_the_kernel_refuses_what_the_device_refuses():
    with pytest.raises(ValueError, match=r"\(head_dim, coff, cmp_ratio\) \(128, 1, 4\)"):
        _call(coff=1, wkv=torch.zeros(128, 1024).bfloat16(), wgate=torch.zeros(128, 1024).bfloat16(),
              ape=torch.zeros(4, 128), state_cache=torch.zeros(3, 16, 256))
    with pytest.raises(ValueError, match="block size a multiple of 16"):
        _call(state_cache=torch.zeros(3, 12, 512))
    with pytest.raises(ValueError, match="ape must be fp32"):
        _call(ape=torch.zeros(4, 256).bfloat16())
    with pytest.raises(ValueError, match=r"rope_sin must be .*\(2, 64\)"):
        _call(rope_sin=torch.zeros(1, 64).bfloat16())
    with pytest.raises(ValueError, match="rotary_mode 1"):
        _call(rotary_mode=1)
    with pytest.raises(ValueError, match="never seqused"):
        _call(seqused=torch.tensor([1, 1], dtype=torch.int32))
