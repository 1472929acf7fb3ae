"""Device shim signatures of ascend310p / ascend910 / hip936: the recorded torch_npu 2.14.0 schemas parse,
every shim has exactly its op's schema (and hip936's the installed torch's live aten schemas), and on a real stack every
argument is forwarded in schema form. CPU only; no torch_npu, no DCU.
"""
from __future__ import annotations

import inspect
import re

import pytest
import torch

import backends.ascend310p.device_ops as p310
import backends.ascend910.device_ops as p910
import backends.hip936.device_ops as hip
from lib.emulation import npu_ops as emu
from lib.emulation import vllm_ascend_ops as fused
from lib.emulation.registered import schema_of
from lib.torch_ops.schemas import (NO_DEFAULT, SchemaParseError, aten_schema, check_signature, load_schemas,
                                    parse_schema, parse_schema_file)

SCHEMAS = load_schemas()
SHIMS = [(m, op) for m in (p310, p910) for op in m.DEVICE_OPS]


# ---- schemas --------------------------------------------------------------------------------------------
def test_every_recorded_schema_line_parses():
    assert SCHEMAS["npu_rms_norm"].source == "torch_npu-2.14.0-npu-op-schemas.txt:311"
    parsed = parse_schema_file()
    assert len(parsed) == 377 and len(SCHEMAS) == 370  # 7 names occur twice without an overload name
    rms = SCHEMAS["npu_rms_norm"]
    assert [(p.name, p.type.text, p.default) for p in rms.params] == [
        ("input", "Tensor", NO_DEFAULT), ("gamma", "Tensor", NO_DEFAULT), ("epsilon", "float", 1e-06)]
    assert len(rms.returns) == 2
    adam = SCHEMAS["npu_apply_adam.out"]
    assert adam.base_name == "npu_apply_adam" and adam.overload == "out" and adam.params[-1].kwarg_only
    fc = SCHEMAS["npu_format_cast_"]
    assert fc.overload == "" and SCHEMAS["npu_format_cast_.acl_format"].params[1].name == "acl_format"
    scatter = SCHEMAS["npu_scatter_nd_update_"]
    assert (scatter.params[0].type.alias, scatter.params[0].type.mutable, scatter.returns[0].type.mutable) == (
        "a", True, True)
    gs = next(p for p in SCHEMAS["npu_quant_matmul"].params if p.name == "group_sizes")
    assert (gs.type.base, gs.type.is_list, gs.type.optional, gs.default, gs.kwarg_only) == (
        "int", True, True, None, True)
    aer = next(p for p in SCHEMAS["npu_moe_init_routing_v2"].params if p.name == "active_expert_range")
    assert (aer.type.list_size, aer.default) == (2, ())
    dil = SCHEMAS["npu_deformable_conv2d"].params[7]
    assert (dil.name, dil.default) == ("dilation", (1, 1, 1, 1))
    assert any(p.type.text == "SymInt[]" for p in SCHEMAS["npu_bmm_v2_mat1_backward"].params)
    assert [r.name for r in SCHEMAS["npu_max.dim"].returns] == ["values", "indices"]
    assert SCHEMAS["npu_moe_token_unpermute"].returns[0].type.text == "Tensor"  # the later (public) duplicate
    act = [p for s in parsed for p in s.params if p.type.text == "str?" and p.default == "None"]
    assert act, "a quoted 'None' default must stay the string, not become None"


def test_vllm_ascend_dsv4_schemas_parse_and_say_where_they_come_from():
    from lib.torch_ops.schemas import VLLM_ASCEND_FILE, provenance
    fused = load_schemas(VLLM_ASCEND_FILE)
    assert {"npu_hc_pre_v2", "npu_hc_post", "compressor", "compressor_metadata", "npu_sparse_attn_sharedkv",
            "npu_vllm_quant_lightning_indexer", "moe_gating_top_k_hash", "inplace_partial_rotary_mul",
            "npu_rms_norm_dynamic_quant"} <= set(fused)
    hc = fused["npu_hc_pre_v2"]
    assert [p.name for p in hc.params] == ["x", "hc_fn", "hc_scale", "hc_base", "hc_mult", "hc_sinkhorn_iters",
                                           "norm_eps", "hc_eps"] and len(hc.returns) == 3
    assert fused["compressor"].params[3].type.mutable                # the state cache is written in place
    assert any(re.search(r"commit [0-9a-f]{40}", line) for line in provenance(VLLM_ASCEND_FILE))


@pytest.mark.parametrize("line, piece", [
    ("npu_x(Tensor input, Tensor gamma -> Tensor", "parameter list is not closed"),
    ("npu_x(Tensor input)", "name(params) -> returns"),
    ("npu_x(Tensor) -> Tensor", "TYPE NAME"),
    ("npu_x(Tensor! input) -> Tensor", "cannot parse type"),
    ("npu_x(float eps=1e-6e) -> Tensor", "cannot parse default"),
    ("npu_x(Tensor a, Tensor a) -> Tensor", "declared twice"),
])
def test_malformed_schema_names_source_and_piece(line, piece):
    with pytest.raises(SchemaParseError, match=re.escape(piece)) as e:
        parse_schema(line, "ops.txt:7")
    assert "ops.txt:7" in str(e.value)


