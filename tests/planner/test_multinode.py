"""`dsv4gen plan` for deployments over several nodes: DeepSeek-V4-Pro on 2 nodes x 8 Ascend 910C dies
with attention TP8 inside a node, two data-parallel attention replicas and the routed experts EP16
over all 16 devices, and on one node of 8, which cannot hold it.

The per-device numbers are derived here from the spec's sizes (spec/models/deepseek-v4-pro.yaml)
and the runtime formats' byte rules (spec/runtime.yaml), not read back from the planner; the rest
checks that what the plan prints adds up: weight parts sum to the total, the KV pool is the budget
less weights and reserve, KV tokens are what the pool holds at the bytes a token costs.
"""
from __future__ import annotations

import json

import pytest

from lib.cli.main import main
from lib.planner.memory import Deployment
from lib.planner.plan import make_plan, nodes_that_fit
from spec.variants import variant_config

GIB = 1 << 30
MILLION = 1 << 20
PRO = ("--variant", "pro", "--backend", "ascend910", "--max-model-len", str(MILLION))
TWO_NODES = (*PRO, "--nodes", "2", "--tp", "8", "--ep", "16")
ONE_NODE = (*PRO, "--devices", "8")

# DeepSeek-V4-Pro (spec/models/deepseek-v4-pro.yaml) on ascend910 (backends/ascend910/profile.yaml)
LAYERS, HIDDEN, EXPERTS, INTER = 61, 7168, 384, 3072
# w4a8_channel (routed): rows*cols/2 + 4*rows per matrix; w1 and w3 are [3072, 7168], w2 [7168, 3072]
ROUTED_EXPERT = 3 * INTER * HIDDEN // 2 + 4 * (INTER + INTER + HIDDEN)          # 33,083,392 bytes
# w8a8_row (shared): rows*cols + 4*rows per matrix
SHARED_EXPERT = 3 * INTER * HIDDEN + 4 * (INTER + INTER + HIDDEN)               # 66,113,536 bytes
DIE = 64 * GIB                        # one 910C die
RESERVE = 6 * GIB                     # the profile's runtime reserve


