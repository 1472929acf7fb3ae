"""Pinned error messages for malformed spec files (STYLE.md: every message names the file, the line
and the accepted alternatives). Each test copies a real spec file into tmp_path with one targeted
edit, so the edit documents the mistake, and asserts the whole message. Line numbers are taken
from the edited text (the line the edit is on) so unrelated spec edits do not break these tests;
long accepted lists (ops, classes, config keys) come from the real spec for the same reason."""
import pytest

from spec import variants
from spec.config import CONFIG_KEYS
from spec.tables import load_quant, load_tensor_table
from tests.spec.spec_edits import MODEL, QUANT, TENSORS, edit, error_of, line, real_classes


# ---------------------------------------------------------------- tensors.yaml

def tensors(tmp_path, old, new):
    return edit(TENSORS, tmp_path / "tensors.yaml", old, new)


def test_tensors_unknown_key(tmp_path):
    p = tensors(tmp_path, "{key: norm.weight, scope: model, shape:", "{key: norm.weight, scope: model, shpe:")
    assert error_of(load_tensor_table, p) == (
        f"{p}:{line(p, 'shpe:')}: unknown key 'shpe' (accepted: key, scope, shape, format, tp, class, when) "
        "at 'entries.2.shpe'")


def test_tensors_missing_required_key(tmp_path):
    p = tensors(tmp_path, "{key: hc_head_base, scope: model, ", "{key: hc_head_base, ")
    assert error_of(load_tensor_table, p) == (
        f"{p}:{line(p, '{key: hc_head_base, shape')}: missing required key 'scope' at 'entries.4'")


def test_tensors_bad_tp(tmp_path):
    p = tensors(tmp_path, "tp: rows, class: head}", "tp: row, class: head}")
    assert error_of(load_tensor_table, p) == (
        f"{p}:{line(p, 'tp: row,')}: invalid enum value 'row' (accepted: replicate, rows, row_blocks, cols, experts) "
        "at 'entries.1.tp'")


def test_tensors_unknown_format(tmp_path):
    p = tensors(tmp_path, "format: bf16, tp: rows, class: head}", "format: bf61, tp: rows, class: head}")
    assert error_of(load_tensor_table, p) == (
        f"{p}:{line(p, 'bf61')}: unknown format 'bf61' for head.weight "
        "(accepted: bf16, f32, fp8_block, fp8_row32, i64, int8_row32, mxfp4, routed_expert, w4a8_dynamic, w4a8_dynamic_down, w8a8_dynamic)")


def test_tensors_unknown_class(tmp_path):
    p = tensors(tmp_path, "tp: rows, class: head}", "tp: rows, class: heads}")
    assert error_of(load_tensor_table, p) == (
        f"{p}:{line(p, 'class: heads')}: unknown class 'heads' for head.weight (accepted: {real_classes()})")


def test_tensors_shape_unknown_name(tmp_path):
    p = tensors(tmp_path, "shape: [q_lora_rank, hidden_size]", "shape: [q_lora_rank, hiden_size]")
    assert error_of(load_tensor_table, p) == (
        f"{p}:{line(p, 'hiden_size')}: shape of attn.wq_a.weight uses unknown name 'hiden_size' "
        "(accepted: config keys, compress_ratio, engram_rows, n_block_experts, n_dspark_targets)")


def test_tensors_shape_unparsable(tmp_path):
    p = tensors(tmp_path, "shape: [q_lora_rank, hidden_size]", "shape: [q_lora_rank, hidden_size*]")
    assert error_of(load_tensor_table, p) == (
        f"{p}:{line(p, 'hidden_size*')}: shape of attn.wq_a.weight: cannot parse shape expression 'hidden_size*'")


def test_tensors_shape_attribute_access(tmp_path):
    p = tensors(tmp_path, "shape: [q_lora_rank, hidden_size]", "shape: [q_lora_rank, cfg.hidden_size]")
    assert error_of(load_tensor_table, p) == (
        f"{p}:{line(p, 'cfg.hidden_size')}: shape of attn.wq_a.weight: shape expression 'cfg.hidden_size' "
        "uses unsupported syntax (Attribute)")


