"""`dsv4gen plan`: memory and speed of real deployments from the spec and the backend profile alone.

The field numbers below are copied from the 310P report (seeds/000: vllm-ascend, 8 x Ascend 310P,
TP8/EP8, the real DeepSeek-V4-Flash-0731) so the tests need nothing outside the repository. Each
is matched within 5% through the same CLI users run; where the planner and the field disagree by
more, the test says why and checks the reason's arithmetic instead of loosening the bound.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lib.cli.main import main
from lib.quant.reference_formats import encode, resolve
from lib.planner.memory import Deployment, field_bytes, format_group, logicals, weights
from spec.profile import load_profile, load_runtime_formats
from spec.tables import load_quant
from spec.variants import variant_config
from spec.yamlio import SpecError

GIB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]
BOUND = 0.05        # the bound: every field number within 5%

# seeds/000 (310P report), TP8/EP8, real DeepSeek-V4-Flash-0731 weights:
RESIDENT_WEIGHTS = 35.4             # "模型占用约 35.4 GB" per chip, W8A8 experts resident, target only
RESIDENT_OCCUPIED = (39.3, 40.3)    # "39.3-40.0 GiB" serving, "39.6-40.3GB" at profile_run, 128 MiB KV pool
STREAMING_WEIGHTS = 20.12           # "模型权重已完成加载，每卡占用约 20.12 GB" (packed MXFP4 experts)
STREAMING_OCCUPIED = (22.1, 22.7)   # "约 22.1-22.7 GB/卡" at the first forward
PRECONVERTED = 285.12               # "80 个分片，285.12 GiB", target-only TP8 W8A8, "每个 rank 10 个"
PRECONVERTED_SHARDS = 80
DSPARK_WEIGHTS = 38.19              # "每卡模型约 38.19 GiB，比 target-only 多约 2.79 GiB" (target + 3 stages)
DSPARK_DRAFT = 2.79


def plan_json(capsys, *args: str) -> dict:
    assert main(["plan", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def field_310p(capsys, mode: str, *extra: str) -> dict:
    return plan_json(capsys, "--backend", "ascend310p", "--devices", "8", "--tp", "8", "--ep", "8",
                     "--expert-mode", mode, "--max-model-len", "128", "--kv-cache-bytes", "128MiB", *extra)


def target_gib(plan: dict) -> float:
    w = plan["weights_bytes_per_device"]
    return (w["total"] - w["draft"]) / GIB


def within(predicted: float, field: float) -> bool:
    return abs(predicted - field) <= BOUND * field


def within_range(predicted: float, lo: float, hi: float) -> bool:
    return lo * (1 - BOUND) <= predicted <= hi * (1 + BOUND)


# ---------------------------------------------------------------- the field (seeds/000)

def test_resident_w8a8_weights_per_chip(capsys):
    plan = field_310p(capsys, "resident")
    assert within(target_gib(plan), RESIDENT_WEIGHTS), target_gib(plan)


def test_resident_occupancy_gap_is_the_fields_on_device_conversion_residue(capsys):
    """Predicted 36.8 GiB against 39.3-40.3 GiB measured: 6-9% low, beyond the bound, for a known
    reason. The field converted all MXFP4 experts to W8A8 on the chip at load; at the same phase
    (profile_run, before the KV pool) its resident runs held 39.6-40.3 GiB over 35.4 GiB of weights
    (4.2-4.9 GiB besides weights) while the streaming run held 22.1-22.7 over 20.12 (2.0-2.6 GiB,
    its conversion buffer included). The 1.6-2.9 GiB difference is allocator residue of the
    on-device conversion (the report frees "旧 packed 权重留下的 allocator cache" and still sees
    it). This runtime converts on the host (lib/quant/runtime_formats.py in the loader) or reads preconverted
    shards, so the planner has no such term; the runtime reserve is taken from the streaming run."""
    plan = field_310p(capsys, "resident")
    mem = plan["memory"]
    occupied = (target_gib(plan) * GIB + mem["workspace"] + mem["reserve"] + plan["kv_pool_bytes"]) / GIB
    assert not within_range(occupied, *RESIDENT_OCCUPIED)
    residue = (39.6 - RESIDENT_WEIGHTS - (STREAMING_OCCUPIED[1] - STREAMING_WEIGHTS),
               40.3 - RESIDENT_WEIGHTS - (STREAMING_OCCUPIED[0] - STREAMING_WEIGHTS))
    assert RESIDENT_OCCUPIED[0] <= occupied + residue[1] and occupied + residue[0] <= RESIDENT_OCCUPIED[1]


def test_streaming_weights_and_occupancy_per_chip(capsys):
    """The 310P runtime reserve (1.5 GiB) was read off this same run less the field's conversion
    buffer (backends/ascend310p/profile.yaml), so the occupancy check tests the weights and this
    runtime's own conversion buffer (W8A8 layer + one fp32 decoded matrix, 1.75 GiB) on top."""
    plan = field_310p(capsys, "streaming")
    assert within(target_gib(plan), STREAMING_WEIGHTS), target_gib(plan)
    mem = plan["memory"]
    # measured at the first forward, before any KV pool: weights + conversion buffer + reserve
    occupied = target_gib(plan) + (mem["workspace"] + mem["reserve"]) / GIB
    assert mem["workspace"] > 0 and within_range(occupied, *STREAMING_OCCUPIED), occupied


