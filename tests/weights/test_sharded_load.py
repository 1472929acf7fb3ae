"""Sharded loading (issue 6), single process: a TP rank reads only its slice of every split tensor,
scales included (B05), an EP rank only its routed experts; each rank's parameters are checked
against the full (TP 1) load on every backend, through the loader users run (B21)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lib.weights import expert_conversion as preconvert
from lib.weights.checkpoint import Checkpoint
from lib.cli.main import main
from lib.quant.reference_formats import decode
from lib.porting.faults import injection
from lib.weights.params import LoadOptions, runtime_key
from lib.runtime.loaded_model import generated, load_model
from lib.weights.tiny_checkpoint import make_tiny
from lib.quant.runtime_formats import W8A8
from spec.profile import load_profile

BACKENDS = ("cpu", "ascend310p", "ascend910", "hip936")
# first -> second key of the weight pairs a backend stacks into one (profile shared_inputs one_gemm)
STACKED = {pair.keys[0]: pair.keys[1] for b in BACKENDS for pair in load_profile(b).shared_inputs.values() if pair.one_gemm}
# The default tiny preset cannot be split (test_default_tiny_is_refused): wo_a's o_groups*o_lora_rank
# = 128 rows (wo_b: columns) are one FP8 block, which TP 2 would cut; TP 4 also cuts indexer.wq_b
# (8*32 rows) and o_groups = 2. This variant keeps the preset's layer kinds and makes every split
# tensor 128-aligned for TP 2 and TP 4.
TP_TINY = {"o_groups": 4, "o_lora_rank": 128, "index_head_dim": 64}
TP, EP, RANK = 2, 2, 1                    # rank 1: the rank whose slices start past 0
E_LOCAL = slice(4, 8)                     # EP rank 1 of 2 holds experts 4..7 of 8 (lib/records/expert_placement.py)


def _spread_wo_b_scales(root) -> None:
    """Give wo_b's column blocks different E8M0 scales (2^-10 .. 2^-7). The tiny maker's random
    weights give every block the same scale byte (117), so a rank reading another rank's scale
    blocks (B05) would change no number; with these it does."""
    index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in sorted({f for k, f in index.items() if k.endswith("attn.wo_b.scale")}):
        tensors = load_file(str(root / shard))
        for key, value in tensors.items():
            if key.endswith("attn.wo_b.scale"):
                bits = value.view(torch.uint8) + torch.arange(value.shape[1], dtype=torch.uint8)
                tensors[key] = bits.view(torch.float8_e8m0fnu)
        save_file(tensors, str(root / shard), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def tp_ckpt(tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp("tp") / "ckpt", overrides=TP_TINY)
    _spread_wo_b_scales(path)
    return path


@pytest.fixture(scope="module")
def loads(tp_ckpt):
    """backend -> (full load, TP 2 / EP 2 rank 1 load), each made once."""
    cache = {}

    def get(backend):
        if backend not in cache:
            local = LoadOptions(tp_size=TP, tp_rank=RANK, ep_size=EP, ep_rank=RANK)
            cache[backend] = (load_model(tp_ckpt, backend), load_model(tp_ckpt, backend, options=local))
        return cache[backend]
    return get


def _value(params, t):
    """The runtime weight of logical tensor t; the first of two weights a block holds stacked as one (profile
    shared_inputs one_gemm: the second is a view of the stacked rows) is the stacked weight's leading rows."""
    if t.layer is None:
        return params.model[runtime_key(t)]
    blocks = params.layers if t.layer.role == "backbone" else params.drafter
    block, key = blocks[int(t.layer.prefix.split(".")[1])], runtime_key(t)
    stacked, tail = block[key], block.get(STACKED.get(key, ""))
    if not (isinstance(stacked, W8A8) and isinstance(tail, W8A8)) or \
            tail.qweight.untyped_storage().data_ptr() != stacked.qweight.untyped_storage().data_ptr():
        return stacked                  # not stacked on this backend
    assert tail.qweight.data_ptr() == stacked.qweight[-tail.qweight.shape[0]:].data_ptr(), key    # its last rows
    return _take(stacked, 0, slice(0, stacked.qweight.shape[0] - tail.qweight.shape[0]))


def _take(value, dim: int, sl: slice):
    """Slice a plain tensor, or every field of a record (W8A8, W4A8, packed FP4) on `dim`."""
    index = (slice(None),) * dim + (sl,)
    return value[index] if isinstance(value, torch.Tensor) else type(value)(*(f[index] for f in value))


def _same(a, b) -> bool:
    if a is None or b is None:          # the second of two merged weights (profile merged_weights): none in either
        return a is b
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and all(_same(x, y) for x, y in zip(a, b))


