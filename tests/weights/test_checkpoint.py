"""Opening a broken checkpoint fails up front with one line per problem, naming the shard (or the
index, or config.json), the key, and expected vs found; scales load bit-exactly (B04); every spec
tensor is loaded exactly once (test_params.py); the CLI exits 2 (B22).

Every case corrupts a copy of the session's `make_tiny` checkpoint with plain safetensors / JSON
edits and opens it with `Checkpoint` / `load_model` / the CLI, the paths users run (B21).
"""
import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import lib.weights.checkpoint
from lib.weights.checkpoint import Checkpoint, CheckpointError
from lib.cli.main import main
from lib.runtime.loaded_model import load_model
from tests.helpers import messages

INDEX = "model.safetensors.index.json"


def console_script() -> str:
    """The `dsv4gen` console script of the environment running the tests (beside its python), else on PATH."""
    beside = Path(sys.executable).parent / "dsv4gen"
    found = str(beside) if beside.is_file() else shutil.which("dsv4gen")
    if found is None:
        pytest.fail(f"no dsv4gen console script beside {sys.executable} or on PATH: pip install -e . first")
    return found


# ------------------------------------------------------------------ helpers (plain file edits)

@pytest.fixture
def ckpt_copy(tiny_ckpt, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "ckpt"))


def weight_map(root: Path) -> dict[str, str]:
    return json.loads((root / INDEX).read_text())["weight_map"]


def edit_index(root: Path, edit) -> None:
    index = json.loads((root / INDEX).read_text())
    edit(index["weight_map"])
    (root / INDEX).write_text(json.dumps(index, indent=2))


def edit_shard(root: Path, shard: str, edit) -> None:
    tensors = load_file(root / shard)
    edit(tensors)
    save_file(tensors, str(root / shard), metadata={"format": "pt"})


def replace_tensor(root: Path, key: str, value: torch.Tensor) -> str:
    shard = weight_map(root)[key]
    edit_shard(root, shard, lambda t: t.__setitem__(key, value))
    return shard


