"""`dsv4gen make-tiny` on the command line: --set overrides (and clear errors for bad ones), --force,
an interrupted write that leaves nothing behind, and the embedded tiny checkpoint made once.
"""
import json
import re
import shutil
from pathlib import Path

import pytest

import lib.weights.checkpoint_writer
import lib.weights.tiny_checkpoint
from lib.weights.checkpoint import Checkpoint
from lib.cli.main import main
from lib.runtime.loaded_model import load_model
from tests.helpers import messages
from tests.weights.tiny_layout import E, HEAD_DIM, MINI, MINI_SET, MOE, VOCAB, all_bytes, block_of, read_layout


# ------------------------------------------------------------------ CLI: --set, --force

def test_set_overrides_through_the_cli(tmp_path, capsys):
    out = tmp_path / "small"
    rc = main(["make-tiny", "--out", str(out), "--set", "hidden_size=128",
               "--set", "compress_ratios=[0,4,16,4,0,0,0]", "--set", "num_hidden_layers=4",
               "--set", "dspark_target_layer_ids=[1,2,3]"])
    assert rc == 0
    assert capsys.readouterr().out == f"wrote a tiny checkpoint to {out}\n"
    raw = json.loads((out / "config.json").read_text())
    assert (raw["hidden_size"], raw["num_hidden_layers"]) == (128, 4)
    assert raw["compress_ratios"] == [0, 4, 16, 4, 0, 0, 0]
    assert raw["dspark_target_layer_ids"] == [1, 2, 3]
    assert (raw["vocab_size"], raw["n_routed_experts"]) == (VOCAB, E)      # preset values kept
    _, tensors = read_layout(out)
    assert tensors["embed.weight"][1:3] == ("BF16", (VOCAB, 128))
    assert tensors["layers.2.attn.compressor.ape"][1:3] == ("F32", (16, HEAD_DIM))   # HCA, ratio 16
    assert tensors["mtp.0.main_proj.weight"][1:3] == ("F8_E4M3", (128, 3 * 128))
    assert {b for b in map(block_of, tensors) if b} == {"layers.0", "layers.1", "layers.2", "layers.3",
                                                         "mtp.0", "mtp.1", "mtp.2"}
    model = load_model(out)
    assert model.cfg.hidden_size == 128 and model.cfg.compress_ratios == (0, 4, 16, 4, 0, 0, 0)
    assert (len(model.params.layers), len(model.params.drafter)) == (4, 3)
    assert model.params.layers[3]["ffn.experts.w1.weight"].shape == (E, MOE, 128)


def test_pro_tiny_variant_through_the_cli(tmp_path, capsys):
    out = tmp_path / "pro"
    assert main(["make-tiny", "--out", str(out), "--variant", "pro-tiny"]) == 0
    raw = json.loads((out / "config.json").read_text())
    assert raw["compress_ratios"] == [8, 8, 4, 8, 4, 0] and "dspark_block_size" not in raw
    _, tensors = read_layout(out)
    # layer 0 is HCA (a compressor, no indexer), layer 2 CSA; the drafter is the one MTP layer
    assert tensors["layers.0.attn.compressor.ape"][1:3] == ("F32", (8, HEAD_DIM))
    assert not [k for k in tensors if k.startswith("layers.0.attn.indexer.")]
    assert "layers.2.attn.indexer.weights_proj.weight" in tensors
    assert {b for b in map(block_of, tensors) if b and b.startswith("mtp.")} == {"mtp.0"}
    model = load_model(out)
    assert (len(model.params.layers), len(model.params.drafter)) == (5, 1)


@pytest.mark.parametrize("argv, message", [
    (["--variant", "pro"], "variant 'pro' makes a 864,704,792,696-byte checkpoint; make-tiny writes at most "
                           "1,073,741,824 (pick a tiny variant, e.g. tiny or pro-tiny)"),
    (["--variant", "pro-tiny", "--preset", "tiny-long"], "preset 'tiny-long' overrides the 'tiny' variant, "
                                                         "not 'pro-tiny'"),
])
def test_refuses_a_real_size_variant_or_a_preset_of_another(tmp_path, capsys, argv, message):
    out = tmp_path / "refused"
    assert main(["make-tiny", "--out", str(out), *argv]) == 2
    assert messages(capsys.readouterr().err) == [f"dsv4gen make-tiny: error: {message}"]
    assert not out.exists()


