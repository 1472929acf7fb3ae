"""Pinned error messages for a malformed graph.yaml or backend profile (the same method as
test_spec_errors.py: a real file with one targeted edit, the whole message asserted)."""

import pytest

from codegen.lower import lower
from spec.config import CONFIG_KEYS, RANK_KEYS
from spec.graph import load_graph
from spec.profile import load_runtime_formats, load_profile
from spec.tables import load_tensor_table
from tests.spec.spec_edits import GRAPH, PROFILE, edit, error_of, line, real_classes, real_ops


# ---------------------------------------------------------------- graph.yaml

POST_STEP = "{op: hc_post, args: {y: a, x: x, post: post_attn, comb: comb_attn}, out: [x_mid]}"
POST_LINE = "{op: hc_post, args: {y: a,"


def graph(tmp_path, old, new):
    return edit(GRAPH, tmp_path / "graph.yaml", old, new)


def lower_file(path):
    return lower(load_graph(path), load_profile("cpu"), load_tensor_table())


def test_graph_unknown_op(tmp_path):
    p = graph(tmp_path, POST_STEP, POST_STEP.replace("op: hc_post", "op: plus"))
    assert error_of(load_graph, p) == f"{p}:{line(p, 'op: plus')}: unknown op 'plus' (accepted: {real_ops()})"


def test_graph_unbound_port(tmp_path):
    p = graph(tmp_path, POST_STEP, POST_STEP.replace(", comb: comb_attn", ""))
    assert error_of(load_graph, p) == f"{p}:{line(p, POST_LINE)}: op 'hc_post': argument 'comb' is not bound"


def test_graph_extra_arg(tmp_path):
    p = graph(tmp_path, POST_STEP, POST_STEP.replace("comb: comb_attn", "comb: comb_attn, c: x"))
    assert error_of(load_graph, p) == f"{p}:{line(p, POST_LINE)}: op 'hc_post' has no argument 'c' (accepted: y, x, post, comb)"


def test_graph_missing_attr(tmp_path):
    p = graph(tmp_path, "attrs: {streams: cfg.hc_mult}, ", "")
    assert error_of(load_graph, p) == f"{p}:{line(p, '{op: hc_expand')}: op 'hc_expand': attr 'streams' is not bound"


def test_graph_wrong_number_of_outputs(tmp_path):
    p = graph(tmp_path, POST_STEP, POST_STEP.replace("out: [x_mid]", "out: [x_mid, extra]"))
    assert error_of(load_graph, p) == f"{p}:{line(p, POST_LINE)}: op 'hc_post' has 1 output (x), step binds 2"


def test_graph_attr_unknown_config_key(tmp_path):
    p = graph(tmp_path, "attrs: {streams: cfg.hc_mult}", "attrs: {streams: cfg.hiden_size}")
    assert error_of(load_graph, p) == (
        f"{p}:{line(p, 'cfg.hiden_size')}: attr 'streams': unknown config key 'hiden_size' in 'cfg.hiden_size' "
        f"(accepted: {', '.join(sorted(CONFIG_KEYS | RANK_KEYS))})")


def test_graph_attr_unknown_layer_field(tmp_path):
    p = graph(tmp_path, "attrs: {window: cfg.sliding_window, ratio: layer.ratio}",
              "attrs: {window: cfg.sliding_window, ratio: layer.ratios}")
    assert error_of(load_graph, p) == (
        f"{p}:{line(p, '  - op: sparse_attention')}: attr 'ratio': unknown layer field 'ratios' in 'layer.ratios' "
        "(accepted: index, prefix, role, attention, ratio, routing, rope, stage, last_stage, "
        "kv_source, index_source, candidate_source, engram)")


def test_graph_attr_unknown_root(tmp_path):
    p = graph(tmp_path, "attrs: {streams: cfg.hc_mult}", "attrs: {streams: config.hc_mult}")
    assert error_of(load_graph, p) == (
        f"{p}:{line(p, 'config.hc_mult')}: attr 'streams': unknown name 'config' in 'config.hc_mult' "
        "(accepted: cfg, layer, rope)")


def test_graph_step_unknown_key(tmp_path):
    p = graph(tmp_path, POST_STEP, POST_STEP.replace("args:", "arg:"))
    assert error_of(load_graph, p) == (
        f"{p}:{line(p, '{op: hc_post, arg:')}: unknown key 'arg' (accepted: op, call, loop, args, attrs, out, when, tap, "
        "tap_layers, tap_input) at 'programs.block.steps.3.arg'")