def raw_entries(path: Path) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """key -> (dtype, shape, begin, end) with absolute file offsets, from the raw header JSON."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        meta = json.loads(f.read(n))
    meta.pop("__metadata__", None)
    return {k: (v["dtype"], tuple(v["shape"]), 8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
            for k, v in meta.items()}


def open_error(root: Path) -> list[str]:
    with pytest.raises(CheckpointError) as err:
        Checkpoint(root)
    return str(err.value).split("\n")


def e8m0(values: list[int], shape) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8).view(torch.float8_e8m0fnu).reshape(shape)


def truncate_last_tensor(root: Path, shard: str, cut: int = 7) -> str:
    """Cut `cut` bytes off the shard; returns the key whose data ran past the new end."""
    path = root / shard
    entries = raw_entries(path)
    last = max(entries, key=lambda k: entries[k][3])
    path.write_bytes(path.read_bytes()[:-cut])
    return last


def test_intact_copy_opens(ckpt_copy):
    ckpt = Checkpoint(ckpt_copy)
    assert set(ckpt.headers) == set(weight_map(ckpt_copy)) == set(ckpt.expected)
    assert ckpt.total_bytes() == json.loads((ckpt_copy / INDEX).read_text())["metadata"]["total_size"]


# ------------------------------------------------------------------ one line per problem

def test_missing_key(ckpt_copy):
    key = "layers.3.attn.wq_a.weight"
    edit_shard(ckpt_copy, weight_map(ckpt_copy)[key], lambda t: t.pop(key))
    edit_index(ckpt_copy, lambda wm: wm.pop(key))
    assert open_error(ckpt_copy) == [f"{INDEX}: {key}: missing (expected F8_E4M3 [128, 256])"]


@pytest.mark.parametrize("key, value", [
    ("layers.3.attn.bogus.weight", torch.zeros(4, dtype=torch.bfloat16)),
    ("mtp.0.embed.weight", torch.zeros(1024, 256, dtype=torch.bfloat16)),     # B16: a drafter embed
    ("layers.3.ffn.gate.tid2eid", torch.zeros(1024, 2, dtype=torch.int64)),  # hash table, learned layer
])
def test_unexpected_key(ckpt_copy, key, value):
    shard = weight_map(ckpt_copy)["layers.3.attn.wq_a.weight"]
    edit_shard(ckpt_copy, shard, lambda t: t.__setitem__(key, value))
    edit_index(ckpt_copy, lambda wm: wm.__setitem__(key, shard))
    assert open_error(ckpt_copy) == [
        f"{shard}: {key}: unexpected tensor (not in the spec's tensor table for this config)"]


@pytest.mark.parametrize("key, value, expected, found", [
    ("layers.2.attn.wq_b.weight", torch.zeros(256, 128, dtype=torch.float8_e4m3fn),
     "F8_E4M3 [512, 128]", "F8_E4M3 [256, 128]"),
    # B05: a block scale stored transposed
    ("layers.2.attn.wq_b.scale", e8m0([127] * 4, (1, 4)), "F8_E8M0 [4, 1]", "F8_E8M0 [1, 4]"),
    # an FP4 expert stored unpacked (one code per byte)
    ("layers.4.ffn.experts.3.w1.weight", torch.zeros(128, 256, dtype=torch.int8), "I8 [128, 128]", "I8 [128, 256]"),
])
def test_wrong_shape(ckpt_copy, key, value, expected, found):
    shard = replace_tensor(ckpt_copy, key, value)
    assert open_error(ckpt_copy) == [f"{shard}: {key}: expected {expected}, found {found}"]


@pytest.mark.parametrize("key, convert, expected, found", [
    ("layers.1.attn_norm.weight", lambda t: t.float(), "BF16 [256]", "F32 [256]"),
    # B06-style: an FP8 weight stored (or assumed) dequantised, and the BF16 head taken for FP8
    ("layers.1.attn.wkv.weight", lambda t: t.to(torch.bfloat16), "F8_E4M3 [64, 256]", "BF16 [64, 256]"),
    ("head.weight", lambda t: t.to(torch.float8_e4m3fn), "BF16 [1024, 256]", "F8_E4M3 [1024, 256]"),
    ("layers.0.ffn.gate.tid2eid", lambda t: t.int(), "I64 [1024, 2]", "I32 [1024, 2]"),
])
def test_wrong_dtype(ckpt_copy, key, convert, expected, found):
    shard = replace_tensor(ckpt_copy, key, convert(Checkpoint(ckpt_copy).read(key)))
    assert open_error(ckpt_copy) == [f"{shard}: {key}: expected {expected}, found {found}"]


def test_several_problems_give_one_line_each(ckpt_copy):
    gone, norm = "mtp.1.ffn.experts.0.w2.scale", "mtp.2.norm.weight"
    edit_shard(ckpt_copy, weight_map(ckpt_copy)[gone], lambda t: t.pop(gone))
    edit_index(ckpt_copy, lambda wm: wm.pop(gone))
    shard = replace_tensor(ckpt_copy, norm, torch.zeros(256, dtype=torch.float32))
    assert sorted(open_error(ckpt_copy)) == sorted([
        f"{INDEX}: {gone}: missing (expected F8_E8M0 [256, 4])",
        f"{shard}: {norm}: expected BF16 [256], found F32 [256]"])


def test_index_points_at_the_wrong_shard(ckpt_copy):
    key = "layers.5.attn.wkv.weight"
    other = next(s for s in sorted(set(weight_map(ckpt_copy).values())) if s != weight_map(ckpt_copy)[key])
    edit_index(ckpt_copy, lambda wm: wm.__setitem__(key, other))
    assert open_error(ckpt_copy) == [f"{other}: {key}: listed in the index but absent from the shard"]


# ------------------------------------------------------------------ truncated or corrupt files

def test_truncated_shard_is_refused_before_any_tensor_is_read(ckpt_copy, monkeypatch):
    shard = "model-00002-of-00004.safetensors"
    key = truncate_last_tensor(ckpt_copy, shard)
    size = (ckpt_copy / shard).stat().st_size
    lines = open_error(ckpt_copy)
    assert len(lines) == 1
    assert lines[0].startswith(f"{shard}: {key}: truncated shard: tensor data ends at byte {size + 7}, "
                               f"file has {size} bytes")
    # no path hands out tensor data from it: the data files are never even opened
    opened = []
    monkeypatch.setattr(lib.weights.checkpoint, "safe_open", lambda *a, **k: opened.append(a) or pytest.fail("opened"))
    with pytest.raises(CheckpointError, match=re.escape(f"{shard}: {key}: truncated shard")):
        load_model(ckpt_copy)
    assert opened == []


@pytest.mark.parametrize("keep, fragment", [
    (4, "truncated shard (4 bytes, no safetensors header)"),
    (100, "truncated shard (header says {n} bytes, file has 92)"),
])
def test_truncated_header(ckpt_copy, keep, fragment):
    path = ckpt_copy / "model-00003-of-00004.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    path.write_bytes(data[:keep])
    assert open_error(ckpt_copy) == [f"{path.name}: " + fragment.format(n=n)]


def test_index_names_a_missing_shard(ckpt_copy):
    shard = "model-00003-of-00004.safetensors"
    (ckpt_copy / shard).unlink()
    keys = [k for k, s in weight_map(ckpt_copy).items() if s == shard]
    assert open_error(ckpt_copy) == [f"{INDEX}: names shard {shard} (for {len(keys)} tensors, e.g. {keys[0]}), "
                                     f"which does not exist in {ckpt_copy}"]


def test_corrupt_header_json(ckpt_copy):
    path = ckpt_copy / "model-00001-of-00004.safetensors"
    data = bytearray(path.read_bytes())
    data[8:9] = b"#"                                   # the header's opening brace
    path.write_bytes(bytes(data))
    lines = open_error(ckpt_copy)
    assert len(lines) == 1 and lines[0].startswith(f"{path.name}: corrupt safetensors header: ")


def test_header_entry_without_offsets(ckpt_copy):
    path = ckpt_copy / "model-00004-of-00004.safetensors"
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8:8 + n])
    key = sorted(k for k in meta if k != "__metadata__")[0]
    del meta[key]["data_offsets"]
    text = json.dumps(meta, separators=(",", ":")).encode()
    data[8:8 + n] = text + b" " * (n - len(text))       # same header length, still valid JSON
    path.write_bytes(bytes(data))
    assert open_error(ckpt_copy) == [f"{path.name}: {key}: corrupt safetensors header entry "
                                     f"(KeyError: 'data_offsets')"]


def test_missing_config_json(ckpt_copy):
    (ckpt_copy / "config.json").unlink()
    assert open_error(ckpt_copy) == [f"{ckpt_copy / 'config.json'}: config.json not found"]


def test_config_json_bad_value_names_file_line_and_alternatives(ckpt_copy):
    path = ckpt_copy / "config.json"
    text = path.read_text().replace('"scoring_func": "sqrtsoftplus"', '"scoring_func": "softmax"')
    path.write_text(text)
    line = next(i for i, s in enumerate(text.splitlines(), 1) if '"scoring_func"' in s)
    (msg,) = open_error(ckpt_copy)
    assert msg.startswith(f"{path}:{line}: ")
    for fragment in ("'softmax'", "(accepted: sqrtsoftplus)", "scoring_func"):
        assert fragment in msg


# ------------------------------------------------------------------ B04: scales bit-exact

def test_scales_load_bit_exactly(ckpt_copy):
    fp8_w, fp8_s = "layers.1.attn.wq_b.weight", "layers.1.attn.wq_b.scale"                   # [512,128], [4,1]
    fp4_w, fp4_s = "layers.4.ffn.experts.6.w2.weight", "layers.4.ffn.experts.6.w2.scale"     # [256,64], [256,4]
    extremes = [0, 1, 127, 254]
    fp4_bytes = (torch.arange(256 * 4) * 37 % 255).tolist()   # every byte 0..254 (no NaN), with repeats
    fp4_bytes[:4] = extremes
    # FP8 weight: +1.0 (0x38) in even columns, -1.0 (0xB8) in odd ones; FP4: codes 2 (+1) low, 10 (-1) high
    sign = torch.tensor([1.0, -1.0]).repeat(64)
    replace_tensor(ckpt_copy, fp8_w, torch.tensor([0x38, 0xB8], dtype=torch.uint8).repeat(512, 64)
                   .view(torch.float8_e4m3fn))
    replace_tensor(ckpt_copy, fp8_s, e8m0(extremes, (4, 1)))
    replace_tensor(ckpt_copy, fp4_w, torch.full((256, 64), 0xA2, dtype=torch.uint8).view(torch.int8))
    replace_tensor(ckpt_copy, fp4_s, e8m0(fp4_bytes, (256, 4)))

    ckpt = Checkpoint(ckpt_copy)
    for key in (fp8_s, fp4_s, "layers.0.attn.wq_a.scale", "mtp.0.main_proj.scale",
                "layers.5.ffn.experts.0.w1.scale", "mtp.2.ffn.shared_experts.w2.scale"):
        shard = ckpt_copy / weight_map(ckpt_copy)[key]
        dtype, shape, begin, end = raw_entries(shard)[key]
        on_disk = torch.frombuffer(bytearray(shard.read_bytes()[begin:end]), dtype=torch.uint8)
        got = ckpt.read(key)
        assert (dtype, got.dtype, tuple(got.shape)) == ("F8_E8M0", torch.float8_e8m0fnu, shape), key
        assert torch.equal(got.view(torch.uint8).flatten(), on_disk), key
    assert ckpt.read(fp8_s).view(torch.uint8).flatten().tolist() == extremes

    # the runtime weights use exactly 2**(b - 127) per block / per 32-group
    params = load_model(ckpt_copy).params
    pow2 = {b: torch.tensor(2.0 ** (b - 127), dtype=torch.float64).float() for b in range(255)}
    assert pow2[0].item() == 2.0 ** -127 and pow2[254].item() == 2.0 ** 127      # exact in fp32
    want = torch.stack([pow2[b] for b in extremes]).repeat_interleave(128)[:, None] * sign
    assert torch.equal(params.layers[1]["attn.wq_b.weight"], want)
    scales = torch.stack([pow2[b] for b in fp4_bytes]).view(256, 4).repeat_interleave(32, dim=1)
    assert torch.equal(params.layers[4]["ffn.experts.w2.weight"][6], scales * sign)


# ------------------------------------------------------------------ the CLI exits 2 (B22)

@pytest.mark.parametrize("argv", [["run", "--prompt", "hi", "--max-tokens", "1"],
                                  ["logits", "--ids", "1,2,3", "--out", "OUT"]])
def test_cli_on_a_broken_checkpoint_exits_2(ckpt_copy, tmp_path, capsys, argv):
    shard = "model-00004-of-00004.safetensors"
    key = truncate_last_tensor(ckpt_copy, shard)
    out = tmp_path / "logits.npy"
    argv = [str(out) if a == "OUT" else a for a in argv]
    assert main([argv[0], "--model", str(ckpt_copy), *argv[1:]]) == 2
    captured = capsys.readouterr()
    lines = messages(captured.err)
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"dsv4gen {argv[0]}: error: {shard}: {key}: truncated shard: ")
    assert captured.out == "" and not out.exists()


def test_console_script_exits_2(ckpt_copy, tmp_path):
    key = "layers.0.attn.wkv.scale"
    edit_index(ckpt_copy, lambda wm: wm.pop(key))
    out = tmp_path / "logits.npy"
    proc = subprocess.run([console_script(), "logits", "--model", str(ckpt_copy), "--ids", "1,2", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert messages(proc.stderr) == [f"dsv4gen logits: error: {INDEX}: {key}: missing (expected F8_E8M0 [1, 2])"]
    assert not out.exists()
