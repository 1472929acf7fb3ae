"""The spec itself: every file loads, the layer schedule and the tensor inventory of each variant
match the published checkpoints (DSV4-REFERENCE §1.2, §4.1, §4.3, §4.4), shape expressions
evaluate as documented, and every cross-field config rule fires with a message naming its key."""
import json

import msgspec
import pytest

from codegen.lower import lower
from lib.cli.main import main as cli
from spec import expr
from spec.config import CONFIG_KEYS, check_config
from spec.graph import load_graph
from spec.profile import backend_names, load_profile, load_runtime_formats
from spec.schedule import backbone, drafter, drafter_kind, schedule
from spec.tables import expand, load_quant, load_tensor_table
from spec.variants import variant_config, variants
from spec.yamlio import SpecError


@pytest.fixture(scope="module")
def flash():
    return variant_config("flash-0731")


@pytest.fixture(scope="module")
def flash_stored(flash):
    """Official key -> (Logical, Stored) for every safetensors tensor of flash-0731."""
    return {part.key: (t, part) for t in expand(flash) for part in t.parts}


# ---------------------------------------------------------------- loading

def test_every_spec_file_loads():
    quant = load_quant()
    table = load_tensor_table()
    lg = load_graph()
    assert set(quant.dtypes) == {"BF16", "F32", "I64", "I8", "F8_E4M3", "F8_E8M0"}
    assert {"bf16", "f32", "i64", "fp8_block", "mxfp4"} <= set(quant.formats)
    assert table.entries and table.classes and lg.graph.ops and lg.graph.programs
    assert set(load_runtime_formats().formats) >= {"dense_f32", "index_i64"}
    assert "cpu" in backend_names()
    for name in backend_names():
        lower(lg, load_profile(name), table)
    for name in variants():
        variant_config(name)


def test_variants_listed():
    assert set(variants()) == {"flash-0731", "flash-preview", "tiny", "pro", "pro-tiny", "v41-flash", "v41-tiny"}
    assert all(doc for _, doc in variants().values())


# ---------------------------------------------------------------- schedule (DSV4-REFERENCE §1.2)

def test_schedule_flash_0731(flash):
    layers = backbone(flash)
    assert len(layers) == 43
    assert [lay.prefix for lay in layers] == [f"layers.{i}" for i in range(43)]
    assert [lay.index for lay in layers if lay.attention == "swa"] == [0, 1]
    assert [lay.index for lay in layers if lay.attention == "csa"] == list(range(2, 43, 2))
    assert [lay.index for lay in layers if lay.attention == "hca"] == list(range(3, 42, 2))
    assert len([lay for lay in layers if lay.attention == "csa"]) == 21
    assert len([lay for lay in layers if lay.attention == "hca"]) == 20
    assert [lay.ratio for lay in layers[:4]] == [0, 0, 4, 128]
    assert [lay.index for lay in layers if lay.routing == "hash"] == [0, 1, 2]
    assert all(lay.role == "backbone" and lay.stage is None and not lay.last_stage for lay in layers)

    assert drafter_kind(flash) == "dspark"
    stages = drafter(flash)
    assert [s.prefix for s in stages] == ["mtp.0", "mtp.1", "mtp.2"]
    assert [s.stage for s in stages] == [0, 1, 2]
    assert [s.last_stage for s in stages] == [False, False, True]
    assert all(s.role == "dspark" and s.attention == "dspark" and s.ratio == 0 and s.routing == "learned"
               for s in stages)

    for lay in schedule(flash):
        assert lay.rope == ("main" if lay.ratio == 0 else "compress")


def test_schedule_flash_preview():
    cfg = variant_config("flash-preview")
    assert drafter_kind(cfg) == "mtp"
    assert len(backbone(cfg)) == 43
    (stage,) = drafter(cfg)
    assert stage.prefix == "mtp.0" and stage.role == "mtp" and stage.last_stage
    assert stage.attention == "swa" and stage.routing == "learned" and stage.rope == "main"


def test_schedule_tiny_has_every_kind():
    layers = schedule(variant_config("tiny"))
    assert {lay.attention for lay in layers if lay.role == "backbone"} == {"swa", "csa", "hca"}
    assert {lay.routing for lay in layers if lay.role == "backbone"} == {"hash", "learned"}
    assert {lay.rope for lay in layers} == {"main", "compress"}
    assert drafter_kind(variant_config("tiny")) == "dspark"


