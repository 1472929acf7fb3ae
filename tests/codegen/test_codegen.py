"""The code generator: checked-in output is fresh, deterministic, stamped, and what runs.

Spec + profile -> lowered functions -> jinja2 templates -> backends/<name>/_generated/. These
tests also show the lowering is real: a profile change alters the generated calls, and a graph
that reads a tensor a layer kind lacks is refused at build time.
"""
from __future__ import annotations

import shutil

import msgspec
import pytest

import backends.cpu._generated.model as generated_model
from codegen import build as codegen_build
from codegen.lower import lower
from lib.cli.main import main
from lib.runtime.loaded_model import load_model
from lib.weights.tiny_checkpoint import make_tiny
from spec.graph import load_graph
from spec.profile import OpLowering, backend_names, load_profile
from spec.yamlio import SpecError
from spec.tables import load_tensor_table


def test_checked_in_code_is_fresh(capsys):
    assert main(["build", "--check"]) == 0
    assert "up to date" in capsys.readouterr().out


@pytest.mark.parametrize("backend", backend_names())
def test_render_is_deterministic_and_stamped(backend):
    first, second = codegen_build.render(backend), codegen_build.render(backend)
    assert first == second
    stamp = codegen_build.spec_hash(backend)
    assert stamp.startswith("sha256:")
    for name, text in first.items():
        assert "@generated" in text.splitlines()[0] and stamp in text.splitlines()[0], name


def test_stale_missing_and_extra_files_are_reported(tmp_path):
    out = tmp_path / "_generated"
    shutil.copytree(codegen_build.generated_dir("cpu"), out)
    assert codegen_build.diff("cpu", out) == []
    (out / "model.py").write_text((out / "model.py").read_text() + "\n# hand edit\n")
    (out / "PLAN.md").unlink()
    (out / "leftover.py").write_text("")
    assert sorted(codegen_build.diff("cpu", out)) == sorted(
        [f"{out / 'model.py'}: stale", f"{out / 'PLAN.md'}: missing", f"{out / 'leftover.py'}: extra file"])
    # the command line's report of a stale checked-in folder: tests/codegen/test_stamp.py


def test_build_writes_only_what_changed(tmp_path):
    out = tmp_path / "_generated"
    written = codegen_build.build("cpu", out)
    assert len(written) == 4
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert codegen_build.build("cpu", out) == []
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes
    (out / "loader.py").write_text("stale")
    assert codegen_build.build("cpu", out) == [str(out / "loader.py")]


def test_the_runtime_runs_the_generated_module(tmp_path):
    model = load_model(make_tiny(tmp_path / "ckpt"))
    assert model.forward is generated_model.forward
    source = generated_model.__file__
    assert "/_generated/" in source
    assert open(source).readline().startswith("# @generated")


def test_profile_table_decides_the_lowering():
    """A profile row mapping an op to a composite changes the generated call, nothing else does."""
    graph, table = load_graph(), load_tensor_table()
    cpu = load_profile("cpu")
    custom = msgspec.structs.replace(cpu, ops={"rms_norm": OpLowering(
        impl="composite", reason="test: a device norm", call="backends.cpu.ops.basic:rms_norm_composite")})
    base = {f.name: f for f in lower(graph, cpu, table).functions}
    changed = {f.name: f for f in lower(graph, custom, table).functions}
    assert "import backends.cpu.ops.basic as _basic" in lower(graph, custom, table).imports
    block = "\n".join(changed["block"].body)
    assert "_basic.rms_norm_composite(u_attn" in block
    assert "rms_norm_composite" not in "\n".join(base["block"].body)
    ops = {op.op: op for op in lower(graph, custom, table).ops}
    assert ops["rms_norm"].impl == "composite" and ops["linear"].impl == "reference"


def test_every_layer_kind_gets_its_own_function():
    names = {f.name for f in lower(load_graph(), load_profile("cpu"), load_tensor_table()).functions}
    assert {"attention_swa", "attention_csa", "attention_hca", "ffn_hash", "ffn_learned", "block",
            "forward"} <= names
    csa = next(f for f in lower(load_graph(), load_profile("cpu"), load_tensor_table()).functions
               if f.name == "attention_csa")
    swa = next(f for f in lower(load_graph(), load_profile("cpu"), load_tensor_table()).functions
               if f.name == "attention_swa")
    assert any("index_select" in line for line in csa.body)
    assert not any("compress" in line for line in swa.body)