def test_tensors_yaml_anchor(tmp_path):
    p = tensors(tmp_path, '  embedding: "token', '  embedding: &table "token')
    assert error_of(load_tensor_table, p) == (
        f"{p}:{line(p, '&table')}: YAML anchor '&table' is not allowed in spec files")


def test_tensors_yaml_alias(tmp_path):
    old = '  head: "output projection to the vocabulary, shared with the drafter (B16); never quantised (B06)"'
    p = tensors(tmp_path, old, "  head: *table")
    assert error_of(load_tensor_table, p) == (
        f"{p}:{line(p, '*table')}: YAML alias '*table' is not allowed in spec files")


def test_tensors_yaml_merge_key(tmp_path):
    p = tensors(tmp_path, "  - {key: norm.weight, scope: model, shape: [hidden_size], format: bf16,",
                "  - {<<: {scope: model, format: bf16}, key: norm.weight, shape: [hidden_size],")
    assert error_of(load_tensor_table, p) == (
        f"{p}:{line(p, '<<:')}: YAML merge key '<<' is not allowed")


def test_tensors_duplicate_key(tmp_path):
    p = tensors(tmp_path, "tp: rows, class: head}", "tp: rows, class: head, tp: replicate}")
    assert error_of(load_tensor_table, p) == f"{p}:{line(p, 'tp: replicate}')}: duplicate key 'tp'"


def test_tensors_invalid_yaml(tmp_path):
    p = tensors(tmp_path, "{key: head.weight, scope: model,", "{key: head.weight scope: model,")
    assert error_of(load_tensor_table, p) == (
        f"{p}:{line(p, 'head.weight scope')}: invalid YAML: expected ',' or '}}', but got ':'")


def test_tensors_empty_file(tmp_path):
    p = tmp_path / "tensors.yaml"
    p.write_text("# nothing yet\n", encoding="utf-8")
    assert error_of(load_tensor_table, p) == f"{p}:1: the file holds no YAML document"


def test_tensors_when_attention_mla(tmp_path):
    p = tensors(tmp_path, "when: {attention: [hca]}, shape: [compress_ratio, head_dim]",
                "when: {attention: [mla]}, shape: [compress_ratio, head_dim]")
    assert error_of(load_tensor_table, p) == (
        f"{p}:{line(p, '[mla]')}: invalid enum value 'mla' (accepted: swa, csa, hca, dspark, csa2, csa1) "
        "at 'entries.22.when.attention.0'")


def test_tensors_when_unknown_key(tmp_path):
    p = tensors(tmp_path, "when: {attention: [hca]}, shape: [compress_ratio, head_dim]",
                "when: {atention: [hca]}, shape: [compress_ratio, head_dim]")
    assert error_of(load_tensor_table, p) == (
        f"{p}:{line(p, 'atention')}: unknown key 'atention' (accepted: attention, routing, role, stage, "
        "kv_source, index_source, engram, model_type, config_set, config_unset) "
        "at 'entries.22.when.atention'")


# ---------------------------------------------------------------- quant.yaml

def test_quant_unknown_part_dtype(tmp_path):
    p = edit(QUANT, tmp_path / "quant.yaml", "- {role: data, dtype: F32}", "- {role: data, dtype: FP32}")
    assert error_of(load_quant, p) == (
        f"{p}:{line(p, 'FP32')}: invalid enum value 'FP32' (accepted: BF16, F32, I64, I8, F8_E4M3, F8_E8M0) "
        "at 'formats.f32.parts.0.dtype'")


def test_quant_unknown_dtype_name(tmp_path):
    p = edit(QUANT, tmp_path / "quant.yaml", "  F32: {bytes: 4,", "  FP32: {bytes: 4,")
    assert error_of(load_quant, p) == (
        f"{p}:{line(p, 'FP32')}: invalid enum value 'FP32' (accepted: BF16, F32, I64, I8, F8_E4M3, F8_E8M0) "
        "at 'dtypes.FP32'")


def test_quant_format_missing_key(tmp_path):
    p = edit(QUANT, tmp_path / "quant.yaml", "    logical: any\n    parts:\n      - {role: data, dtype: I64}",
             "    parts:\n      - {role: data, dtype: I64}")
    assert error_of(load_quant, p) == f"{p}:{line(p, '  i64:')}: missing required key 'logical' at 'formats.i64'"


