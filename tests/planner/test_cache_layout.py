"""`dsv4gen plan`'s KV cache: the bytes it budgets are the bytes the engine allocates.

The planner sizes the pools from the backend's generated state declaration through the same
lib/runtime/state_pools.py the paged cache allocates from. These tests build the engine's own
store (make_store -> PagedCache) on the meta device for the planned num_blocks of real 1M-token
deployments and check the planner's numbers against it byte for byte, and that the planned
sequences really fit (PagedCache.can_fit) while one more does not.
"""
from __future__ import annotations

import json

import pytest
import torch

from lib.cli.main import main
from lib.engine.cache_sizing import make_store
from lib.planner.cache_layout import PER_POSITION, PER_SEQUENCE, layout
from lib.planner.memory import Deployment
from lib.planner.plan import make_plan
from spec.profile import load_profile
from spec.variants import variant_config

MILLION = 1 << 20
# the 1M-token deployments `dsv4gen plan` is asked about, and the sequences each must hold at once
DEPLOYMENTS = {
    "ascend910": (Deployment("ascend910", max_model_len=MILLION, memory_fraction=0.92), 4),
    "ascend310p": (Deployment("ascend310p", expert_mode="streaming", max_model_len=MILLION), 2),
    "hip936": (Deployment("hip936", expert_mode="streaming", max_model_len=MILLION), 4),
}


def allocated_bytes(store) -> int:
    """Bytes of every tensor the store allocated (its layers' pools and the drafter rings)."""
    seen = {}
    for pools in (*store.layers, *store.rings):
        for part in pools:
            for t in (part if isinstance(part, tuple) else (part,)):
                if isinstance(t, torch.Tensor):
                    seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


@pytest.fixture(scope="module", params=sorted(DEPLOYMENTS))
def planned(request):
    d, wanted = DEPLOYMENTS[request.param]
    plan = make_plan(d)
    lay, cap = plan.layout, plan.capacity
    with torch.device("meta"):           # shapes only: nothing is allocated
        store = make_store(lay.model, cap.num_blocks, lay.max_seqs, rings=lay.rings, slack=lay.slack)
    return plan, store, wanted


def test_planned_bytes_are_the_engines_pools(planned):
    plan, store, _ = planned
    lay, cap = plan.layout, plan.capacity
    assert cap.allocated_bytes == allocated_bytes(store) == store.total_bytes()
    assert lay.kv_bytes_per_token == store.bytes_per_token() <= 7000
    assert lay.kv_fixed_bytes_per_sequence == store.bytes_per_sequence()
    assert store.slack == 1 + variant_config("flash-0731").dspark_block_size and len(store.rings) == 3


def test_num_blocks_is_the_largest_that_fits_the_pool(planned):
    plan, _, _ = planned
    lay, cap = plan.layout, plan.capacity
    assert cap.allocated_bytes <= cap.pool_bytes < lay.total_bytes(cap.num_blocks + 1)
    assert cap.pool_bytes == plan.pool_requested > 0 and plan.fits


def test_the_planned_sequences_of_a_million_tokens_fit_and_one_more_does_not(planned):
    plan, store, wanted = planned
    cap = plan.capacity
    assert cap.sequences >= wanted and cap.limited_by == "blocks"
    assert cap.sequence_length == MILLION + store.slack          # what the engine provisions per sequence
    assert store.can_fit([(s, cap.sequence_length) for s in range(cap.sequences)])
    assert not store.can_fit([(s, cap.sequence_length) for s in range(cap.sequences + 1)])


@pytest.mark.parametrize("backend", ["ascend310p", "ascend910", "hip936"])
def test_per_position_and_per_sequence_kinds(backend):
    cfg = variant_config("flash-0731")
    lay = layout(backend, cfg, speculative=True, max_seqs=16)
    per, fixed = lay.per_token, lay.per_sequence
    assert set(per) == set(PER_POSITION) and set(fixed) == set(PER_SEQUENCE)
    compute = 2                                      # bf16 / fp16 on every device backend
    csa, hca = 21, 20                                # flash-0731's compressed layers (ratio 4 and 128)
    assert per == {"csa_entries": csa * cfg.head_dim * compute / 4, "hca_entries": hca * cfg.head_dim * compute / 128,
                   "indexer_keys": csa * cfg.index_head_dim * compute / 4}
    multiple = load_profile(backend).cache.ring_rows_multiple          # ascend910: 16, its fused attention's blocks
    window = -(-(cfg.sliding_window + lay.slack) // multiple) * multiple
    assert fixed["window_ring"] == cfg.num_hidden_layers * window * cfg.head_dim * compute
    assert fixed["draft_rings"] == 3 * cfg.sliding_window * cfg.head_dim * compute     # no slack: committed only
    plain = layout(backend, cfg, speculative=False, max_seqs=16)
    assert plain.slack == 1 and plain.per_sequence["draft_rings"] == 0 and plain.per_token == per


def test_a_pool_too_small_for_the_ring_slots_holds_nothing(capsys):
    assert main(["plan", "--backend", "ascend910", "--kv-cache-bytes", "1MiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["engine_num_blocks"], plan["kv_capacity_sequences"], plan["kv_capacity_limited_by"]) == (0, 0, "pool")
    assert main(["plan", "--backend", "ascend910", "--kv-cache-bytes", "1MiB"]) == 0
    assert "not one sequence of --max-model-len fits" in capsys.readouterr().out


def test_max_num_seqs_bounds_the_sequences(capsys):
    assert main(["plan", "--backend", "ascend910", "--max-model-len", "4096", "--max-num-seqs", "8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_capacity_sequences"] == 8 and plan["kv_capacity_limited_by"] == "max_num_seqs"