def test_a_shared_input_pair_is_one_call_where_its_weights_have_the_pair_format():
    """ascend910's shared_inputs: wq_a and wkv (every attention kind) and CSA's wq_b and indexer wq_b become one call
    made where the first linear is, each pair one GEMM of the two weights stacked (one_gemm); a render that records
    `linear` would read the stacked first weight alone, so it is refused; the pair computes exactly what the two
    linears do, separately or stacked, and the stacked second is a view of the one weight's rows."""
    import torch

    from backends.ascend910 import lowerings
    from codegen.lower import Rewrite
    from lib.quant.runtime_formats import quantize_rows
    from lib.weights.params import merged_pair

    graph, table, p910 = load_graph(), load_tensor_table(), load_profile("ascend910")
    fns = {f.name: "\n".join(f.body) for f in lower(graph, p910, table).functions}
    pair = '_lowerings.linear_w8a8_pair(h, lp["attn.wq_a.weight"], lp["attn.wkv.weight"], merged=True)'
    assert all(f"q_lora, kv_flat = {pair}" in fns[f"attention_{k}"] for k in ("swa", "csa", "hca", "dspark"))
    csa_pair = "q_flat, iq_flat = _lowerings.linear_w8a8_pair(\n    c_q,\n    lp[\"attn.wq_b.weight\"],\n" \
               "    lp[\"attn.indexer.wq_b.weight\"],\n    merged=True,\n)"
    assert csa_pair in fns["attention_csa"]
    assert "linear_w8a8_pair(c_q" not in fns["attention_hca"]            # no indexer: wq_b alone
    assert fns["attention_csa"].index("iq_flat") < fns["attention_csa"].index("_attention.compress")
    with pytest.raises(SpecError, match="attn.wq_a.weight and attn.wkv.weight as one weight"):
        lower(graph, p910, table, Rewrite(record_ops=("linear",)))
    unmerged = p910.__class__(**{**{f: getattr(p910, f) for f in p910.__struct_fields__},
                                 "shared_inputs": {k: msgspec.structs.replace(v, one_gemm=False)
                                                   for k, v in p910.shared_inputs.items()}})
    recorded = {f.name: "\n".join(f.body) for f in lower(graph, unmerged, table, Rewrite(record_ops=("linear",))).functions}
    assert "linear_w8a8_pair" not in recorded["attention_csa"]
    assert "linear_w8a8_pair" not in "\n".join("\n".join(f.body) for f in lower(graph, load_profile("cpu"), table).functions)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 64, generator=g).bfloat16()
    w1, w2 = (quantize_rows(torch.randn(n, 64, generator=g)) for n in (16, 24))
    a, b = lowerings.linear_w8a8_pair(x, w1, w2)
    assert torch.equal(a, lowerings.linear_w8a8(x, w1)) and torch.equal(b, lowerings.linear_w8a8(x, w2))
    stacked, view = merged_pair(w1, w2, "stacked")
    assert stacked.qweight.shape == (40, 64) and view.qweight.data_ptr() == stacked.qweight[16:].data_ptr()
    a2, b2 = lowerings.linear_w8a8_pair(x, stacked, view, merged=True)
    assert torch.equal(a2, a) and torch.equal(b2, b) and torch.equal(lowerings.linear_w8a8(x, view), b)


def test_a_quantised_norm_hands_its_linears_quantised_rows_only_where_linears_alone_read_it():
    """ascend910's quantised_norms: q_norm's output is read only by W8A8 linears (wq_b, CSA's pair with the indexer
    wq_b), so it is one npu_rms_norm_dynamic_quant in every attention kind; a norm something else reads (attn_norm:
    the compressors and the indexer's weights_proj read h in bf16) stays a norm even when declared; a recording render
    keeps the plain norm; the quantised rows give bit for bit what the norm and the linear's own quantisation give."""
    import msgspec
    import torch

    from backends.ascend910 import lowerings
    from codegen.lower import Rewrite
    from lib.quant.runtime_formats import quantize_rows
    from spec.profile import QuantisedNorm

    graph, table, p910 = load_graph(), load_tensor_table(), load_profile("ascend910")
    fns = {f.name: "\n".join(f.body) for f in lower(graph, p910, table).functions}
    norm = 'c_q = _lowerings.rms_norm_quant(q_lora, lp["attn.q_norm.weight"], eps=cfg.rms_norm_eps)'
    assert all(norm in fns[f"attention_{k}"] for k in ("swa", "csa", "hca", "dspark"))
    recorded = {f.name: "\n".join(f.body) for f in lower(graph, p910, table, Rewrite(record_ops=("rms_norm",))).functions}
    assert "rms_norm_quant" not in recorded["attention_csa"]
    declared = msgspec.structs.replace(p910, quantised_norms={**p910.quantised_norms, "h": QuantisedNorm(
        "attn_norm.weight", "w8a8_row", "backends.ascend910.lowerings:rms_norm_quant", "test")})
    block = {f.name: "\n".join(f.body) for f in lower(graph, declared, table).functions}["block"]
    assert "h = _lowerings.rms_norm(u_attn" in block and "rms_norm_quant(u_attn" not in block
    g = torch.Generator().manual_seed(9)
    x, gamma = torch.randn(5, 64, generator=g).bfloat16(), (1 + 0.1 * torch.randn(64, generator=g)).bfloat16()
    w = quantize_rows(torch.randn(24, 64, generator=g))
    rows = lowerings.rms_norm_quant(x, gamma, 1e-6)
    assert rows.values.dtype == torch.int8 and rows.scale.shape == (5,)
    assert torch.equal(lowerings.linear_w8a8(rows, w), lowerings.linear_w8a8(lowerings.rms_norm(x, gamma, 1e-6), w))