def run(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["plan", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def as_json(capsys, *args: str) -> dict:
    rc, out, _ = run(capsys, *args, "--json")
    assert rc == 0
    return json.loads(out)


def test_pro_schedule_is_what_the_derivations_assume():
    cfg = variant_config("pro")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size) == \
        (LAYERS, HIDDEN, EXPERTS, INTER)
    assert cfg.num_experts_per_tok == 6 and cfg.index_topk == 1024 and cfg.num_nextn_predict_layers == 1


# ---------------------------------------------------------------- 2 nodes x 8, TP8 x DP2, EP16

def test_two_nodes_tp8_ep16_per_device_parts_from_the_spec(capsys):
    plan = as_json(capsys, *TWO_NODES)
    layout = plan["layout"]
    assert (layout["nodes"], layout["devices_per_node"], layout["tp"], layout["dp"], layout["ep"]) == (2, 8, 8, 2, 16)
    assert layout["routed_experts_per_device"] == EXPERTS // 16 == 24
    split, rollup = plan["weights_bytes_per_device_by_split"], plan["weights_bytes_per_device"]
    # routed experts: 24 of 384 per device in each of the 61 backbone layers
    assert split["experts"] == 24 * LAYERS * ROUTED_EXPERT == 48_434_085_888
    # the shared expert is replicated (tensors.yaml tp: replicate), whole on every device at any TP
    shared = plan["weights_by_class"]["target:shared_expert"]
    assert shared["data"] + shared["scale"] == LAYERS * SHARED_EXPERT
    # the parts are the total, and the printed rollup is the same total cut another way
    assert sum(split.values()) == rollup["total"] == sum(v for k, v in rollup.items() if k != "total")
    assert sum(c["data"] + c["scale"] for c in plan["weights_by_class"].values()) == rollup["total"]


def test_two_nodes_attention_is_split_tp_ways_and_the_rest_is_not():
    """TP8 x DP2 against TP16 on the same 16 devices: the TP-cut part doubles, the replicated part
    (shared experts, router, compressors, wq_a, wkv, hc, norms) and the routed experts are equal."""
    dp = make_plan(Deployment("ascend910", "pro", 16, 8, 16, max_model_len=MILLION, nodes=2)).weights.by_split()
    tp16 = make_plan(Deployment("ascend910", "pro", 16, 16, 16, max_model_len=MILLION, nodes=2)).weights.by_split()
    assert dp["tp"] == 2 * tp16["tp"]
    assert dp["replicated"] == tp16["replicated"] and dp["experts"] == tp16["experts"]


def test_two_nodes_tp8_ep16_does_not_fit_and_says_why(capsys):
    rc, out, err = run(capsys, *TWO_NODES)
    assert rc == 0                                            # a plan that does not fit is still printed
    weights = make_plan(Deployment("ascend910", "pro", 16, 8, 16, max_model_len=MILLION, nodes=2)).weights_bytes
    assert f"{weights / GIB:.2f}" == "57.00" and weights + RESERVE > 0.9 * DIE > weights
    reason = ("weights 57.00 GiB + reserve 6.00 GiB = 63.00 GiB per device > 0.9 x 64.00 GiB = 57.60 GiB: "
              "no room for a KV pool")
    assert reason in " ".join(out.split())                    # the line wraps at 110 columns
    assert err.strip() == f"dsv4gen plan: warning: DOES NOT FIT: {reason}"
    lines = out.splitlines()
    assert lines[0] == "pro on 2 nodes x 8 ascend910 = 16 devices, TP 8 x DP 2, EP 16, experts default (w4a8_channel)"
    text = " ".join(out.split())
    assert "attention and the dense layers TP 8 within a node, DP 2 = 16 / 8 attention replicas" in text
    assert ("PLANNING ONLY, the runtime cannot launch this layout yet: TP=8 and EP=16: each must be 1 or the "
            "world size max(TP, EP)=16") in text
    assert "routed experts, 24 of 384 (EP 16) 45.11 GiB" in text
    assert "0 context tokens per DP replica" in text and "sequences of --max-model-len 1,048,576 held at once: " \
        "0 per DP replica, 0 in all" in text
    # the fewest nodes where it fits, and that layout does fit (and one node fewer does not)
    assert "fits on 4 nodes x 8 = 32 devices (--nodes 4 --tp 8 --ep 32: TP 8 x DP 4, EP 32)" in text
    assert run(capsys, *TWO_NODES, "--check")[0] == 1


def test_hinted_layout_is_the_fewest_nodes_that_fit():
    plan = make_plan(Deployment("ascend910", "pro", 16, 8, 16, max_model_len=MILLION, nodes=2))
    wider = nodes_that_fit(plan)
    assert wider is not None and (wider.deployment.nodes, wider.deployment.ep) == (4, 32)
    assert wider.does_not_fit is None and wider.capacity.sequences >= 1
    three = make_plan(Deployment("ascend910", "pro", 24, 8, 24, max_model_len=MILLION, nodes=3))
    assert three.does_not_fit and "not one sequence of --max-model-len 1,048,576" in three.does_not_fit


def test_two_nodes_kv_capacity_is_the_pool_over_the_bytes_a_token_costs(capsys):
    """With the whole die (--memory-fraction 1) the pool is 64 GiB - 57.00 - 6 = 1.00 GiB per device:
    KV tokens per DP replica are what it holds at 9,848 bytes a position, twice that in all; not one
    1M-token sequence (9.62 GiB of entries) fits."""
    plan = as_json(capsys, *TWO_NODES, "--memory-fraction", "1")
    weights = plan["weights_bytes_per_device"]["total"]
    pool = plan["kv_pool_bytes"]
    assert pool == DIE - weights - RESERVE
    # per position: a 512-wide bf16 entry and a 128-wide bf16 key per 4 positions in 30 CSA layers,
    # a 512-wide entry per 128 positions in 31 HCA layers (Pro's compress_ratios)
    ratios = variant_config("pro").compress_ratios[:LAYERS]
    csa, hca = ratios.count(4), ratios.count(128)
    assert (csa, hca) == (30, 31)
    per_token = csa * 512 * 2 / 4 + csa * 128 * 2 / 4 + hca * 512 * 2 / 128
    assert plan["kv_bytes_per_token"] == per_token == 9848
    tokens, blocks = plan["kv_capacity_tokens"], plan["engine_num_blocks"]
    assert tokens == blocks * 128 > 0

    # the pools the engine allocates (their bytes are the engine's own: tests/planner/test_cache_layout.py);
    # what does not grow with the context (ring slots, partial blocks) comes off the pool first
    lay = make_plan(Deployment("ascend910", "pro", 16, 8, 16, max_model_len=MILLION, memory_fraction=1.0,
                               nodes=2)).layout
    assert lay.total_bytes(blocks) == plan["kv_allocated_bytes"] <= pool < lay.total_bytes(blocks + 1)
    # tokens are the pool over a token's bytes, to one block of positions and one entry block per group
    # (cdiv(num_blocks, m) rounds each group up by at most a block of 128 rows)
    rounding = 128 + 128 * (csa * (512 + 128) * 2 + hca * 512 * 2) / per_token
    assert tokens <= (pool - lay.total_bytes(0)) / per_token < tokens + rounding
    assert plan["kv_capacity_tokens_total"] == 2 * tokens
    assert (tokens, 2 * tokens) == (34_816, 69_632)                # the numbers docs/planning.md quotes
    assert plan["kv_capacity_sequences"] == plan["kv_capacity_sequences_total"] == 0
    assert plan["fits"] is False and plan["does_not_fit"] == (
        f"the KV pool of 1.00 GiB per device holds {tokens:,} context tokens, not one sequence of --max-model-len "
        f"1,048,576 (1,048,578 positions x 9,848 bytes = 9.62 GiB)")


def test_tp16_over_two_nodes_is_launchable(capsys):
    """TP and EP both the world: the runtime's own layout, one job of 16 ranks over the two nodes."""
    plan = as_json(capsys, *PRO, "--nodes", "2")
    layout = plan["layout"]
    assert (layout["tp"], layout["dp"], layout["ep"], layout["launchable"]) == (16, 1, 16, True)
    assert plan["kv_capacity_tokens_total"] == plan["kv_capacity_tokens"]
    rc, out, _ = run(capsys, *PRO, "--nnodes", "2", "--nproc-per-node", "8")
    assert rc == 0 and "runtime: launchable, one job of 16 ranks (8 per node)" in out
    assert "TP 16 across 2 nodes" in out and "collectives that cross nodes are priced" in out


# ---------------------------------------------------------------- one node of 8

def test_pro_on_one_node_of_eight_does_not_fit_and_says_why(capsys):
    rc, out, err = run(capsys, *ONE_NODE)
    assert rc == 0
    plan = make_plan(Deployment("ascend910", "pro", 8, 8, 8, max_model_len=MILLION))
    rollup = plan.weights.rollup()
    # 48 of 384 routed experts per device in 61 layers: 90.22 GiB before anything else
    routed = next(c for c in plan.weights.target if c.tensor_class == "routed_expert")
    assert routed.data + routed.scale == 48 * LAYERS * ROUTED_EXPERT
    assert rollup["total"] == sum(v for k, v in rollup.items() if k != "total")
    assert f"{rollup['total'] / GIB:.2f}" == "102.85"
    reason = "weights 102.85 GiB per device > 0.9 x 64.00 GiB = 57.60 GiB"
    lines = out.splitlines()
    assert lines[0] == "pro on 8 x ascend910, TP 8, EP 8, experts default (w4a8_channel)"
    assert f"DOES NOT FIT: {reason}" in lines
    assert err.strip() == f"dsv4gen plan: warning: DOES NOT FIT: {reason}"
    assert "  total                                      102.85 GiB" in lines
    assert "** DOES NOT FIT **" in out and "** not one sequence of --max-model-len fits **" in out
    assert "PLANNING ONLY" not in out                            # TP8 EP8 is the runtime's own layout
    assert run(capsys, *ONE_NODE, "--check")[0] == 1


# ---------------------------------------------------------------- Flash on one node: unchanged

def test_flash_on_one_node_prints_as_before(capsys):
    args = ("--backend", "ascend910", "--devices", "8", "--tp", "8", "--ep", "8", "--max-model-len", "131072",
            "--memory-fraction", "0.92")
    rc, out, err = run(capsys, *args, "--check")
    assert rc == 0 and err == ""
    assert out.splitlines()[0] == "flash-0731 on 8 x ascend910, TP 8, EP 8, experts default (w4a8_channel)"
    for absent in ("layout:", "PLANNING ONLY", "runtime:", "DOES NOT FIT", "fits:", "by split", "DP replica",
                   "cross nodes"):
        assert absent not in out, absent
    assert "KV cache per device (one shared KV head: every TP rank holds the whole cache)" in out
    plan = as_json(capsys, *args)
    assert plan["fits"] is True and plan["does_not_fit"] is None and plan["layout"]["launchable"] is True
    assert plan["kv_capacity_tokens_total"] == plan["kv_capacity_tokens"] > 0
    # --nodes 1 --devices-per-node 8 is the same deployment as --devices 8
    same = as_json(capsys, *args[2:], "--backend", "ascend910", "--nodes", "1", "--devices-per-node", "8")
    assert same == plan