def test_preconverted_target_only_checkpoint(capsys):
    plan = field_310p(capsys, "preconverted")
    assert within(plan["preconverted_checkpoint_bytes"] / GIB, PRECONVERTED)
    assert plan["preconverted_checkpoint_shards"] == PRECONVERTED_SHARDS          # 10 per rank, <= 4 GiB each
    assert plan["convert_output_bytes"] < plan["preconverted_checkpoint_bytes"]   # `dsv4gen convert`: experts only


def test_dspark_deployment_weights(capsys):
    """Target + 3 DSpark stages: 37.8 GiB against 38.19 measured, within the bound. The drafter alone
    predicts 2.57 GiB against 2.79 (8% low): vLLM's drafter allocates its own vocab-parallel
    embedding and head (129280 x 4096 fp16 / 8 = 126 MiB each), which this runtime shares with the
    target (B16); counting them closes the gap to within 1%."""
    plan = field_310p(capsys, "preconverted")
    w = plan["weights_bytes_per_device"]
    assert within(w["total"] / GIB, DSPARK_WEIGHTS)
    draft = w["draft"] / GIB
    assert not within(draft, DSPARK_DRAFT)
    own_vocab_tables = 2 * 129280 * 4096 * 2 / 8 / GIB
    assert abs(draft + own_vocab_tables - DSPARK_DRAFT) <= 0.01 * DSPARK_DRAFT


def test_inventory_totals_are_exact_and_the_planner_walks_them(capsys):
    assert main(["inventory", "--variant", "flash-0731", "--json"]) == 0
    inv = json.loads(capsys.readouterr().out)
    assert (inv["all"]["tensors"], inv["all"]["bytes"]) == (72_317, 166_878_536_440)
    assert (inv["mtp"]["tensors"], inv["mtp"]["bytes"]) == (4_705, 10_862_838_300)
    assert main(["inventory", "--variant", "flash-preview", "--json"]) == 0
    inv = json.loads(capsys.readouterr().out)
    assert (inv["all"]["tensors"], inv["all"]["bytes"]) == (69_187, 159_609_485_896)
    nbytes = {k: v.bytes for k, v in load_quant().dtypes.items()}
    parts = [p for t in logicals("flash-0731") for p in t.parts]
    assert len(parts) == 72_317
    assert sum(nbytes[p.dtype] * torch.Size(p.shape).numel() for p in parts) == 166_878_536_440


