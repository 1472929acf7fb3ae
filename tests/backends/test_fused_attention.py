"""ascend910's fused DeepSeek-V4 attention and indexer (profile `fused: sparse_attn`, `fused: indexer`;
backends/ascend910/fused_attention.py): their limits on the Flash configuration, the emulated
npu_sparse_attn_sharedkv and npu_lightning_indexer against the composites over the same pools, their
refusals, and a tiny model with Flash's window and compress ratios through the real loader (B21)."""
from __future__ import annotations

import pytest
import torch

from backends.ascend910 import device_ops as p910
from backends.ascend910.fused_attention import sparse_attention_fused
from backends.common import attention
from lib.emulation.relaxed import relaxed_widths
from lib.guard.capability import ONCE_PER_STEP, CapabilityGuard, rules_from_profile
from lib.records.batch import make_batch
from lib.runtime.loaded_model import load_model
from lib.runtime.paged_cache import PagedCache
from lib.runtime.paged_step import paged_step
from spec.config import RankConfig
from spec.fused import unmet
from spec.profile import load_profile
from spec.variants import variant_config

PROFILE = load_profile("ascend910")
LIMITS = PROFILE.fused["sparse_attn"].limits.values()



def test_flash_meets_the_kernel_limits_and_only_widths_relax():
    flash = RankConfig.of(variant_config("flash-0731"))
    assert unmet(LIMITS, flash) == []
    tiny = RankConfig.of(variant_config("tiny"))
    assert unmet(LIMITS, tiny, relax_widths=True) == [
        f"sliding_window == 128 (found {tiny.sliding_window})", f"compress_ratios in {{0, 4, 128}} (found {tiny.compress_ratios})"]
    assert unmet(LIMITS, RankConfig.of(variant_config("flash-0731", {"index_topk": 1024}))) == [
        "index_topk <= 512 (found 1024)"]
    assert unmet(LIMITS, RankConfig.of(variant_config("flash-0731", {"head_dim": 256}))) == ["head_dim == 512 (found 256)"]
    assert {lim.key for lim in LIMITS if lim.width} == {"head_dim", "num_attention_heads"} and all(l.source for l in LIMITS)


def _step(model, store, tokens, start, seq=0, **kw):
    return paged_step(model, make_batch([tokens], [start], **kw), store, [seq])


def test_the_fused_kernel_attends_as_the_composite_does(long_tiny):
    """The same pools and the same step through the kernel and through the composite: one softmax over the
    window, the compressed entries (CSA's top-k, HCA's all) and the sink, to bf16 rounding."""
    with relaxed_widths():
        model = load_model(long_tiny, "ascend910")
        assert "sparse_attn" in model.cfg.fused
        store = PagedCache.for_lengths(model, [320], slack=6)
        store.add(0)
        prompt = [20 + (i * 7) % 90 for i in range(300)]
        _step(model, store, prompt, 0)                      # a long chunk: the composite (the ring cannot hold it)
        seen = []

        def both(q, kv, batch, windows, entries, selection, sink, *, window, ratio):
            pools = windows.clone()
            want, _ = attention.sparse_attention(q, kv, batch, pools, entries, selection, sink, window=window, ratio=ratio)
            got, out_pool = sparse_attention_fused(q, kv, batch, windows, entries, selection, sink, window=window,
                                                   ratio=ratio)
            assert torch.equal(out_pool, pools)             # the kernel path wrote the step's rows the same way
            seen.append((ratio, (got.float() - want.float()).abs().max().item(), want.float().abs().max().item()))
            return got, out_pool

        import backends.ascend910.fused_attention as module
        original = module.sparse_attention_fused
        module.sparse_attention_fused = both
        try:
            _step(model, store, [7], 300, last_only=True)                     # decode
            _step(model, store, [7, 15, 15, 15, 15, 15], 301)                 # a verify: anchor + 5 drafts
        finally:
            module.sparse_attention_fused = original
    assert {r for r, _, _ in seen} >= {4, 128}
    for ratio, err, scale in seen:
        assert err <= 2e-2 * max(scale, 1.0), (ratio, err, scale)