def test_schedule_pro():
    cfg = variant_config("pro")
    layers = backbone(cfg)
    assert len(layers) == 61
    # HCA, HCA, then CSA / HCA alternating, ending on CSA: 31 HCA, 30 CSA, no sliding-only layer
    assert [lay.index for lay in layers if lay.attention == "hca"] == [0, 1, *range(3, 61, 2)]
    assert [lay.index for lay in layers if lay.attention == "csa"] == list(range(2, 61, 2))
    assert not [lay for lay in layers if lay.attention == "swa"]
    assert {lay.ratio for lay in layers if lay.attention == "hca"} == {128}
    assert [lay.index for lay in layers if lay.routing == "hash"] == [0, 1, 2]
    assert drafter_kind(cfg) == "mtp"
    (stage,) = drafter(cfg)
    assert stage.prefix == "mtp.0" and stage.attention == "swa" and stage.routing == "learned"


def test_schedule_pro_tiny_keeps_pro_kinds():
    layers = backbone(variant_config("pro-tiny"))
    assert [lay.attention for lay in layers] == ["hca", "hca", "csa", "hca", "csa"]
    # both attention kinds under each routing kind, as in Pro
    assert {(lay.attention, lay.routing) for lay in layers} == {
        ("hca", "hash"), ("csa", "hash"), ("hca", "learned"), ("csa", "learned")}
    assert drafter_kind(variant_config("pro-tiny")) == "mtp"


# ---------------------------------------------------------------- inventory (DSV4-REFERENCE §4.1)

def inventory(capsys, *args):
    assert cli(["inventory", *args]) == 0
    return capsys.readouterr().out


def test_inventory_flash_0731_json(capsys):
    got = json.loads(inventory(capsys, "--variant", "flash-0731", "--json"))
    assert got["variant"] == "flash-0731"
    assert (got["all"]["tensors"], got["all"]["bytes"]) == (72_317, 166_878_536_440)
    assert (got["mtp"]["tensors"], got["mtp"]["bytes"]) == (4_705, 10_862_838_300)
    assert got["all"]["dtypes"] == {"BF16": 445, "F32": 433, "F8_E4M3": 390, "F8_E8M0": 35_718, "I64": 3,
                                    "I8": 35_328}


def test_inventory_flash_preview_json(capsys):
    got = json.loads(inventory(capsys, "--variant", "flash-preview", "--json"))
    assert (got["all"]["tensors"], got["all"]["bytes"]) == (69_187, 159_609_485_896)
    assert (got["mtp"]["tensors"], got["mtp"]["bytes"]) == (1_575, 3_593_787_756)
    assert got["all"]["dtypes"] == {"BF16": 433, "F32": 417, "F8_E4M3": 375, "F8_E8M0": 34_167, "I64": 3,
                                    "I8": 33_792}


def test_inventory_pro_json(capsys):
    # Published: huggingface deepseek-ai/DeepSeek-V4-Pro model.safetensors.index.json has 145,116
    # weight_map entries and metadata.total_size 864,704,792,696 in 64 shards (summary of that file in
    # hebo1221/nano-deepseek-v4 references/DeepSeek-V4-Pro-index.summary.json, code-index id
    # 66856996113). Both are checked here. The mtp.* split and the dtype counts are the spec's own,
    # not checked against a published source.
    got = json.loads(inventory(capsys, "--variant", "pro", "--json"))
    assert (got["all"]["tensors"], got["all"]["bytes"]) == (145_116, 864_704_792_696)
    assert (got["mtp"]["tensors"], got["mtp"]["bytes"]) == (2_343, 13_956_587_692)
    assert got["all"]["dtypes"] == {"BF16": 619, "F32": 590, "F8_E4M3": 528, "F8_E8M0": 71_952, "I64": 3,
                                    "I8": 71_424}


def test_inventory_human_readable(capsys):
    assert inventory(capsys, "--variant", "flash-0731").splitlines() == [
        "flash-0731: 72,317 tensors, 166,878,536,440 bytes",
        "  of which mtp.*: 4,705 tensors, 10,862,838,300 bytes",
        "  dtypes: BF16 445, F32 433, F8_E4M3 390, F8_E8M0 35,718, I64 3, I8 35,328",
    ]


def test_inventory_unknown_variant(capsys):
    assert cli(["inventory", "--variant", "flash-9999"]) == 2
    assert capsys.readouterr().err == (
        "dsv4gen inventory: error: unknown model variant 'flash-9999' "
        "(accepted: flash-0731, flash-preview, pro, pro-tiny, tiny, v41-flash, v41-tiny)\n")