def test_graph_unknown_program(tmp_path):
    p = graph(tmp_path, "{call: ffn, args", "{call: fnn, args")
    assert error_of(load_graph, p) == (
        f"{p}:{line(p, 'call: fnn')}: unknown program 'fnn' (accepted: attention, attention_v41, block, block_v41, "
        "draft, draft_context, draft_v41, ffn, model, model_v41, mtp_draft, ring_entry, ring_entry_v41)")


def test_graph_reads_value_defined_later(tmp_path):
    # the shared expert moved after the routed experts' combine that reads its output
    shared = ("      - op: swiglu_mlp\n"
              "        args: {x: x, w1: p.ffn.shared_experts.w1.weight, w3: p.ffn.shared_experts.w3.weight,"
              " w2: p.ffn.shared_experts.w2.weight}\n"
              "        attrs: {limit: cfg.swiglu_limit}\n"
              "        out: [shared]\n")
    routed = ("      - op: routed_experts\n"
              "        args: {x: x, weights: weights, ids: ids, w1: p.ffn.experts.w1.weight, w3: p.ffn.experts.w3.weight,"
              " w2: p.ffn.experts.w2.weight,\n"
              "               placement: p.ffn.experts.placement, shared: shared}\n"
              "        attrs: {limit: cfg.swiglu_limit}\n"
              "        out: [out]\n")
    p = graph(tmp_path, shared + routed, routed + shared)
    assert error_of(lower_file, p) == (
        f"{p}:{line(p, 'op: routed_experts')}: 'shared' is not defined before this step "
        "(defined: batch, ids, weights, x)")


def test_graph_reads_parameter_a_layer_kind_lacks(tmp_path):
    # the non-overlapping (HCA) compressor step made to run in sliding-window layers too
    old = "      - op: compress\n        when: {attention: [hca]}"
    p = graph(tmp_path, old, "      - op: compress\n        when: {attention: [swa, hca]}")
    assert error_of(lower_file, p) == (
        f"{p}:{line(p, '[swa, hca]') - 1}: parameter 'attn.compressor.wkv.weight' does not exist in "
        "attention=swa layers, which this step runs for (restrict the step with 'when')")


def test_graph_reads_unknown_parameter(tmp_path):
    p = graph(tmp_path, "bias: p.ffn.gate.bias}", "bias: p.ffn.gate.bais}")
    keys = ("attn.attn_sink, attn.kv_norm.weight, attn.q_norm.weight, attn.wkv.weight, attn.wo_a.weight, "
            "attn.wo_b.weight, attn.wq_a.weight, attn.wq_b.weight, attn_norm.weight, ffn.experts.placement, "
            "ffn.experts.w1.weight, "
            "ffn.experts.w2.weight, ffn.experts.w3.weight, ffn.gate.bias, ffn.gate.weight, "
            "ffn.shared_experts.w1.weight, ffn.shared_experts.w2.weight, ffn.shared_experts.w3.weight, "
            "ffn_norm.weight, hc_attn_base, hc_attn_fn, hc_attn_scale, hc_ffn_base, hc_ffn_fn, hc_ffn_scale")
    assert error_of(lower_file, p) == (
        f"{p}:{line(p, '  - op: route_learned')}: unknown parameter 'ffn.gate.bais' (accepted: {keys})")


def test_graph_returns_undefined(tmp_path):
    p = graph(tmp_path, "    returns: [x_out, cache]", "    returns: [x_outt, cache]")
    assert error_of(lower_file, p) == (
        f"{p}:{line(p, 'x_outt')}: program 'block' returns 'x_outt', which no step defines")


# ---------------------------------------------------------------- backends/<name>/profile.yaml

def profile(tmp_path, old, new, name="cpu"):
    return edit(PROFILE, tmp_path / name / "profile.yaml", old, new)


def test_profile_unknown_op(tmp_path):
    p = profile(tmp_path, "runtime_formats:\n",
                "ops:\n  lineer: {impl: reference, reason: \"typo\"}\nruntime_formats:\n")
    assert error_of(load_profile, "cpu", p) == (
        f"{p}:{line(p, 'lineer')}: unknown op 'lineer' (accepted: {real_ops()})")


def test_profile_unknown_tensor_class(tmp_path):
    p = profile(tmp_path, "    hash_table: index_i64", "    hash_tables: index_i64")
    assert error_of(load_profile, "cpu", p) == (
        f"{p}:{line(p, 'hash_tables')}: unknown tensor class 'hash_tables' (accepted: {real_classes()})")


def test_profile_unknown_runtime_format(tmp_path):
    p = profile(tmp_path, "    hash_table: index_i64", "    hash_table: index_u16")
    accepted = ", ".join(load_runtime_formats().formats)
    assert error_of(load_profile, "cpu", p) == (
        f"{p}:{line(p, 'index_u16')}: unknown runtime format 'index_u16' (accepted: {accepted})")