def test_decode_launches_the_kernels_and_a_long_chunk_the_composites(long_tiny):
    with relaxed_widths():
        model = load_model(long_tiny, "ascend910")
        store = PagedCache.for_lengths(model, [64])
        store.add(0)
        guard = CapabilityGuard(rules_from_profile(PROFILE), mode="count")
        with guard, guard.section("prefill"):
            _step(model, store, list(range(20, 60)), 0)
        with guard, guard.section("decode"):
            _step(model, store, [7], 40, last_only=True)
    sections = guard.report().sections
    assert "npu_sparse_attn_sharedkv" not in sections["prefill"].launches        # 40 tokens > 144 - 128 + 1
    assert sections["decode"].launches["npu_sparse_attn_sharedkv"] == len(model.layers)
    # the tiling once per attention shape of the step (window only, each ratio), in the first layer of that shape
    tilings = {n: c.launches for n, c in sections.items() if n.startswith("decode/") and n.endswith(ONCE_PER_STEP)}
    shapes = {layer.ratio for layer in model.layers}
    assert "npu_sparse_attn_sharedkv_metadata" not in sections["decode"].launches
    assert sum(c["npu_sparse_attn_sharedkv_metadata"] for c in tilings.values()) == len(shapes) > 1
    compressors = sum(2 if layer.attention == "csa" else layer.attention == "hca" for layer in model.layers)
    assert "compressor" not in sections["prefill"].launches                    # 40 tokens > the rings' slack too
    assert sections["decode"].launches["compressor"] == compressors


def _call(**over):
    t, h, d = 2, 4, 512
    q = torch.randn(t, h, d).bfloat16()
    ori = torch.randn(2, 144, 1, d).bfloat16()
    cu, used = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([10], dtype=torch.int32)
    meta = p910.npu_sparse_attn_sharedkv_metadata(h, 1, d, cu, None, None, None, used, batch_size=1, cmp_topk=0,
                                                  cmp_ratio=1, ori_win_left=127, layout_q="TND", layout_kv="PA_ND",
                                                  has_cmp_kv=False, device="cpu")
    args = dict(ori_kv=ori, ori_block_table=torch.zeros(1, 1, dtype=torch.int32), cu_seqlens_q=cu, seqused_kv=used,
                sinks=torch.zeros(h), metadata=meta, softmax_scale=d ** -0.5, cmp_ratio=1, ori_win_left=127,
                layout_q="TND", layout_kv="PA_ND")
    q = over.pop("q", q)
    args.update(over)
    return p910.npu_sparse_attn_sharedkv(q, **args)


def test_the_kernel_refuses_what_the_device_refuses():
    out, _ = _call()
    assert out.shape == (2, 4, 512) and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="the metadata was built for"):          # another layer's tiling buffer
        _call(ori_win_left=128)                                                  # the schema default, not 127
    with pytest.raises(ValueError, match="block size 136"):
        _call(ori_kv=torch.randn(2, 136, 1, 512).bfloat16())
    with pytest.raises(ValueError, match="head dim 128"):
        _call(q=torch.randn(2, 4, 128).bfloat16(), ori_kv=torch.randn(2, 144, 1, 128).bfloat16())
    with pytest.raises(ValueError, match="ori_block_table is empty"):
        _call(ori_block_table=torch.zeros(1, 0, dtype=torch.int32))
    with pytest.raises(ValueError, match="return_softmax_lse"):
        _call(return_softmax_lse=True)