# ---------------------------------------------------------------- shapes and TP (DSV4-REFERENCE §4.3-4.4)

@pytest.mark.parametrize("key, shape, dtype", [
    ("layers.0.attn.wq_a.weight", (1024, 4096), "F8_E4M3"),
    ("layers.0.attn.wq_a.scale", (8, 32), "F8_E8M0"),
    ("layers.2.attn.wo_a.weight", (8192, 4096), "F8_E4M3"),
    ("layers.3.attn.compressor.ape", (128, 512), "F32"),
    ("layers.2.attn.compressor.ape", (4, 1024), "F32"),
    ("layers.2.ffn.experts.0.w2.weight", (4096, 1024), "I8"),
    ("layers.2.ffn.experts.0.w2.scale", (4096, 64), "F8_E8M0"),
    ("layers.0.ffn.gate.tid2eid", (129280, 6), "I64"),
    ("mtp.0.main_proj.scale", (32, 96), "F8_E8M0"),
    ("mtp.2.confidence_head.proj.weight", (1, 4352), "BF16"),
    ("mtp.2.markov_head.markov_w2.weight", (129280, 256), "BF16"),
])
def test_stored_shapes_flash_0731(flash_stored, key, shape, dtype):
    _, part = flash_stored[key]
    assert (part.shape, part.dtype) == (shape, dtype)


def test_kind_specific_tensors_flash_0731(flash_stored):
    assert "layers.3.attn.indexer.wq_b.weight" not in flash_stored       # HCA has no indexer
    assert "layers.0.attn.compressor.ape" not in flash_stored            # SWA has no compressor
    assert "layers.3.ffn.gate.tid2eid" not in flash_stored               # learned routing from layer 3
    assert "layers.2.ffn.gate.bias" not in flash_stored                  # hash layers have no bias
    assert "mtp.1.main_proj.weight" not in flash_stored                  # only the first DSpark stage
    assert "mtp.1.markov_head.markov_w1.weight" not in flash_stored      # only the last DSpark stage
    assert "mtp.0.e_proj.weight" not in flash_stored                     # preview MTP only


def test_drafter_shares_embed_and_head(flash_stored):
    assert "embed.weight" in flash_stored and "head.weight" in flash_stored
    assert not [k for k in flash_stored if k.startswith("mtp.") and k.endswith(("embed.weight", "head.weight"))]


ROWS = ("attn.wq_b.weight", "attn.indexer.wq_b.weight", "attn.wo_a.weight", "attn.attn_sink",
        "attn.indexer.weights_proj.weight", "embed.weight", "head.weight")


def expected_tp(key: str) -> str:
    if key in ROWS:
        return "rows"
    if key == "engram.embed.weight":     # V4.1: blocks of ceil(rows / TP) rows (no TP size divides 384,016,682)
        return "row_blocks"
    if key == "attn.wo_b.weight":
        return "cols"
    if key.startswith("ffn.experts."):
        return "experts"
    return "replicate"


def test_tp_of_every_entry():
    for entry in load_tensor_table().entries:
        assert entry.tp == expected_tp(entry.key), entry.key


# ---------------------------------------------------------------- spec.expr

def test_expr_evaluates():
    env = {"hc_mult": 4, "hidden_size": 4096, "a": 7, "b": 2}
    assert expr.evaluate("(2+hc_mult)*hc_mult", env) == 24
    assert expr.evaluate("hc_mult*hidden_size", env) == 16384
    assert expr.evaluate("hidden_size/2", env) == 2048
    assert expr.evaluate("a//b", env) == 3
    assert expr.evaluate("a-b", env) == 5
    assert expr.evaluate("-a", env) == -7
    assert expr.evaluate(128, env) == 128
    assert expr.names("(2+hc_mult)*cdiv(hidden_size, b)") == {"hc_mult", "hidden_size", "b"}


def test_expr_exact_division():
    with pytest.raises(expr.ExprError) as info:
        expr.evaluate("a/b", {"a": 7, "b": 2})
    assert str(info.value) == "'a/b' is not an exact division (7 / 2)"