def test_hip_schemas_are_taken_live_from_torch():
    s = aten_schema("_int_mm")
    assert s.name == "_int_mm" and [p.name for p in s.params] == ["self", "mat2"]
    assert torch.__version__ in s.source and s.text.startswith("aten::_int_mm(")
    rms = aten_schema("_fused_rms_norm")
    assert [p.name for p in rms.params] == ["input", "normalized_shape", "weight", "eps"] and len(rms.returns) == 2


def test_check_signature_catches_rename_default_star_and_varargs():
    s = parse_schema("npu_f(Tensor x, Tensor gamma, *, float eps=1e-06, int[] dims=[], str? mode=None) -> Tensor")

    def good(x, gamma, *, eps=1e-6, dims=(), mode=None): ...
    def renamed(x, weight, *, eps=1e-06, dims=(), mode=None): ...
    def default(x, gamma, *, eps=1e-05, dims=(), mode=None): ...
    def star(x, gamma, eps=1e-06, *, dims=(), mode=None): ...
    def order(gamma, x, *, eps=1e-06, dims=(), mode=None): ...
    def varargs(x, gamma, *, eps=1e-06, dims=(), mode=None, **kw): ...
    def none_vs_str(x, gamma, *, eps=1e-06, dims=(), mode="None"): ...
    def required(x, gamma, *, eps, dims=[], mode=None): ...

    assert check_signature(good, s) == []
    assert any("missing in Python: ['gamma']" in m for m in check_signature(renamed, s))
    assert any("not in the schema: ['weight']" in m for m in check_signature(renamed, s))
    assert any("'eps' default is 1e-05 in Python, 1e-06" in m for m in check_signature(default, s))
    assert any("'eps' is keyword-only in the schema" in m and "'*'" in m for m in check_signature(star, s))
    assert any("order differs" in m for m in check_signature(order, s))
    assert any("**kw" in m for m in check_signature(varargs, s))
    assert any("'mode' default" in m for m in check_signature(none_vs_str, s))
    assert check_signature(required, s) == [next(m for m in check_signature(required, s))]  # only eps's default
    assert "<no default>" in check_signature(required, s)[0]


@pytest.mark.parametrize("module, op", SHIMS, ids=[f"{m.__name__.split('.')[1]}.{op}" for m, op in SHIMS])
def test_shim_signature_is_the_recorded_schema(module, op):
    # torch_npu 2.14.0's, or vllm-ascend's for its DeepSeek-V4 custom ops (npu_hc_pre_v2, ...)
    assert check_signature(getattr(module, op), schema_of(op)) == []


@pytest.mark.parametrize("op", sorted(hip.DEVICE_OPS))
def test_hip_shim_signature_is_torchs_live_schema(op):
    assert check_signature(getattr(hip, op), aten_schema(op)) == []


@pytest.mark.parametrize("module", [p310, p910, hip])
def test_device_ops_table_lists_exactly_the_module_shims(module):
    shims = {n for n, f in vars(module).items() if inspect.isfunction(f) and f.__module__ == module.__name__
             and getattr(f, "device_op", None) == n}          # the registered entry points (@device_op)
    assert shims == set(module.DEVICE_OPS)
    assert all(re.fullmatch(r"L\d\d", lesson) for ids in module.DEVICE_OPS.values() for lesson in ids)


def _sentinels(schema):
    return {p.name: object() for p in schema.params}


@pytest.mark.parametrize("module, op", SHIMS, ids=[f"{m.__name__.split('.')[1]}.{op}" for m, op in SHIMS])
def test_real_stack_gets_every_argument_in_schema_form(module, op, monkeypatch):
    calls = []
    real = lambda name: (lambda *a, **k: calls.append((name, a, k)) or "real")  # noqa: E731
    monkeypatch.setattr(emu, "real_npu_op", real)
    monkeypatch.setattr(fused, "real_op", real)
    schema = schema_of(op)
    vals = _sentinels(schema)
    pos = [vals[p.name] for p in schema.params if not p.kwarg_only]
    kw = {p.name: vals[p.name] for p in schema.params if p.kwarg_only}
    assert getattr(module, op).kernel(*pos, **kw) == "real"       # the registered op's kernel, called directly
    assert calls == [(op, tuple(pos), kw)]


def test_hip_real_stack_calls_torchs_kernels(monkeypatch):
    monkeypatch.setattr(hip, "real_gfx936", lambda: True)
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: ("real", a, b))
    assert hip._int_mm.kernel("a", "b") == ("real", "a", "b")  # no emulated checks on the real stack
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    y, rstd = hip._fused_rms_norm.kernel(x, [8], None, 1e-6)       # the installed torch's aten op, unchecked
    assert torch.equal(y, torch.ops.aten._fused_rms_norm(x, [8], None, 1e-6)[0]) and rstd.shape == (3, 1)


def test_no_real_stack_here():
    assert emu.real_npu_op("npu_rms_norm") is None and hip.real_gfx936() is False
    assert fused.real_op("npu_hc_pre_v2") is None
    with pytest.raises(ValueError, match="unknown soc"):
        emu.chip("310P")