# ---------------------------------------------------------------- formats, keys, sanity

@pytest.mark.parametrize("fmt", sorted(load_runtime_formats().formats))
def test_runtime_format_bytes_are_what_the_converter_returns(fmt):
    cfg = variant_config("flash-0731")
    group = format_group(fmt, cfg)
    shape = (256, 384) if group is None else (256, 2 * group)        # a grouped format holds whole groups
    storage = {"mxfp4_packed": "mxfp4", "index_i64": "i64", "index_i32": "i64", "engram_rows": "fp8_row32"}.get(fmt, "fp8_block")
    x = torch.randint(0, 6, shape) if storage == "i64" else torch.randn(shape, generator=torch.Generator().manual_seed(0))
    value = resolve(load_runtime_formats().formats[fmt].convert)(storage, encode(storage, x, cfg), cfg)
    fields = {"data": value} if isinstance(value, torch.Tensor) else \
        {k: v for k, v in value._asdict().items() if isinstance(v, torch.Tensor)}        # a record's tensors
    assert {k: v.nbytes for k, v in fields.items()} == field_bytes(fmt, shape, group)


def test_json_keys_and_text_tables(capsys):
    plan = plan_json(capsys, "--backend", "ascend910")
    for key in ("weights_bytes_per_device", "kv_bytes_per_token", "kv_fixed_bytes_per_sequence", "kv_capacity_tokens",
                "kv_capacity_sequences", "engine_num_blocks", "preconverted_checkpoint_bytes", "decode_step_seconds"):
        assert key in plan
    assert set(plan["weights_bytes_per_device"]) == {"resident_weights", "routed_experts", "scales", "draft", "total"}
    per, fixed = plan["kv_bytes_per_token_by_kind"], plan["kv_fixed_bytes_per_sequence_by_kind"]
    assert set(per) == {"csa_entries", "hca_entries", "indexer_keys"}       # grow with the context
    assert set(fixed) == {"window_ring", "compressor_buffers", "draft_rings"}  # one ring slot per sequence
    assert per["csa_entries"] == 21 * 512 * 2 / 4          # 21 CSA layers, a bf16 entry per 4 positions
    assert plan["kv_bytes_per_token"] == sum(per.values()) == 6880
    assert plan["kv_fixed_bytes_per_sequence"] == sum(fixed.values())
    assert plan["kv_capacity_tokens"] == plan["engine_num_blocks"] * 128     # the 910's 128-position blocks
    step = plan["decode_step_seconds"]
    assert 0 < step["dspark_per_token"] and 0 < step["plain"] and step["terms"]["plain"]["launches"] > 0
    # embedding, then per layer the wo_b all-reduce and the 910's all-to-all MoE exchange (lib/distributed/expert_exchange.py: three
    # exchanges with their count swaps, one all-gather), the 21 CSA indexers' head gathers, the head's gather
    assert step["terms"]["plain"]["collectives"] == 1 + 43 * (1 + 7) + 21 + 1
    assert {v["basis"] for v in plan["device"].values()} <= {"datasheet", "field", "third-party", "estimate"}
    assert main(["plan", "--backend", "hip936", "--max-model-len", "4096"]) == 0
    text = capsys.readouterr().out
    for line in ("weights per device", "KV cache per device", "per context position", "fixed per sequence",
                 "KV capacity", "sequences of --max-model-len 4,096 held at once", "preconverted checkpoint", "DSpark"):
        assert line in text


