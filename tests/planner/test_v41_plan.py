"""`dsv4gen plan --variant v41-flash`: DeepSeek-V4.1-Flash on 8 Ascend 910 dies, TP8 / EP8, W4A8 routed
experts, Engram tables in host memory: memory only (the recorded launch counts are V4-Flash's schedule's).

The per-token KV bytes are derived here from the spec's schedule (which layers are KV sources, their
compress ratios) and the cache formats of V4.1's own code, not read back from the planner:
  - FP4 main compressed KV: 512 lanes / 2 + one E4M3 scale byte per 16 lanes = 288 B an entry;
    FP4 index key: 128 / 2 + one UE8M0 byte per 32 = 68 B ([MP] vendored official inference/model.py,
    code-index id 70871433627; [QP] act_quant / fp4_act_quant ports, ids 70172717437, 70094490474,
    66885998799);
  - "global KV = 3 x (288 + 68) / 2 + (288 + 68) = 890 B/token", the DeepSeek-V4.1-Flash tech report's
    figure ([TR §2.4.4], code-index id 66669268318).
The field (the 910 report: ModelScope chiro2001/DeepSeek-V4.1-Flash-w4a8-Ascend, the project's
seeds/002) served it on 8 x 910C, TP8, W4A8_DYNAMIC, Engram int8 per 32 channels + FP32 scale on the
host, and had > 3M tokens of context in HBM ("在HBM中可用>3M上下文").
"""
from __future__ import annotations

import json

import pytest

from lib.cli.main import main
from spec.schedule import backbone
from spec.variants import variant_config

GIB = 1 << 30
V41 = ("--variant", "v41-flash", "--backend", "ascend910", "--devices", "8", "--tp", "8", "--ep", "8")
MAIN_ENTRY = 512 // 2 + 512 // 16          # [MP][QP]: 288 B
INDEX_KEY = 128 // 2 + 128 // 32           # [MP][QP]: 68 B
TR_KV_BYTES_PER_TOKEN = 890                # [TR]
FIELD_CONTEXT = 3_000_000                  # [F910]: > 3M tokens of context in HBM
# [F910]: engram_int8/layers_1_engram_embed.weight.safetensors 98,305,579,120 B and .scale
# 12,288,197,488 B; layers_14: 98,308,270,704 B and 12,288,533,936 B; each file a 112-B safetensors header
FIELD_ENGRAM_FILES = (98_305_579_120 + 12_288_197_488, 98_308_270_704 + 12_288_533_936)
SAFETENSORS_HEADER = 112