def test_quant_selected_unknown_format(tmp_path):
    p = edit(QUANT, tmp_path / "quant.yaml", "fp8: fp8_block}", "fp8: fp8_blocks}")
    assert error_of(load_quant, p) == (
        f"{p}:{line(p, 'fp8_blocks')}: choice 'fp8' of 'routed_expert' names unknown format 'fp8_blocks' "
        "(accepted: bf16, f32, i64, fp8_block, fp8_row32, int8_row32, mxfp4, w8a8_dynamic, w4a8_dynamic, w4a8_dynamic_down)")


# ---------------------------------------------------------------- spec/models/*.yaml

@pytest.fixture
def model_file(tmp_path, monkeypatch):
    """Edit the model spec into tmp_path/models and make the variants module read that folder."""
    def make(old, new):
        monkeypatch.setattr(variants, "MODELS_DIR", tmp_path / "models")
        return edit(MODEL, tmp_path / "models" / MODEL.name, old, new)
    return make


def test_model_unknown_key_in_variant_set(model_file):
    p = model_file("      hidden_size: 256\n", "      hiden_size: 256\n")
    assert error_of(variants.variant_config, "tiny") == (
        f"{p}:{line(p, 'hiden_size')}: variant 'tiny': unknown config key 'hiden_size' "
        f"(accepted: {', '.join(sorted(CONFIG_KEYS))})")


def test_model_unknown_variant_field(model_file):
    p = model_file("  tiny:\n    doc: >", "  tiny:\n    sets: {}\n    doc: >")
    assert error_of(variants.variant_config, "tiny") == (
        f"{p}:{line(p, 'sets:')}: unknown key 'sets' (accepted: doc, set, unset) at 'variants.tiny.sets'")


def test_model_bad_value_type(model_file):
    p = model_file("  hidden_size: 4096\n", '  hidden_size: "4096"\n')
    quoted = 'hidden_size: "4096"'
    assert error_of(variants.variant_config, "flash-0731") == (
        f"{p}:{line(p, quoted)}: variant 'flash-0731': expected `int`, got `str` at 'hidden_size'")


def test_model_bad_value_type_in_variant_set(model_file):
    p = model_file("      hidden_size: 256\n", "      hidden_size: small\n")
    assert error_of(variants.variant_config, "tiny") == (
        f"{p}:{line(p, 'hidden_size: small')}: variant 'tiny': expected `int`, got `str` at 'hidden_size'")


def test_model_unset_missing_key(model_file):
    p = model_file("unset: [dspark_block_size,", "unset: [dspark_blocksize,")
    assert error_of(variants.variant_config, "flash-preview") == (
        f"{p}:{line(p, 'dspark_blocksize')}: variant 'flash-preview' unsets 'dspark_blocksize', "
        "which the base config does not have")


def test_model_dspark_target_out_of_range(model_file):
    p = model_file("dspark_target_layer_ids: [40, 41, 42]", "dspark_target_layer_ids: [40, 41, 43]")
    assert error_of(variants.variant_config, "flash-0731") == (
        f"{p}:{line(p, '[40, 41, 43]')}: variant 'flash-0731': dspark_target_layer_ids names "
        "layer 43, outside 0..42")


def test_model_dspark_target_out_of_range_in_variant_set(model_file):
    p = model_file("      dspark_target_layer_ids: [3, 4, 5]", "      dspark_target_layer_ids: [3, 4, 6]")
    assert error_of(variants.variant_config, "tiny") == (
        f"{p}:{line(p, '[3, 4, 6]')}: variant 'tiny': dspark_target_layer_ids names layer 6, outside 0..5")


def test_model_half_the_dspark_keys(model_file):
    p = model_file("  dspark_block_size: 5\n  dspark_noise_token_id: 128799\n", "")
    assert error_of(variants.variant_config, "flash-0731") == (
        f"{p}:{line(p, 'dspark_target_layer_ids: [40')}: variant 'flash-0731': the dspark_* keys must be all "
        "present (DeepSeek-V4-Flash-0731) or all absent (preview); missing: dspark_block_size, "
        "dspark_noise_token_id")