def test_monotone_in_memory_fraction_mode_context_and_acceptance(capsys):
    base = ("--backend", "hip936", "--max-model-len", "8192")
    caps = [plan_json(capsys, *base, "--memory-fraction", f)["kv_capacity_tokens"] for f in ("0.95", "0.8", "0.6")]
    assert caps[0] > caps[1] > caps[2] >= 0
    short = plan_json(capsys, *base, "--context", "1024", "--acceptance", "0.3")["decode_step_seconds"]
    long = plan_json(capsys, *base, "--context", "65536", "--acceptance", "0.8")["decode_step_seconds"]
    assert long["plain"] > short["plain"]
    assert long["tokens_per_round"] > short["tokens_per_round"]
    d = Deployment("ascend310p", devices=4, tp=4, ep=4)
    assert weights(d).rollup()["total"] > weights(d._replace(devices=8, tp=8, ep=8)).rollup()["total"]
    resident, streaming = (weights(d._replace(expert_mode=m)).rollup() for m in ("resident", "streaming"))
    assert streaming["routed_experts"] * 2 == resident["routed_experts"]        # 4-bit packed vs int8
    assert streaming["scales"] > resident["scales"]                            # E8M0 per 32 vs fp32 per row


# ---------------------------------------------------------------- bad arguments

@pytest.mark.parametrize("args, message", [
    # a TP below the world is planned (data-parallel attention replicas), but it must divide the model and the devices
    (["--backend", "ascend310p", "--tp", "3"], "tensor parallel size 3 does not divide num_attention_heads (64)"),
    (["--backend", "ascend910", "--variant", "pro", "--devices", "24", "--tp", "16"],
     "TP=16 does not divide --devices 24: the devices form devices / TP data-parallel attention replicas"),
    (["--backend", "ascend910", "--devices", "16", "--nodes", "3"],
     "--devices 16 is not a multiple of --nodes 3: every node holds the same number of devices"),
    (["--backend", "ascend910", "--devices", "16", "--nodes", "2", "--devices-per-node", "4"],
     "--devices 16 does not match --nodes 2 x --devices-per-node 4 = 8"),
    (["--backend", "ascend910", "--nodes", "0"], "--nodes must be at least 1, got 0"),
    (["--backend", "ascend310p", "--devices", "4", "--tp", "8", "--ep", "8"],
     "--devices 4 does not match TP=8, EP=8: the runtime runs max(TP, EP) = 8 ranks, one per device"),
    (["--backend", "ascend310p", "--devices", "6"], "tensor parallel size 6 does not divide num_attention_heads (64)"),
    (["--backend", "ascend310p", "--devices", "3", "--tp", "1"],
     "expert parallel size 3 does not divide n_routed_experts (256)"),
    (["--backend", "ascend910", "--expert-mode", "resident"],
     "backend ascend910 has no expert modes (its routed experts are always held as w4a8_channel); drop --expert-mode"),
    (["--backend", "ascend310p", "--expert-mode", "lazy"],
     "backend ascend310p has no expert mode 'lazy' (accepted: resident, streaming, preconverted)"),
    (["--backend", "ascend310p", "--memory-fraction", "0"], "--memory-fraction must be in (0, 1], got 0"),
    (["--backend", "ascend310p", "--memory-fraction", "1.5"], "--memory-fraction must be in (0, 1], got 1.5"),
    (["--backend", "ascend310p", "--max-model-len", "2000000"],
     "--max-model-len 2000000 exceeds max_position_embeddings (1048576) of flash-0731"),
    (["--backend", "ascend310p", "--acceptance", "1.2"], "--acceptance must be in [0, 1]"),
    (["--backend", "cpu"], "backend cpu has no `device:` section"),
    (["--backend", "all"], "dsv4gen plan needs one --backend (accepted: ascend310p, ascend910, hip936)"),
    (["--backend", "ascend310p", "--record"], "--record goes with --ops"),
    (["--backend", "ascend310p", "--batch", "4"], "--batch goes with --ops"),
])
def test_bad_arguments_are_refused_with_one_clear_message(capsys, args, message):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dsv4gen plan: error: ") and message in err, err


def test_unreadable_size_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", "--backend", "ascend310p", "--kv-cache-bytes", "12 parsecs"])
    assert info.value.code == 2 and "cannot read '12 parsecs' as a size" in capsys.readouterr().err


# ---------------------------------------------------------------- the profile's device section