def check_tp_slices(full, local, ckpt: Checkpoint, tp: int, rank: int) -> set[str]:
    """Compare every non-expert tensor of a TP rank with the full load; returns the rules seen."""
    seen = set()
    for t in ckpt.logical:
        if t.expert is not None:
            continue
        f, mine, rule = _value(full.params, t), _value(local.params, t), t.entry.tp
        seen.add(rule)
        if rule == "replicate":
            assert _same(f, mine), t.key
            continue
        dim = {"rows": 0, "cols": 1}[rule]
        chunk = t.shape[dim] // tp
        sl = slice(rank * chunk, (rank + 1) * chunk)
        if isinstance(f, W8A8) and f.qweight.dim() == 3:
            # w8a8_group (310P wo_b): [G, d, R] with one scale per (group, row); a rank holds whole
            # groups, so its int8 codes and scales are exactly the full tensor's for those groups
            groups = slice(rank * f.qweight.shape[0] // tp, (rank + 1) * f.qweight.shape[0] // tp)
            assert torch.equal(mine.qweight, f.qweight[groups]) and torch.equal(mine.scale, f.scale[groups]), t.key
            continue
        if dim == 0 or not isinstance(f, W8A8):
            # dense formats convert element by element, and W8A8's per-output-row quantisation
            # commutes with a row split: both are exact
            assert _same(_take(f, dim, sl), mine), t.key
            continue
        # W8A8 over a column slice: the row scale is amax of the rank's columns only, so the int8
        # codes differ from the full tensor's; each dequantised value is within half a step
        # (scale / 2, round to nearest) of the exact FP8 value, plus fp32 rounding of the product
        assert mine.qweight.shape == (t.shape[0], chunk) and mine.scale.shape == (t.shape[0],), t.key
        exact = decode(t.format, ckpt.read_parts(t), ckpt.config)[:, sl]
        err = (mine.qweight.float() * mine.scale[:, None] - exact).abs()
        assert bool((err <= mine.scale[:, None] * (0.5 + 1e-5)).all()), t.key
        assert bool((mine.scale <= f.scale).all()), t.key          # amax over fewer columns
    return seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_tp_rank_holds_its_slice_of_every_tensor(tp_ckpt, loads, backend):
    full, local = loads(backend)
    assert check_tp_slices(full, local, Checkpoint(tp_ckpt), TP, RANK) == {"rows", "cols", "replicate"}
    wo_b = local.params.layers[0]["attn.wo_b.weight"]
    q = wo_b.qweight if isinstance(wo_b, W8A8) else wo_b
    assert (q.shape if q.dim() == 2 else (q.shape[1], q.shape[0] * q.shape[2])) == (256, 256)   # [G, d, R] on 310P
    assert local.params.layers[0]["attn.attn_sink"].shape == (4,)          # 1-D rows: heads 4..7
    if backend == "ascend910":          # wq_a | wkv stacked (and CSA's wq_b | indexer wq_b): the unstacking above ran
        for layer, first, second in ((0, "attn.wq_a.weight", "attn.wkv.weight"),
                                     (2, "attn.wq_b.weight", "attn.indexer.wq_b.weight")):
            block = local.params.layers[layer]
            assert block[second].qweight.untyped_storage().data_ptr() == block[first].qweight.untyped_storage().data_ptr()


@pytest.mark.parametrize("backend", BACKENDS)
def test_ep_rank_holds_only_its_experts(loads, backend):
    full, local = loads(backend)
    for big, small in zip((*full.params.layers, *full.params.drafter), (*local.params.layers, *local.params.drafter)):
        keys = [k for k in big if k.startswith("ffn.experts.") and k != "ffn.experts.placement"]
        assert len(keys) == 3
        for key in keys:       # [E/ep, ...] in local order: global experts 4..7 (drafter stages too)
            assert _same(big[key] if big[key] is None else _take(big[key], 0, E_LOCAL), small[key]), key
        placement = small["ffn.experts.placement"]
        assert (placement.n_local, placement.ranks) == (4, (RANK,))


def test_tp4_split_on_the_reference_backend(tp_ckpt, loads):
    """The TP-4 split (one wo_a group and two heads per rank), last rank."""
    full, _ = loads("cpu")
    local = load_model(tp_ckpt, "cpu", options=LoadOptions(tp_size=4, tp_rank=3))
    check_tp_slices(full, local, Checkpoint(tp_ckpt), 4, 3)
    assert local.params.layers[2]["attn.indexer.wq_b.weight"].shape == (128, 128)
    assert local.params.layers[0]["ffn.experts.w1.weight"].shape[0] == 8        # no EP: every expert


def test_a_rank_reads_only_its_bytes(tp_ckpt):
    """Through the read counter: a TP 2 / EP 2 rank copies out of the shards exactly half of each
    split tensor (its scales included), every replicated tensor and its own experts, nothing else."""
    ckpt = Checkpoint(tp_ckpt)
    generated("cpu").loader.load(ckpt, options=LoadOptions(tp_size=TP, tp_rank=RANK, ep_size=EP, ep_rank=RANK))
    split = 0            # bytes of TP-split tensors and routed experts: a rank of 2 x 2 reads half of each
    for t in ckpt.logical:
        size = sum(ckpt.headers[p.key].end - ckpt.headers[p.key].begin for p in t.parts)
        if t.expert is not None or t.entry.tp in ("rows", "cols"):
            split += size
            assert size % 2 == 0, t.key
    assert ckpt.total_bytes() - ckpt.bytes_read == split // 2


def test_default_tiny_splits_inside_one_scale_block(tiny_ckpt):
    """The default tiny's wo_a has 128 rows (one 128-row scale block): at TP 2 each rank reads 64 rows
    and the one block scale they share (B05: sliced to the covering block, not left whole)."""
    full = load_model(tiny_ckpt, "cpu")
    for rank in (0, 1):
        part = load_model(tiny_ckpt, "cpu", options=LoadOptions(tp_size=2, tp_rank=rank))
        a, b = full.params.layers[0]["attn.wo_a.weight"], part.params.layers[0]["attn.wo_a.weight"]
        assert torch.equal(b, a[64 * rank: 64 * (rank + 1)])
        a, b = full.params.layers[0]["attn.wo_b.weight"], part.params.layers[0]["attn.wo_b.weight"]
        assert torch.equal(b, a[:, 64 * rank: 64 * (rank + 1)])


@pytest.mark.parametrize("options, message", [
    ({"tp_size": 3}, "TP 3 does not divide num_attention_heads (8): attention heads are split across TP ranks"),
    ({"tp_size": 8}, "TP 8 does not divide o_groups (4): each TP rank holds whole wo_a groups"),
    ({"tp_size": 2, "tp_rank": 2}, "TP rank 2 of TP size 2: the size must be at least 1 and the rank in 0..1"),
    ({"ep_size": 3}, "expert parallel size 3 must divide n_routed_experts (8)"),
])
def test_bad_sizes_are_clear_errors(tp_ckpt, options, message):
    with pytest.raises(ValueError) as err:
        load_model(tp_ckpt, "cpu", options=LoadOptions(**options))
    assert message in str(err.value)


def test_b05_injection_gives_rank_1_rank_0s_scales(tp_ckpt, loads):
    """B05 loads without complaint on the 310P W8A8 path, and only the row-parallel wo_b of a rank
    past 0 differs: its columns are scaled by rank 0's blocks (2^-10, 2^-9 instead of 2^-8, 2^-7)."""
    full, right = loads("ascend310p")
    with injection("B05", "ascend310p") as fault:
        wrong = load_model(tp_ckpt, "ascend310p", options=fault.options(LoadOptions(tp_size=TP, tp_rank=RANK,
                                                                                    ep_size=EP, ep_rank=RANK)))
    ckpt = Checkpoint(tp_ckpt)
    for t in ckpt.logical:
        if t.expert is None:
            assert _same(_value(right.params, t), _value(wrong.params, t)) == (t.entry.tp != "cols"), t.key
    good, bad = right.params.layers[0]["attn.wo_b.weight"], wrong.params.layers[0]["attn.wo_b.weight"]
    assert torch.equal(good.qweight, bad.qweight)      # the same codes, scaled 4x too small per row
    assert torch.allclose(bad.scale * 4, good.scale)


def test_preconverted_tp2_ep2_round_trip(tp_ckpt, loads, tiny_ckpt, tmp_path):
    assert main(["convert", "--model", str(tp_ckpt), "--backend", "ascend310p", "--tp", "2", "--ep", "2"]) == 0
    out = preconvert.default_dir(tp_ckpt, "ascend310p", 2, 2)
    marker = json.loads((out / preconvert.MARKER).read_text())
    assert (marker["tp"], marker["ep"], marker["files"]) == (2, 2, ["rank-00-of-02.safetensors",
                                                                    "rank-01-of-02.safetensors"])
    options = LoadOptions(expert_mode="preconverted", tp_size=TP, tp_rank=RANK, ep_size=EP, ep_rank=RANK)
    pre = load_model(tp_ckpt, "ascend310p", options=options)
    _, resident = loads("ascend310p")
    for a, b in zip((pre.params.model, *pre.params.layers, *pre.params.drafter),
                    (resident.params.model, *resident.params.layers, *resident.params.drafter)):
        assert set(a) == set(b) and all(_same(a[k], b[k]) for k in a if k != "ffn.experts.placement")
    for change, need in (({"tp_size": 4, "tp_rank": 0}, "tp is 2, but loading needs 4"),
                         ({"ep_size": 4, "ep_rank": 0}, "ep is 2, but loading needs 4")):
        with pytest.raises(ValueError, match=need):
            load_model(tp_ckpt, "ascend310p", options=options._replace(preconverted=str(out), **change))
    with pytest.raises(ValueError, match=r"TP=2 and EP=3: each must be 1 or the world size max\(TP, EP\)=3"):
        preconvert.convert(tp_ckpt, "ascend310p", tmp_path / "x", tp=2, ep=3)
    with pytest.raises(ValueError, match="tensor parallel size 3 does not divide num_attention_heads"):
        preconvert.convert(tiny_ckpt, "ascend310p", tmp_path / "y", tp=3)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