def test_expr_cdiv():
    assert expr.evaluate("cdiv(rows, block_out)", {"rows": 129, "block_out": 128}) == 2
    assert expr.evaluate("cdiv(rows, block_out)", {"rows": 128, "block_out": 128}) == 1
    with pytest.raises(expr.ExprError) as info:
        expr.evaluate("cdiv(rows)", {"rows": 1})
    assert str(info.value) == "cdiv takes two arguments in 'cdiv(rows)'"


def test_expr_unknown_name():
    with pytest.raises(expr.ExprError) as info:
        expr.evaluate("rows*2", {})
    assert str(info.value) == "shape expression 'rows*2' uses unknown name 'rows'"


@pytest.mark.parametrize("text, construct", [
    ("max(a, b)", "Call"),
    ("__import__('os')", "Call"),
    ("cfg.hidden_size", "Attribute"),
    ("a ** 2", "Pow"),
    ("1.5 * a", "Constant"),
    ("a[0]", "Subscript"),
])
def test_expr_rejects(text, construct):
    with pytest.raises(expr.ExprError) as info:
        expr.parse(text)
    assert str(info.value) == f"shape expression '{text}' uses unsupported syntax ({construct})"


def test_expr_unparsable():
    with pytest.raises(expr.ExprError) as info:
        expr.parse("a +")
    assert str(info.value) == "cannot parse shape expression 'a +'"


# ---------------------------------------------------------------- config.check_config

def bad_config(**changes):
    return msgspec.structs.replace(variant_config("tiny"), **changes)


@pytest.mark.parametrize("changes, key, message", [
    ({"compress_ratios": (0, 0, 4)}, "compress_ratios",
     "compress_ratios has 3 entries, fewer than num_hidden_layers (6)"),
    ({"compress_ratios": (0, 0, 4, 8, 4, 8)}, "compress_ratios",
     "dspark_block_size is set but compress_ratios has no drafter-stage entries "
     "(expected num_hidden_layers + stages = 6 + N entries)"),
    ({"compress_ratios": (0, 0, 4, -8, 4, 8, 0, 0, 0)}, "compress_ratios",
     "compress_ratios entries must be >= 0"),
    ({"compress_ratios": (0, 0, 4, 8, 4, 8, 0, 4, 0)}, "compress_ratios",
     "drafter-stage entries of compress_ratios must be 0 (drafter stages use sliding attention): its first "
     "num_hidden_layers (6) entries are backbone layers and the remaining 3 are drafter stages, found [0, 4, 0]; "
     "change compress_ratios together with num_hidden_layers"),
    ({"dspark_block_size": None}, "dspark_noise_token_id",
     "the dspark_* keys must be all present (DeepSeek-V4-Flash-0731) or all absent (preview); "
     "missing: dspark_block_size"),
    ({"dspark_target_layer_ids": (3, 4, 6)}, "dspark_target_layer_ids",
     "dspark_target_layer_ids names layer 6, outside 0..5"),
    ({"dspark_noise_token_id": 1024}, "dspark_noise_token_id",
     "dspark_noise_token_id 1024 is outside the vocabulary (vocab_size 1024)"),
    ({"o_groups": 3}, "num_attention_heads", "num_attention_heads (8) must be divisible by o_groups (3)"),
    ({"head_dim": 63}, "head_dim", "head_dim (63) must be divisible by 2 (2)"),
    ({"qk_rope_head_dim": 15}, "qk_rope_head_dim", "qk_rope_head_dim (15) must be divisible by 2 (2)"),
    ({"qk_rope_head_dim": 48}, "qk_rope_head_dim", "qk_rope_head_dim (48) exceeds head_dim or index_head_dim"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok", "num_experts_per_tok (9) exceeds n_routed_experts (8)"),
    ({"num_hash_layers": 7}, "num_hash_layers", "num_hash_layers (7) must be within 0..num_hidden_layers"),
])
def test_check_config_rules(changes, key, message):
    cfg = bad_config(**changes)
    with pytest.raises(SpecError) as info:
        check_config(cfg, "config.json")
    assert str(info.value) == f"config.json: {message}"
    assert key in CONFIG_KEYS and all(changed in message for changed in changes)  # names the bad key
    # with a line map, the message points at the blamed key's line
    with pytest.raises(SpecError) as info:
        check_config(cfg, "config.json", {(key,): 17}, "variant 'tiny': ")
    assert str(info.value) == f"config.json:17: variant 'tiny': {message}"


def test_check_config_accepts_every_variant():
    for name in variants():
        cfg = variant_config(name)
        assert check_config(cfg, name) is cfg
