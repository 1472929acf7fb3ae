"""Ascend ModelSlim checkpoints both ways: `dsv4gen convert --format msmodelslim` writes the export
(spec/msmodelslim.yaml), the checkpoint reader takes it as strictly as the official format, and the
device loaders hold its int8 / int4 tensors exactly as a load of the original computes them."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lib.cli.main import main as cli
from lib.quant import int_codecs, reference_formats
from lib.quant.reference_formats import decode
from lib.runtime.loaded_model import load_model
from lib.runtime.paged_step import prefill_logits
from lib.weights import msmodelslim_writer
from lib.weights.checkpoint import Checkpoint, CheckpointError

DESC, INDEX = "quant_model_description.json", "quant_model_weights.safetensors.index.json"
PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def slim(tmp_path_factory, tiny_ckpt):
    """quant type -> the tiny checkpoint converted through the CLI, as a user converts it."""
    root = tmp_path_factory.mktemp("slim")
    out = {}
    for quant in ("w8a8", "w4a8"):
        out[quant] = root / quant
        assert cli(["convert", "--model", str(tiny_ckpt), "--format", "msmodelslim", "--quant-type", quant,
                    "--out", str(out[quant])]) == 0
    return out


def _tensors(params) -> dict[str, torch.Tensor]:
    """Every runtime tensor of a Params tree (records field by field), by its path."""
    out = {}

    def walk(x, path):
        if isinstance(x, torch.Tensor):
            out[path] = x
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}.{k}")
        elif isinstance(x, tuple):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")

    walk((params.model, params.layers, params.drafter), "")
    return out


@pytest.mark.parametrize("backend, quant", [("ascend310p", "w8a8"), ("ascend910", "w4a8")])
def test_export_loads_to_the_same_runtime_tensors(slim, tiny_ckpt, backend, quant, monkeypatch):
    official = load_model(tiny_ckpt, backend)

    def no_detour(parts, cfg):
        raise AssertionError("a ModelSlim int weight was decoded to floats on its way to a device format")

    with monkeypatch.context() as patch:     # the int8 / int4 tensors go straight into the runtime records
        patch.setattr(reference_formats, "decode_w8a8_dynamic", no_detour)
        patch.setattr(reference_formats, "decode_w4a8_dynamic", no_detour)
        exported = load_model(slim[quant], backend)
    want, got = _tensors(official.params), _tensors(exported.params)
    assert want.keys() == got.keys()
    differ = [k for k in want if want[k].dtype != got[k].dtype or not torch.equal(want[k], got[k])]
    assert differ == []
    assert torch.equal(prefill_logits(official, PROMPT), prefill_logits(exported, PROMPT))


def test_export_layout(slim, tiny_ckpt):
    root = slim["w4a8"]
    names = sorted(p.name for p in root.iterdir())
    assert names == ["config.json", "generation_config.json", "mtpq-00001.safetensors", DESC,
                     "quant_model_weights-00001-of-00001.safetensors", INDEX, "tokenizer.json", "tokenizer_config.json"]
    assert "quantization_config" not in json.loads((root / "config.json").read_text())
    desc = json.loads((root / DESC).read_text())
    assert (desc["version"], desc["model_quant_type"], desc["group_size"]) == ("1.0.0", "W8A8_DYNAMIC", 0)
    weights = load_file(str(root / "quant_model_weights-00001-of-00001.safetensors"))     # the backbone
    drafter = load_file(str(root / "mtpq-00001.safetensors"))                                # the drafter apart
    assert drafter and all(k.startswith("mtp.") for k in drafter) and not any(k.startswith("mtp.") for k in weights)
    weights |= drafter
    assert set(weights) == set(json.loads((root / INDEX).read_text())["weight_map"]) == set(desc) - {
        "version", "model_quant_type", "group_size", "metadata"}
    # norms, hc, router, embed and head stay FLOAT in their own dtypes; an FP8 linear kept FLOAT is BF16
    assert desc["norm.weight"] == desc["layers.0.hc_attn_fn"] == desc["head.weight"] == "FLOAT"
    assert weights["layers.0.hc_attn_fn"].dtype == torch.float32
    assert (desc["layers.0.attn.wo_a.weight"], weights["layers.0.attn.wo_a.weight"].dtype) == ("FLOAT", torch.bfloat16)
    # W8A8 attention projection: int8 [out, in], per-row F32 scale and zero offset [out, 1]
    rows, cols = Checkpoint(tiny_ckpt).headers["layers.0.attn.wq_a.weight"].shape
    assert desc["layers.0.attn.wq_a.weight_scale"] == "W8A8_DYNAMIC"
    assert weights["layers.0.attn.wq_a.weight"].shape == (rows, cols) and weights["layers.0.attn.wq_a.weight"].dtype == torch.int8
    assert weights["layers.0.attn.wq_a.weight_scale"].shape == (rows, 1)
    assert not weights["layers.0.attn.wq_a.weight_offset"].any()
    # W4A8 routed experts: int4 packed two per byte along the output rows; scale_bias 1 or 16 chunk sums
    w1, w2 = weights["layers.3.ffn.experts.0.w1.weight"], weights["layers.3.ffn.experts.0.w2.weight"]
    inter, hidden = next(t.shape for t in Checkpoint(tiny_ckpt).logical if t.key == "layers.3.ffn.experts.0.w1.weight")
    assert (w1.shape, w2.shape) == ((inter // 2, hidden), (hidden // 2, inter))
    assert weights["layers.3.ffn.experts.0.w1.scale_bias"].shape == (inter, 1)
    assert weights["layers.3.ffn.experts.0.w2.scale_bias"].shape == (hidden, 16)
    q = int_codecs.unpack_int4_rows(w2)
    scale = weights["layers.3.ffn.experts.0.w2.weight_scale"]
    assert torch.allclose(weights["layers.3.ffn.experts.0.w2.scale_bias"][:, 0],
                          8 * q[:, : inter // 16].float().sum(1) * scale[:, 0])


def test_int4_row_packing_by_hand():
    q = torch.tensor([[1, -8], [-1, 7], [0, 3], [7, -2]], dtype=torch.int8)     # [N=4, K=2]
    packed = int_codecs.pack_int4_rows(q)
    # byte [j, k] = row 2j low nibble | row 2j+1 high nibble: (1, -1) -> 0xF1, (-8, 7) -> 0x78
    assert packed.view(torch.uint8).tolist() == [[0xF1, 0x78], [0x70, 0xE3]]
    assert torch.equal(int_codecs.unpack_int4_rows(packed), q)
    with pytest.raises(ValueError, match="N even"):
        int_codecs.pack_int4_rows(q[:3])


def test_reference_decodes_what_the_device_holds(slim):
    """The cpu reference's meaning of a ModelSlim weight is the device's int values times their scales."""
    ckpt = Checkpoint(slim["w4a8"])
    t = next(t for t in ckpt.logical if t.key == "layers.3.ffn.experts.1.w3.weight")
    parts = ckpt.read_parts(t)
    want = int_codecs.unpack_int4_rows(parts["weight"]).float() * parts["weight_scale"]
    assert t.format == "w4a8_dynamic" and torch.equal(decode(t.format, parts, ckpt.config), want)
    assert bool(torch.isfinite(prefill_logits(load_model(slim["w8a8"], "cpu"), PROMPT)).all())


def _corrupt(slim, tmp_path, edit_desc=None, edit_weights=None):
    root = tmp_path / "bad"
    shutil.copytree(slim["w4a8"], root)
    if edit_desc:
        desc = json.loads((root / DESC).read_text())
        edit_desc(desc)
        (root / DESC).write_text(json.dumps(desc))
    if edit_weights:
        shard = root / "quant_model_weights-00001-of-00001.safetensors"
        weights = load_file(str(shard))
        edit_weights(weights)
        save_file(weights, str(shard))
        index = json.loads((root / INDEX).read_text())
        index["weight_map"] = {k: shard.name for k in weights}
        (root / INDEX).write_text(json.dumps(index))
    return root


def _drop(key):
    return lambda d: d.pop(key)


def _set(key, value):
    return lambda d: d.__setitem__(key, value)


def _pack_one_more_row(w):
    w["layers.3.ffn.experts.0.w1.weight"] = torch.cat((w["layers.3.ffn.experts.0.w1.weight"],
                                                       w["layers.3.ffn.experts.0.w1.weight"][:1]))


@pytest.mark.parametrize("edit_desc, edit_weights, message", [
    (_set("layers.9.attn.wq_a.weight", "W8A8_DYNAMIC"), None,
     f"{DESC}: layers.9.attn.wq_a.weight: described as W8A8_DYNAMIC, but {INDEX} has no such tensor"),
    (_set("layers.0.ffn_norm.weight", "W8A8_DYNAMIC"), None,
     f"{DESC}: layers.0.ffn_norm.weight: quant type W8A8_DYNAMIC, but a norm tensor [256] is never quantised (allowed: FLOAT)"),
    (_set("layers.3.ffn.experts.0.w1.weight", "W8A8_DYNAMIC"), None,
     "layers.3.ffn.experts.0.w1.weight: expected I8 [128, 256], found I8 [64, 256]"),
    (_set("layers.0.attn.wq_a.weight", "INT2"), None, f"{DESC}: layers.0.attn.wq_a.weight: unknown quant type 'INT2'"),
    (None, _pack_one_more_row, "layers.3.ffn.experts.0.w1.weight: expected I8 [64, 256], found I8 [65, 256]"),
    (_drop("layers.0.attn.wkv.weight_scale"), _drop("layers.0.attn.wkv.weight_scale"),
     f"{INDEX}: layers.0.attn.wkv.weight_scale: missing (expected F32 [64, 1])"),
    (None, _drop("layers.0.attn.wkv.weight_offset"), f"{DESC}: layers.0.attn.wkv.weight_offset: described as W8A8_DYNAMIC, but"),
])
def test_corrupted_exports_are_refused_by_name(slim, tmp_path, edit_desc, edit_weights, message):
    root = _corrupt(slim, tmp_path, edit_desc, edit_weights)
    with pytest.raises(CheckpointError) as err:
        Checkpoint(root)
    assert message in str(err.value)


def test_interrupted_convert_leaves_nothing(tiny_ckpt, tmp_path, monkeypatch):
    calls = []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 50:
            raise KeyboardInterrupt
        return real(*args)

    real = msmodelslim_writer.encode
    monkeypatch.setattr(msmodelslim_writer, "encode", interrupted)
    with pytest.raises(KeyboardInterrupt):
        msmodelslim_writer.convert(tiny_ckpt, tmp_path / "out", "w4a8")
    assert list(tmp_path.iterdir()) == []


def test_convert_refuses_bad_requests(slim, tiny_ckpt, tmp_path, capsys):
    assert cli(["convert", "--model", str(slim["w8a8"]), "--format", "msmodelslim", "--out", str(tmp_path / "x")]) == 2
    assert "already a msmodelslim export; convert from the official checkpoint" in capsys.readouterr().err
    assert cli(["convert", "--model", str(tiny_ckpt), "--format", "msmodelslim", "--backend", "ascend910"]) == 2
    assert "drop --backend / --tp / --ep" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