def test_profile_unknown_default_runtime_format(tmp_path):
    p = profile(tmp_path, "  default: dense_f64", "  default: dense_f8")
    accepted = ", ".join(load_runtime_formats().formats)
    assert error_of(load_profile, "cpu", p) == (
        f"{p}:{line(p, 'dense_f8')}: unknown runtime format 'dense_f8' (accepted: {accepted})")


def test_profile_bad_impl(tmp_path):
    p = profile(tmp_path, "  impl: reference\n", "  impl: compiled\n")
    assert error_of(load_profile, "cpu", p) == (
        f"{p}:{line(p, 'compiled')}: invalid enum value 'compiled' (accepted: reference, composite, native) "
        "at 'op_default.impl'")


def test_profile_native_without_call(tmp_path):
    p = profile(tmp_path, "runtime_formats:\n", "ops:\n  linear: {impl: native, reason: \"fast\"}\nruntime_formats:\n")
    assert error_of(load_profile, "cpu", p) == (
        f"{p}:{line(p, 'impl: native')}: op 'linear' lowers to native but names no 'call'")


def test_profile_name_must_match_folder(tmp_path):
    p = profile(tmp_path, "name: cpu\n", "name: cpu\n", name="npu")
    assert error_of(load_profile, "npu", p) == (
        f"{p}:{line(p, 'name: cpu')}: profile name 'cpu' does not match its folder 'npu'")


def test_graph_reads_a_value_a_lowering_overwrites(tmp_path):
    """ascend910 rotates in place (its rope `consumes: [x]`): a graph whose output projection read the attention
    output before its rotation would read rotated values there, so the build refuses it, naming both steps."""
    p = graph(tmp_path, "args: {x: o, weight: p.attn.wo_a.weight}", "args: {x: o_rot, weight: p.attn.wo_a.weight}")
    rope = line(p, "{op: rope, args: {x: o_rot}")
    assert error_of(lambda q: lower(load_graph(q), load_profile("ascend910"), load_tensor_table()), p) == (
        f"{p}:{rope}: backend 'ascend910' overwrites input 'x' of op 'rope' in place, but 'o_rot' is read afterwards "
        f"({p}:{line(p, '{op: grouped_linear')})")
    lower_file(p)                                   # the reference copies: the same graph builds for cpu


def test_profile_merged_weights_must_name_two_block_parameters_of_one_gemm(tmp_path):
    merged = ("merged_weights:\n  gate_up:\n    keys: [ffn.shared_experts.w1.weight, ffn.shared_experts.w3.weight]\n"
              "    reason: \"one GEMM\"\nruntime_formats:\n")
    p = profile(tmp_path, "runtime_formats:\n", merged.replace("w3.weight]", "w4.weight]"))
    assert error_of(load_profile, "cpu", p) == (
        f"{p}:{line(p, 'gate_up:')}: merged weights 'gate_up': unknown block parameter 'ffn.shared_experts.w4.weight'")
    p = profile(tmp_path, "runtime_formats:\n", merged.replace("shared_experts.w3", "experts.w3"))
    assert error_of(load_profile, "cpu", p) == (
        f"{p}:{line(p, 'gate_up:')}: merged weights 'gate_up': ffn.shared_experts.w1.weight and "
        f"ffn.experts.w3.weight differ in class or input width, so one GEMM cannot hold both")


@pytest.mark.parametrize("section, name, what, key, entry", [
    ("shared_inputs", "qkv", "shared input", "attn.wkv.weight",
     "keys: [attn.wq_a.weight, attn.wkv.weight]\n    call: \"backends.cpu.ops.basic:linear\""),
    ("quantised_norms", "q", "quantised norm", "attn.q_norm.weight",
     "key: attn.q_norm.weight\n    call: \"backends.cpu.ops.basic:rms_norm\""),
])
def test_profile_pairings_name_known_parameters_and_formats(tmp_path, section, name, what, key, entry):
    text = f"{section}:\n  {name}:\n    {entry}\n    format: w8a8_row\n    reason: \"one call\"\nruntime_formats:\n"
    p = profile(tmp_path, "runtime_formats:\n", text.replace(key, key + "s"))
    assert error_of(load_profile, "cpu", p) == f"{p}:{line(p, name + ':')}: {what} '{name}': unknown parameter '{key}s'"
    p = profile(tmp_path, "runtime_formats:\n", text.replace("w8a8_row", "w8a8_rows"))
    assert error_of(load_profile, "cpu", p).startswith(
        f"{p}:{line(p, name + ':')}: {what} '{name}': unknown runtime format 'w8a8_rows' (accepted: ")