def test_a_captured_step_replays_the_fused_kernel_as_eager_runs_it(long_tiny):
    """Export-and-replay with the fused attention in the step: a DSpark-sized verify of 4 sequences, every
    per-step fact (cu_seqlens, lengths, the window block table) an input of the exported program."""
    from lib.porting.capture_check import check_bucket

    with relaxed_widths():
        model = load_model(long_tiny, "ascend910")
        check = check_bucket(model, 4, tokens=6, steps=3, max_len=512)
    assert "sparse_attn" in model.cfg.fused and check.identical == check.steps == 3 and check.rows_identical, check


INDEXER = PROFILE.fused["indexer"].limits.values()


def test_flash_meets_the_indexer_limits():
    assert unmet(INDEXER, RankConfig.of(variant_config("flash-0731"))) == []
    assert unmet(INDEXER, RankConfig.of(variant_config("flash-0731", {"index_topk": 4096}))) == [
        "index_topk <= 2048 (found 4096)"]
    assert {lim.key for lim in INDEXER if lim.width} == {"index_n_heads", "index_head_dim"}


def test_the_indexer_kernel_selects_what_the_composite_selects(long_tiny):
    """The same step's indexer calls through the kernel and the composite: the same entries (the kernel orders
    them by score, the composite by id), -1 trailing in both; one kernel launch a CSA layer."""
    import backends.ascend910.fused_attention as module
    from backends.ascend910.fused_attention import index_select_fused

    seen = []

    def both(q, weights, batch, keys, *, topk, ratio, weight_scale, group=None):
        got = index_select_fused(q, weights, batch, keys, topk=topk, ratio=ratio, weight_scale=weight_scale)
        want = attention.index_select(q, weights, batch, keys, topk=topk, ratio=ratio, weight_scale=weight_scale)
        seen.append((got, want))
        return got

    with relaxed_widths():
        model = load_model(long_tiny, "ascend910")
        assert "indexer" in model.cfg.fused
        store = PagedCache.for_lengths(model, [400], slack=6)
        store.add(0)
        _step(model, store, [20 + (i * 11) % 90 for i in range(380)], 0)
        module.index_select_fused, original = both, module.index_select_fused
        try:
            _step(model, store, [7, 15, 15, 15, 15, 15], 380)
        finally:
            module.index_select_fused = original
        guard = CapabilityGuard(rules_from_profile(PROFILE), mode="count")
        with guard:
            _step(model, store, [7], 386, last_only=True)
    csa = sum(layer.attention == "csa" for layer in model.layers)
    assert len(seen) == csa and guard.report().total.launches["npu_lightning_indexer"] == csa
    for got, want in seen:
        assert got.dtype == torch.int32 and got.shape == want.shape
        assert torch.equal(got.sort(-1).values, want.sort(-1).values)          # the same entries (and -1s)
        live = got >= 0
        assert torch.equal(live, live.cummin(-1).values)                        # -1 only trailing


def test_the_indexer_kernel_refuses_what_the_device_refuses():
    t, d = 3, 128
    ends, lens = torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([5, 6, 7], dtype=torch.int32)
    table = torch.zeros(3, 1, dtype=torch.int32)

    def call(q=None, w=None, count=4, **kw):
        q = torch.randn(t, 64, d).bfloat16() if q is None else q
        w = torch.randn(t, q.shape[1]).bfloat16() if w is None else w
        return p910.npu_lightning_indexer(q, torch.randn(1, 16, 1, q.shape[-1]).bfloat16(), w,
                                          actual_seq_lengths_query=ends, actual_seq_lengths_key=lens,
                                          block_table=table, layout_query="TND", layout_key="PA_BSND",
                                          sparse_count=count, **kw)
    ids, _ = call()
    assert ids.shape == (3, 1, 4) and ids.dtype == torch.int32 and bool((ids[:, 0, :] >= 0).all())
    with pytest.raises(ValueError, match="8 heads of 128"):
        call(q=torch.randn(t, 8, d).bfloat16())
    with pytest.raises(ValueError, match="must share fp16 or bf16"):
        call(w=torch.randn(t, 64))
    with pytest.raises(ValueError, match="sparse_count 4096"):
        call(count=4096)
