"""`make_tiny` / `dsv4gen make-tiny` write exactly the official checkpoint format, deterministically
and atomically, and `--set` overrides go through the config validator.

Oracles: the raw safetensors header JSON (parsed here, not by lib.weights.checkpoint), the tiny preset's
numbers written out by hand, and the official layout rules (DSV4-REFERENCE §4); `spec.tables.expand`
is compared against, never used to decide what a single tensor should look like.
"""
import json
import math
import re

import pytest
import torch

import lib.weights.checkpoint_writer
import lib.weights.tiny_checkpoint
from lib.weights.checkpoint import Checkpoint
from spec.config import load_config_json
from spec.tables import expand
from spec.variants import variant_config

from tests.weights.tiny_layout import (E, H, HASH_LAYERS, HC, HEAD_DIM, HEADS, INDEX, KINDS, MOE, Q_LORA, SHARDS, VOCAB,
                                         WIDTH, all_bytes, block_of, read_layout)


@pytest.fixture(scope="module")
def layout(tiny_ckpt):
    return read_layout(tiny_ckpt)


# ------------------------------------------------------------------ official layout

def test_files_index_and_side_files(tiny_ckpt, layout):
    index, tensors = layout
    assert sorted(p.name for p in tiny_ckpt.iterdir()) == sorted(
        ["config.json", "generation_config.json", INDEX, *SHARDS, "tokenizer.json", "tokenizer_config.json"])
    for key, (shard, dtype, shape, nbytes) in tensors.items():
        assert nbytes == WIDTH[dtype] * math.prod(shape), key
    assert index["metadata"]["total_size"] == sum(t[3] for t in tensors.values())
    # the weight map covers every stored key and names the shard that holds it, nothing else
    assert index["weight_map"] == {k: t[0] for k, t in tensors.items()}
    per_shard = {s: sum(1 for t in tensors.values() if t[0] == s) for s in SHARDS}
    assert all(n > 0 for n in per_shard.values()), per_shard

    gen = json.loads((tiny_ckpt / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (0, 1)
    tok = json.loads((tiny_ckpt / "tokenizer.json").read_text(encoding="utf-8"))
    assert tok["model"]["type"] == "BPE" and len(tok["model"]["vocab"]) == VOCAB
    tok_cfg = json.loads((tiny_ckpt / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok_cfg["bos_token"] == "<｜begin▁of▁sentence｜>" and tok_cfg["eos_token"] == "<｜end▁of▁sentence｜>"


def test_config_json_has_official_keys(tiny_ckpt):
    raw = json.loads((tiny_ckpt / "config.json").read_text(encoding="utf-8"))
    cfg, unknown = load_config_json(tiny_ckpt / "config.json")
    assert unknown == []
    assert cfg == variant_config("tiny")
    assert raw["num_hidden_layers"] == 6
    # 6 backbone entries, then one 0 per DSpark drafter stage
    assert raw["compress_ratios"] == [0, 0, 4, 8, 4, 8, 0, 0, 0]
    assert {k: raw[k] for k in raw if k.startswith("dspark_")} == {
        "dspark_block_size": 5, "dspark_noise_token_id": 15, "dspark_target_layer_ids": [3, 4, 5],
        "dspark_markov_rank": 16}
    assert raw["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                          "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    assert (raw["model_type"], raw["architectures"], raw["expert_dtype"]) == (
        "deepseek_v4", ["DeepseekV4ForCausalLM"], "fp4")
    assert (raw["hidden_size"], raw["vocab_size"], raw["n_routed_experts"]) == (H, VOCAB, E)


# The FP8 block-quantised linears of the official checkpoint (routed experts are FP4, the rest plain).
FP8_LINEARS = re.compile(r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|main_proj)"
                         r"\.weight$")


def expected_dtype(key: str) -> str:
    """The official storage rule for a key (DSV4-REFERENCE §4.2-4.3), independent of quant.yaml."""
    if key.endswith(".scale"):          # `hc_*_scale` has no dot before "scale"
        return "F8_E8M0"
    if re.search(r"\.ffn\.experts\.\d+\.w[123]\.weight$", key):
        return "I8"
    if FP8_LINEARS.search(key):
        return "F8_E4M3"
    if key.endswith("tid2eid"):
        return "I64"
    if re.search(r"(^|\.)hc_|attn_sink$|\.ape$|gate\.bias$", key):
        return "F32"
    return "BF16"


def test_every_tensor_has_the_official_dtype(layout):
    _, tensors = layout
    wrong = {k: (t[1], expected_dtype(k)) for k, t in tensors.items() if t[1] != expected_dtype(k)}
    assert wrong == {}
    # scales exist exactly for the quantised weights (none for the head: B06)
    assert {k[:-6] for k in tensors if k.endswith(".scale")} == {
        k[:-7] for k, t in tensors.items() if t[1] in ("F8_E4M3", "I8")}
    counts = {d: sum(1 for t in tensors.values() if t[1] == d) for d in WIDTH}
    assert all(counts[d] > 0 for d in WIDTH), counts
    # every FP8 weight carries a [ceil(out/128), ceil(in/128)] scale; every FP4 expert [rows, cols/32]
    for key, (_, dtype, shape, _) in tensors.items():
        if dtype == "F8_E4M3":
            assert tensors[key[:-6] + "scale"][2] == (-(-shape[0] // 128), -(-shape[1] // 128)), key
        if dtype == "I8":
            assert tensors[key[:-6] + "scale"][2] == (shape[0], 2 * shape[1] // 32), key


@pytest.mark.parametrize("block", sorted(KINDS))
def test_spot_shapes_per_block(layout, block):
    _, tensors = layout
    want = {
        "attn.wq_a.weight": ("F8_E4M3", (Q_LORA, H)), "attn.wq_a.scale": ("F8_E8M0", (1, 2)),
        "attn.wq_b.weight": ("F8_E4M3", (HEADS * HEAD_DIM, Q_LORA)), "attn.wq_b.scale": ("F8_E8M0", (4, 1)),
        "attn.wkv.weight": ("F8_E4M3", (HEAD_DIM, H)), "attn.wo_b.scale": ("F8_E8M0", (2, 1)),
        "attn_norm.weight": ("BF16", (H,)), "attn.attn_sink": ("F32", (HEADS,)),
        "hc_attn_fn": ("F32", ((2 + HC) * HC, HC * H)), "ffn.gate.weight": ("BF16", (E, H)),
        "ffn.experts.0.w1.weight": ("I8", (MOE, H // 2)), "ffn.experts.0.w1.scale": ("F8_E8M0", (MOE, H // 32)),
        f"ffn.experts.{E - 1}.w2.weight": ("I8", (H, MOE // 2)),
        f"ffn.experts.{E - 1}.w2.scale": ("F8_E8M0", (H, MOE // 32)),
        "ffn.shared_experts.w2.weight": ("F8_E4M3", (H, MOE)),
    }
    for rel, (dtype, shape) in want.items():
        assert tensors[f"{block}.{rel}"][1:3] == (dtype, shape), f"{block}.{rel}"
    assert not any(k.startswith(f"{block}.ffn.experts.{E}.") for k in tensors)   # exactly E experts
    if block in HASH_LAYERS:
        assert tensors[f"{block}.ffn.gate.tid2eid"][1:3] == ("I64", (VOCAB, 2))
        assert f"{block}.ffn.gate.bias" not in tensors
    else:
        assert tensors[f"{block}.ffn.gate.bias"][1:3] == ("F32", (E,))
        assert f"{block}.ffn.gate.tid2eid" not in tensors


def test_model_level_tensors(layout):
    _, tensors = layout
    model = {k: t[1:3] for k, t in tensors.items() if block_of(k) is None}
    assert model == {"embed.weight": ("BF16", (VOCAB, H)), "head.weight": ("BF16", (VOCAB, H)),
                     "norm.weight": ("BF16", (H,)), "hc_head_fn": ("F32", (HC, HC * H)),
                     "hc_head_base": ("F32", (HC,)), "hc_head_scale": ("F32", (1,))}


def attention_kind(tensors, block: str) -> str:
    keys = {k[len(block) + 1:] for k in tensors if block_of(k) == block}
    if not any(k.startswith("attn.compressor.") for k in keys):
        assert not any(k.startswith("attn.indexer.") for k in keys), block
        return "swa"
    return "csa" if any(k.startswith("attn.indexer.") for k in keys) else "hca"


def test_every_layer_kind_is_present(layout):
    _, tensors = layout
    assert {b for b in map(block_of, tensors) if b} == set(KINDS)
    assert {b: attention_kind(tensors, b) for b in KINDS} == KINDS
    routing = {b: "hash" if f"{b}.ffn.gate.tid2eid" in tensors else "learned" for b in KINDS}
    assert {b for b, r in routing.items() if r == "hash"} == HASH_LAYERS
    assert set(KINDS.values()) == {"swa", "csa", "hca"} and set(routing.values()) == {"hash", "learned"}
    # CSA: overlapping compressor at 2*head_dim + the full lightning indexer; HCA: head_dim only
    indexer = {k[len("layers.2."):]: t[1:3] for k, t in tensors.items() if k.startswith("layers.2.attn.indexer.")}
    assert indexer == {"attn.indexer.wq_b.weight": ("F8_E4M3", (8 * 32, Q_LORA)),
                       "attn.indexer.wq_b.scale": ("F8_E8M0", (2, 1)),
                       "attn.indexer.weights_proj.weight": ("BF16", (8, H)),
                       "attn.indexer.compressor.ape": ("F32", (4, 64)),
                       "attn.indexer.compressor.wkv.weight": ("BF16", (64, H)),
                       "attn.indexer.compressor.wgate.weight": ("BF16", (64, H)),
                       "attn.indexer.compressor.norm.weight": ("BF16", (32,))}
    assert tensors["layers.2.attn.compressor.ape"][1:3] == ("F32", (4, 2 * HEAD_DIM))
    assert tensors["layers.2.attn.compressor.wkv.weight"][1:3] == ("BF16", (2 * HEAD_DIM, H))
    assert tensors["layers.3.attn.compressor.ape"][1:3] == ("F32", (8, HEAD_DIM))
    assert tensors["layers.3.attn.compressor.wgate.weight"][1:3] == ("BF16", (HEAD_DIM, H))


def test_dspark_drafter_stages(layout):
    _, tensors = layout
    mtp = {k: t[1:3] for k, t in tensors.items() if k.startswith("mtp.")}
    assert mtp["mtp.0.main_proj.weight"] == ("F8_E4M3", (H, 3 * H))      # 3 target layers
    assert mtp["mtp.0.main_proj.scale"] == ("F8_E8M0", (2, 6))
    assert mtp["mtp.0.main_norm.weight"] == ("BF16", (H,))
    assert mtp["mtp.2.markov_head.markov_w1.weight"] == ("BF16", (VOCAB, 16))
    assert mtp["mtp.2.markov_head.markov_w2.weight"] == ("BF16", (VOCAB, 16))
    assert mtp["mtp.2.confidence_head.proj.weight"] == ("BF16", (1, H + 16))
    assert mtp["mtp.2.norm.weight"] == ("BF16", (H,)) and mtp["mtp.2.hc_head_fn"] == ("F32", (HC, HC * H))
    # first-stage tensors only in mtp.0, last-stage ones only in mtp.2; no preview-MTP tensors
    assert sorted(k for k in mtp if ".main_" in k) == ["mtp.0.main_norm.weight", "mtp.0.main_proj.scale",
                                                       "mtp.0.main_proj.weight"]
    last = [k for k in mtp if re.match(r"mtp\.\d+\.(markov_head\.|confidence_head\.|norm\.weight|hc_head_)", k)]
    assert sorted(last) == ["mtp.2.confidence_head.proj.weight", "mtp.2.hc_head_base", "mtp.2.hc_head_fn",
                            "mtp.2.hc_head_scale", "mtp.2.markov_head.markov_w1.weight",
                            "mtp.2.markov_head.markov_w2.weight", "mtp.2.norm.weight"]
    assert not [k for k in mtp if re.search(r"e_proj|h_proj|enorm|hnorm", k)]
    # B16: the drafter shares the target's embed/head and the checkpoint has none of its own
    assert not [k for k in mtp if re.match(r"mtp\.\d+\.(embed|head)\b", k)]


def test_key_set_equals_the_spec_expansion(tiny_ckpt, layout):
    _, tensors = layout
    cfg, _ = load_config_json(tiny_ckpt / "config.json")
    spec = {p.key: (p.dtype, p.shape) for t in expand(cfg) for p in t.parts}
    assert set(tensors) == set(spec)
    assert {k: t[1:3] for k, t in tensors.items()} == spec


def test_tid2eid_rows_name_distinct_experts_in_range(tiny_ckpt):
    ckpt = Checkpoint(tiny_ckpt)
    tables = [ckpt.read(f"layers.{i}.ffn.gate.tid2eid") for i in range(3)]
    for t in tables:
        assert t.dtype == torch.int64 and t.shape == (VOCAB, 2)
        assert int(t.min()) >= 0 and int(t.max()) < E
        assert bool((t[:, 0] != t[:, 1]).all())
        assert set(t.flatten().tolist()) == set(range(E))      # every expert is reachable
    assert not torch.equal(tables[0], tables[1])                # drawn per layer


# ------------------------------------------------------------------ determinism

def test_same_seed_gives_byte_identical_files(tiny_ckpt, tmp_path):
    again = lib.weights.tiny_checkpoint.make_tiny(tmp_path / "again", seed=0)
    assert all_bytes(again) == all_bytes(tiny_ckpt)


def test_other_seed_gives_other_weights(tiny_ckpt, tmp_path):
    other = lib.weights.tiny_checkpoint.make_tiny(tmp_path / "other", seed=1)
    a, b = all_bytes(tiny_ckpt), all_bytes(other)
    assert a.keys() == b.keys()
    for name in ("config.json", INDEX, "tokenizer.json"):
        assert a[name] == b[name], name
    assert all(a[s] != b[s] for s in SHARDS)
    ca, cb = Checkpoint(tiny_ckpt), Checkpoint(other)
    for key in ("embed.weight", "layers.0.attn.wq_a.weight", "layers.0.ffn.gate.tid2eid"):
        assert not torch.equal(ca.read(key).view(torch.uint8), cb.read(key).view(torch.uint8)), key


def test_cached_checkpoints_are_named_by_every_spec_source(tmp_path, monkeypatch):
    """An edit to any spec source (the variant tables' Python as much as the YAML) names a new cached embedded
    checkpoint, so a developer's cache never serves weights an older spec made."""
    import shutil

    spec_copy = tmp_path / "spec"
    shutil.copytree(lib.weights.tiny_checkpoint.SPEC_DIR, spec_copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(lib.weights.tiny_checkpoint, "SPEC_DIR", spec_copy)
    before = lib.weights.tiny_checkpoint.maker_hash("0")
    assert lib.weights.tiny_checkpoint.maker_hash("0") == before
    (spec_copy / "variants.py").write_text((spec_copy / "variants.py").read_text() + "\n# edited\n")
    assert lib.weights.tiny_checkpoint.maker_hash("0") != before
