"""ascend310p expert modes: resident, streaming and preconverted give identical outputs, and the
preconverted loader refuses a conversion made for another TP/EP, format, backend or checkpoint."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from lib.weights import expert_conversion as preconvert
from lib.cli.main import main
from lib.weights.params import LoadOptions
from lib.runtime.loaded_model import load_model
from lib.runtime.paged_step import prefill_logits


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tiny_ckpt):
    path = tmp_path_factory.mktemp("pre") / "ckpt"
    shutil.copytree(tiny_ckpt, path)
    assert main(["convert", "--model", str(path), "--backend", "ascend310p"]) == 0
    assert main(["convert", "--model", str(path), "--backend", "ascend310p", "--ep", "2"]) == 0
    return path


def _logits(path, **options):
    model = load_model(path, "ascend310p", options=LoadOptions(**options))
    return prefill_logits(model, list(range(20, 60)))


def test_three_expert_modes_are_identical(ckpt):
    resident = _logits(ckpt, expert_mode="resident")
    assert torch.equal(resident, _logits(ckpt, expert_mode="streaming"))
    assert torch.equal(resident, _logits(ckpt, expert_mode="preconverted"))
    simulated = _logits(ckpt, expert_mode="resident", ep_size=2, ep_simulate=True)
    assert torch.equal(simulated, _logits(ckpt, expert_mode="preconverted", ep_size=2, ep_simulate=True))


def test_conversion_layout_and_marker(ckpt):
    out = preconvert.default_dir(ckpt, "ascend310p", 1, 2)
    marker = json.loads((out / preconvert.MARKER).read_text())
    assert (marker["backend"], marker["format"], marker["tp"], marker["ep"]) == ("ascend310p", "w8a8_row", 1, 2)
    assert sorted(p.name for p in out.iterdir()) == sorted([preconvert.MARKER, *marker["files"]])
    assert marker["files"] == ["rank-00-of-02.safetensors", "rank-01-of-02.safetensors"]


@pytest.mark.parametrize("key, value, message", [
    ("ep", 4, "ep is 4, but loading needs 2"),
    ("tp", 2, "tp is 2, but loading needs 1"),
    ("format", "w4a8_channel", "format is 'w4a8_channel', but loading needs 'w8a8_row'"),
    ("backend", "ascend910", "backend is 'ascend910', but loading needs 'ascend310p'"),
    ("source", "0000:1", "source is '0000:1'"),
])
def test_mismatching_marker_is_refused(ckpt, tmp_path, key, value, message):
    bad = tmp_path / "bad"
    shutil.copytree(preconvert.default_dir(ckpt, "ascend310p", 1, 2), bad)
    marker = json.loads((bad / preconvert.MARKER).read_text())
    marker[key] = value
    (bad / preconvert.MARKER).write_text(json.dumps(marker))
    with pytest.raises(ValueError, match=message):
        load_model(ckpt, "ascend310p", options=LoadOptions(expert_mode="preconverted", preconverted=str(bad),
                                                           ep_size=2, ep_simulate=True))


def test_missing_conversion_is_a_clear_error(tiny_ckpt, capsys):
    assert main(["run", "--model", str(tiny_ckpt), "--backend", "ascend310p", "--expert-mode", "preconverted",
                 "--prompt", "hi"]) == 2
    assert "no dsv4gen-converted.json" in capsys.readouterr().err


def test_convert_is_atomic(ckpt, tmp_path, monkeypatch):
    import safetensors.torch

    def broken(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    out = tmp_path / "conv"
    with pytest.raises(OSError, match="disk full"):
        preconvert.convert(ckpt, "ascend310p", out)
    assert not out.exists() and list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="tensor parallel size 3 does not divide num_attention_heads"):
        preconvert.convert(ckpt, "ascend310p", out, tp=3)
    with pytest.raises(ValueError, match="no preconverted expert mode"):
        preconvert.convert(ckpt, "hip936", out)