def plan_json(capsys, *args: str) -> dict:
    assert main(["plan", *V41, *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def v41():
    return variant_config("v41-flash")


def test_kv_bytes_per_token_is_the_reports_890(capsys, v41):
    # from the schedule: the KV-source layers and their compress ratios (layers 2, 8, 14 at 2; 20 at 1)
    sources = [layer for layer in backbone(v41) if layer.kv_source]
    assert [(s.index, s.ratio) for s in sources] == [(2, 2), (8, 2), (14, 2), (20, 1)]
    assert (MAIN_ENTRY, INDEX_KEY) == (v41.head_dim // 2 + v41.head_dim // 16,
                                       v41.index_head_dim // 2 + v41.index_head_dim // 32)
    derived = sum((MAIN_ENTRY + INDEX_KEY) / s.ratio for s in sources)
    assert derived == TR_KV_BYTES_PER_TOKEN
    plan = plan_json(capsys)
    assert plan["kv_bytes_per_token"] == TR_KV_BYTES_PER_TOKEN
    assert plan["kv_bytes_per_token_by_kind"] == {"entries_r2": 3 * MAIN_ENTRY / 2, "index_keys_r2": 3 * INDEX_KEY / 2,
                                                  "entries_r1": MAIN_ENTRY, "index_keys_r1": INDEX_KEY}


def test_fixed_state_per_sequence(capsys, v41):
    """§3.13's decode state: a 128-slot FP8 window ring (512 + 16 UE8M0 bytes) per backbone layer and per
    draft stage, fp32 K and G partial groups (2 x 512 each) on the ratio-2 sources, 3 Engram ids."""
    window_row = v41.head_dim + v41.head_dim // 32
    fixed = plan_json(capsys)["kv_fixed_bytes_per_sequence_by_kind"]
    assert fixed == {"window_ring": 128 * window_row * 40, "draft_rings": 128 * window_row * 3,
                     "compressor_buffers": 3 * 2 * 2 * v41.head_dim * 4, "engram_ids": 3 * 4}
    assert plan_json(capsys, "--speculative", "none")["kv_fixed_bytes_per_sequence_by_kind"]["draft_rings"] == 0


def test_engram_tables_are_in_host_memory(capsys, v41):
    plan = plan_json(capsys)
    # int8 per channel + an fp32 scale per 32 channels: 256 + 4 x 256 / 32 = 288 B a row
    row = v41.engram_head_dim + 4 * v41.engram_head_dim // 32
    host = plan["host_bytes"]["engram_table"]
    assert host["placement"] == "sharded_per_rank"              # the field's local-owner path
    assert host["total"] == sum(rows * row for rows in v41.engram_num_embeddings)
    # the field's int8 files hold exactly these bytes
    assert host["total"] == sum(FIELD_ENGRAM_FILES) - 4 * SAFETENSORS_HEADER
    assert host["per_rank"] == sum(-(-rows // 8) * row for rows in v41.engram_num_embeddings)
    assert host["per_host"] == 8 * host["per_rank"]             # one host of 8 ranks
    # and never on the device
    assert not [k for k in plan["weights_by_class"] if k.endswith(":engram_table")]


def test_weights_per_device_and_what_is_counted(capsys):
    plan = plan_json(capsys)
    w = plan["weights_bytes_per_device"]
    assert w["total"] == sum(w[k] for k in ("resident_weights", "routed_experts", "scales", "draft"))
    by_class = plan["weights_by_class"]
    assert by_class["target:routed_expert"]["format"] == "w4a8_channel"
    # the vision tower is counted, bf16 as the field loads it (its vision file: 926 MiB)
    vision = by_class["target:vision"]
    assert vision["format"] == "dense_bf16" and round((vision["data"] + vision["scale"]) / (1 << 20)) == 926
    # the field: "权重占用 约 39 GiB" per chip
    assert 37 < w["total"] / GIB < 41, w["total"] / GIB


def test_kv_capacity_holds_the_fields_context(capsys):
    plan = plan_json(capsys)
    assert plan["fits"] and plan["kv_capacity_tokens"] > FIELD_CONTEXT
    pool = plan["kv_pool_bytes"]
    assert plan["kv_pool_bytes"] == plan["memory"]["budget"] - plan["weights_bytes_per_device"]["total"] \
        - plan["memory"]["reserve"]
    # the tokens are what the pool holds at 890 B, less the ring slots and partial blocks
    assert plan["kv_capacity_tokens"] <= pool / TR_KV_BYTES_PER_TOKEN
    million = plan_json(capsys, "--max-model-len", str(1 << 20), "--max-num-seqs", "32")
    assert million["kv_capacity_sequences"] >= 3 and million["kv_capacity_tokens"] > FIELD_CONTEXT


def test_plan_is_memory_only_and_launchable(capsys):
    """ascend910 runs V4.1's forward, and TP8 / EP8 on 8 dies is the runtime's own layout; the decode step is not
    predicted, since the recorded launch counts are V4-Flash's."""
    assert main(["plan", *V41]) == 0
    out = capsys.readouterr().out
    assert "memory only: the recorded launch counts" in out and "PLANNING ONLY" not in out
    assert "890 bytes per token" in out and "host memory (engram_table, off the device" in out
    assert "decode step: not predicted (the recorded launch counts" in out
    plan = plan_json(capsys)
    assert plan["layout"]["launchable"] is True and plan["decode_step_seconds"] is None
    assert "DeepSeek-V4-Flash's schedule" in plan["layout"]["no_speed"]