@pytest.mark.parametrize("sets, fragments", [
    # 9 compress_ratios with 4 layers leaves [4, 8, 0, 0, 0] as drafter entries
    (["num_hidden_layers=4"], ["drafter-stage entries of compress_ratios must be 0",
                                "num_hidden_layers (4)", "found [4, 8, 0, 0, 0]"]),
    (["num_hidden_layers=10"], ["compress_ratios has 9 entries, fewer than num_hidden_layers (10)"]),
    (["dspark_target_layer_ids=[3,4,6]"], ["dspark_target_layer_ids names layer 6, outside 0..5"]),
    (["hiden_size=1"], ["unknown config key 'hiden_size'", "hidden_size"]),
    (["scoring_func=softmax"], ["'softmax'", "sqrtsoftplus", "scoring_func"]),
])
def test_bad_set_exits_2_naming_the_keys(tmp_path, capsys, sets, fragments):
    out = tmp_path / "bad"
    argv = ["make-tiny", "--out", str(out)]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 2
    err = "\n".join(messages(capsys.readouterr().err))
    assert err.startswith("dsv4gen make-tiny: error: ") and "--set" in err
    for fragment in fragments:
        assert fragment in err
    assert not out.exists()


def test_refuses_non_empty_dir_without_force_then_replaces_with_force(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, out)
    (out / "stray.txt").write_text("left over")
    before = all_bytes(out)
    assert main(["make-tiny", "--out", str(out), *MINI_SET]) == 2
    err = messages(capsys.readouterr().err)
    assert err == [f"dsv4gen make-tiny: error: {out}: already exists and is not empty (pass --force to replace it)"]
    assert all_bytes(out) == before

    assert main(["make-tiny", "--out", str(out), *MINI_SET, "--force"]) == 0
    after = all_bytes(out)
    assert "stray.txt" not in after                       # replaced, not merged into
    assert after.keys() == before.keys() - {"stray.txt"}
    assert json.loads(after["config.json"])["num_hidden_layers"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]   # no temp or old folders
    Checkpoint(out)


def _failing_save(monkeypatch, exc: BaseException) -> list[str]:
    """Make the writer's safetensors save write the first shard, then half a file, then fail."""
    real = lib.weights.checkpoint_writer.save_file
    calls: list[str] = []

    def save_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 1:
            return real(tensors, filename, metadata=metadata)
        Path(filename).write_bytes(b"\0" * 1000)
        raise exc

    monkeypatch.setattr(lib.weights.checkpoint_writer, "save_file", save_file)
    return calls


def test_interrupted_write_leaves_nothing_behind(tmp_path, monkeypatch):
    calls = _failing_save(monkeypatch, KeyboardInterrupt())
    parent = tmp_path / "parent"
    assert main(["make-tiny", "--out", str(parent / "ckpt"), *MINI_SET]) == 130     # Ctrl-C: one line, status 130
    assert len(calls) == 2
    assert sorted(p.name for p in parent.iterdir()) == []


def test_interrupted_force_keeps_the_old_checkpoint(tiny_ckpt, tmp_path, monkeypatch):
    out = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, out)
    calls = _failing_save(monkeypatch, OSError(28, "No space left on device"))
    with pytest.raises(OSError, match="No space left on device"):
        lib.weights.tiny_checkpoint.make_tiny(out, overrides=MINI, overwrite=True)
    assert len(calls) == 2
    assert all_bytes(out) == all_bytes(tiny_ckpt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


# ------------------------------------------------------------------ embedded tiny checkpoint

def test_embedded_tiny_is_made_once_then_reused(tiny_ckpt, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DSV4GEN_CACHE", str(cache))
    real, made = lib.weights.tiny_checkpoint.make_tiny, []

    def spy(*args, **kwargs):
        made.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(lib.weights.tiny_checkpoint, "make_tiny", spy)
    first = lib.weights.tiny_checkpoint.embedded_tiny()
    assert len(made) == 1
    assert first.parent == cache and re.fullmatch(r"tiny-[0-9a-f]{16}", first.name)
    assert all_bytes(first) == all_bytes(tiny_ckpt)       # the default preset and seed
    stamps = {p.name: p.stat().st_mtime_ns for p in [first, *first.iterdir()]}

    second = lib.weights.tiny_checkpoint.embedded_tiny()
    assert second == first and len(made) == 1
    assert {p.name: p.stat().st_mtime_ns for p in [second, *second.iterdir()]} == stamps
    assert sorted(p.name for p in cache.iterdir()) == [first.name]
