"""A step exported per batch bucket (lib/runtime/step_graph.py) and replayed: identical to eager.

`dsv4gen capture` runs in its own process (it needs ATen's scalar-consistent kernels for bit equality
with unpadded eager batches, docs/porting.md) for buckets 1, 4 and 16 on every backend, replaying
steps with other lengths, positions, block tables and request mixes than the graph was traced with.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lib.engine.graph_mode import capture_sizes, graph_mode_on
from lib.records.addressing import StepShape
from lib.records.batch import make_batch
from lib.runtime.loaded_model import load_model
from lib.runtime.paged_cache import PagedCache
from lib.runtime.paged_step import paged_step
from lib.runtime.step_graph import StepGraph, device_graph_api
from lib.weights.tiny_checkpoint import embedded_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("backend", ["cpu", "ascend310p", "ascend910", "hip936"])
def test_export_and_replay_equal_eager_for_buckets_1_4_16(backend):
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "lib.cli.main", "capture", "--backend", backend, "--buckets", "1,4,16",
                          "--json"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
    checks = json.loads(out.stdout)["checks"]
    assert [c["bucket"] for c in checks] == [1, 4, 16]
    for c in checks:
        assert c["identical"] == c["steps"] == 8 and c["max_abs"] == 0.0 and c["rows_identical"], c
        assert c["mixes"] == c["steps"]            # every replayed step had lengths the others did not


@pytest.fixture(scope="module")
def traced():
    """The cpu reference's step exported for 2 sequences of 1 token reading up to 64 positions."""
    model = load_model(embedded_tiny(), "cpu")
    store = PagedCache(model, 16, max_seqs=3)
    return model, store, StepGraph(model, store, StepShape(2, 1, 64))


def _decode(model, store, graph, lengths: dict, tokens: int = 1):
    for name, n in lengths.items():
        if name not in store._seqs:
            store.add(name)
            paged_step(model, make_batch([[5] * n]), store, [name])
    names = list(lengths)
    batch = make_batch([[7] * tokens for _ in names], [store.length(s) for s in names])
    return paged_step(model, batch, store, names, graph=graph, commit=False)[0]


def test_a_step_the_graph_does_not_fit_is_refused_before_anything_runs(traced):
    model, store, graph = traced
    with pytest.raises(ValueError, match="3 sequences do not fit a step bucket of 2"):
        _decode(model, store, graph, {"a": 3, "b": 4, "c": 5})
    for name in ("a", "b", "c"):
        store.free(name)
    with pytest.raises(ValueError, match=r"a step bucket of 1 new tokens per sequence got \[2\]"):
        _decode(model, store, graph, {"a": 3}, tokens=2)
    store.free("a")
    with pytest.raises(ValueError, match="reaches position 65, past the bucket's 64"):
        _decode(model, store, graph, {"a": 64})
    store.free("a")


def test_a_graph_refuses_inputs_unlike_the_traced_ones(traced):
    model, store, graph = traced
    store.add("a")
    paged_step(model, make_batch([[5] * 3]), store, ["a"])
    store.ensure("a", 4)
    batch = store.address(make_batch([[7]], [3]), ["a"], StepShape(2, 1, 64))
    wrong = batch._replace(tokens=batch.tokens.to(torch.int32))
    with pytest.raises(ValueError, match=r"input batch\.tokens is torch\.int32 \[2\], the graph takes torch\.int64"):
        graph(wrong, store)
    with pytest.raises(ValueError, match="computes the logits of every row"):
        graph(batch._replace(logit_rows=torch.tensor([0])), store)
    other = batch._replace(state=batch.state._replace(trash=7))
    with pytest.raises(ValueError, match=r"input batch\.state\.trash is 7, the graph was traced with 3"):
        graph(other, store)
    store.free("a")


def test_pools_are_checked_once_per_cache_and_a_new_cache_is_checked_again(traced):
    """The parameters, pools and RoPE tables are flattened and checked when a graph first sees them; a
    step on another cache (its own pools) is checked anew, and pools unlike the traced ones are refused."""
    model, store, graph = traced
    store.add("a")
    paged_step(model, make_batch([[5] * 3]), store, ["a"])
    store.ensure("a", 4)
    batch = store.address(make_batch([[7]], [3]), ["a"], StepShape(2, 1, 64))
    logits, _ = graph(batch, store)
    assert graph._held[2][0] is store.layers and logits.shape[0] == 2
    smaller = PagedCache(model, 8, max_seqs=3)
    smaller.add("b")
    paged_step(model, make_batch([[5] * 3]), smaller, ["b"])
    smaller.ensure("b", 4)
    other = smaller.address(make_batch([[7]], [3]), ["b"], StepShape(2, 1, 64))
    with pytest.raises(ValueError, match=r"input pools\[\d+\]\.[\w.]+ is torch\.float32 \[96, 64\], the graph takes torch\.float32 \[128, 64\]"):
        graph(other, smaller)
    assert graph._held[2][0] is store.layers            # the refused cache was not taken as checked
    again, _ = graph(batch, store)
    assert torch.equal(again, logits)
    store.free("a")


def test_capture_sizes_and_the_default_mode():
    assert capture_sizes(16) == (1, 2, 4, 8, 16)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(16, (4, 2, 4)) == (2, 4)
    with pytest.raises(ValueError, match=r"each must be in \[1, max_num_seqs=8\]"):
        capture_sizes(8, (4, 16))
    # no graph API on CPU: eager unless asked
    assert device_graph_api(None) is None and device_graph_api("cpu") is None
    store = PagedCache.__new__(PagedCache)
    store.device = None
    assert graph_mode_on(None, store) is False and graph_mode_on(False, store) is True
    assert graph_mode_on(True, store) is False