PROFILE = ROOT / "backends" / "ascend310p" / "profile.yaml"


def profile_error(tmp_path, old: str, new: str) -> str:
    text = PROFILE.read_text(encoding="utf-8")
    assert text.count(old) == 1, old
    path = tmp_path / "ascend310p" / "profile.yaml"
    path.parent.mkdir(parents=True)
    path.write_text(text.replace(old, new), encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_profile("ascend310p", path)
    line = text.replace(old, new)[: text.replace(old, new).index(new)].count("\n") + 1 if new else None
    return str(info.value).replace(str(path), "P").replace(f"P:{line}:", "P:LINE:")


@pytest.mark.parametrize("old, new, message", [
    ("    value: 204000000000\n", "    value: 0\n",
     "P:LINE: device.memory_bandwidth_bytes_per_s.value must be positive, found 0"),
    ("    value: 0.000075\n", "    value: -0.000075\n", "P:LINE: device.launch_latency_s.value must be positive, found -7.5e-05"),
    ("    value: 1610612736\n", "    value: 48000000000\n",
     "device.runtime_reserve_bytes (48000000000) must be less than device.memory_bytes (48000000000)"),
    ("    basis: third-party\n", "    basis: rumour\n",
     "P:LINE: invalid enum value 'rumour' (accepted: datasheet, field, third-party, estimate) at 'device.launch_latency_s.basis'"),
    ("  memory_bandwidth_bytes_per_s:\n", "  memory_bandwith_bytes_per_s:\n", "unknown key 'memory_bandwith_bytes_per_s'"),
])
def test_device_section_errors_name_the_line(tmp_path, old, new, message):
    assert message in profile_error(tmp_path, old, new)


def test_device_number_without_source_is_refused(tmp_path):
    old = 'source: "Atlas 300I Duo: 408 GB/s LPDDR4X per card, shared by its two chips -> 204 GB/s per chip"'
    err = profile_error(tmp_path, old, 'source: " "')
    assert "device.memory_bandwidth_bytes_per_s.source is empty: say where the number comes from" in err


def test_packed_experts_need_an_expert_conversion_scope(tmp_path):
    text = PROFILE.read_text(encoding="utf-8")
    start = text.index("expert_conversion:")
    old = text[start: text.index("\n", start) + 1]
    assert "missing key 'expert_conversion'" in profile_error(tmp_path, old, "")


@pytest.mark.parametrize("old, new, message", [
    ('bytes: {qweight: "rows*cols", scale: "4*rows"}', 'bytes: {qweight: "rows*colz", scale: "4*rows"}',
     "format 'w8a8_row' bytes of 'qweight' uses unknown name 'colz' (accepted: cols, group, numel, rows)"),
    ('bytes: {qweight: "rows*cols", scale: "4*rows"}', 'bytes: {qweight: "rows*cols", scale: "4*rows*cols/group"}',
     "format 'w8a8_row' bytes of 'scale' uses 'group' but the format names no `group` config key"),
    ("runs_as: w8a8_row", "runs_as: w8a9_row", "format 'mxfp4_packed' runs as unknown format 'w8a9_row'"),
])
def test_runtime_format_sizes_are_checked(tmp_path, old, new, message):
    text = (ROOT / "spec" / "runtime.yaml").read_text(encoding="utf-8")
    assert text.count(old) == 1
    path = tmp_path / "runtime.yaml"
    path.write_text(text.replace(old, new), encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_runtime_formats(path)
    line = text[: text.index(old)].count("\n") + 1
    assert str(info.value).startswith(f"{path}:{line}: {message}")


def test_launch_counts_are_recorded_for_every_device_backend():
    from lib.planner.launch_counts import recorded
    for backend in ("ascend310p", "ascend910", "hip936"):
        counts = recorded(backend)
        assert counts["decode"] > 0 and counts["host_syncs"] == 0 and counts["dspark_round"]["verify"] > 0
