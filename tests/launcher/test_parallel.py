"""Tensor and expert parallelism in real processes (gloo): every layout decodes exactly like one
process, the field's TP/EP bugs re-introduced are caught, and the CLI refuses what cannot split.

Each check launches the ranks the way `dsv4gen run --tensor-parallel-size T` does (lib/launcher/ranks.py).
CI runs every layout on cpu and a short 310P TP=2+EP=2 check; `-m slow` runs the whole matrix (about
6 minutes per device layout on 2 cores). Device layouts are exact because no rank rounds a partial sum: the
EP exchange moves pair rows and combines once (lib/distributed/expert_exchange.py), and wo_b sums its per-group products
over groups and TP ranks before its one rounding (`o_proj`).
"""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lib.porting import parallel_check
from lib.weights.checkpoint import Checkpoint
from lib.cli.main import main as dsv4gen

STEPS = 64
PROMPTS = parallel_check.DEFAULT_PROMPTS[:2]
LAYOUTS = [(1, 2, "allgather"), (2, 1, "allgather"), (2, 2, "alltoall")]
MATRIX = [pytest.param(b, tp, ep, d, marks=() if b == "cpu" else pytest.mark.slow)
          for b in ("cpu", "ascend310p", "ascend910", "hip936") for tp, ep, d in LAYOUTS] + \
         [pytest.param("hip936", 1, 2, "alltoall", marks=pytest.mark.slow)]       # the profile's dispatch


@pytest.fixture(scope="module")
def references():
    return {}


@pytest.mark.parametrize("backend, tp, ep, dispatch", MATRIX)
def test_layout_decodes_like_one_process_with_and_without_dspark(tiny_ckpt, references, backend, tp, ep, dispatch):
    results = parallel_check.check(tiny_ckpt, backend, tp, ep, dispatch, steps=STEPS, prompts=PROMPTS,
                                   reference=references.setdefault(backend, {}))
    assert [r.speculative for r in results] == ["none", "dspark"]
    for r in results:
        assert r.first_difference is None, r.line()
        assert all(len(tokens) == STEPS for tokens in r.parallel)


@pytest.mark.parametrize("tp, ep, dispatch", LAYOUTS)
def test_v41_layout_decodes_like_one_process_with_and_without_dspark(v41_tiny_ckpt, references, tp, ep, dispatch):
    """DeepSeek-V4.1 on the reference: the heads split across TP ranks, the Engram table's rows in blocks of
    ceil(rows / TP) (each rank's lookup zero elsewhere, one all-reduce), the backbone's and the DSpark stages' own
    experts split across EP ranks; the KV sources' pools and the carried selection whole on every rank."""
    results = parallel_check.check(v41_tiny_ckpt, "cpu", tp, ep, dispatch, steps=16, prompts=PROMPTS,
                                   reference=references.setdefault("v41", {}))
    assert [r.speculative for r in results] == ["none", "dspark"]
    for r in results:
        assert r.first_difference is None, r.line()
        assert all(len(tokens) == 16 for tokens in r.parallel)


def test_v41_on_ascend910_with_tp_and_ep_together_decodes_like_one_process(v41_tiny_ckpt):
    """The field's model on the field's target: V4.1 on ascend910 with TP=2 and EP=2 over all-to-all, its
    composites (the shared KV's selection gathering every head, Engram's rows summed across ranks) and its W4A8
    experts (combined under EP by the one-rank kernel, in fp32, rounded once) exact, 16 steps of one prompt with
    and without DSpark."""
    results = parallel_check.check(v41_tiny_ckpt, "ascend910", 2, 2, "alltoall", steps=16, prompts=PROMPTS[:1])
    assert [r.speculative for r in results] == ["none", "dspark"]
    for r in results:
        assert r.first_difference is None, r.line()


def test_device_tp_and_ep_together_decode_like_one_process(tiny_ckpt):
    """CI's device layout (the full matrix is -m slow): 310P with TP=2 and EP=2 over all-to-all, so
    both the per-group wo_b sum and the pair-row exchange run, 16 steps of one prompt."""
    results = parallel_check.check(tiny_ckpt, "ascend310p", 2, 2, "alltoall", steps=16, prompts=PROMPTS[:1])
    assert [r.speculative for r in results] == ["none", "dspark"]
    for r in results:
        assert r.first_difference is None, r.line()


def test_tp4_is_refused_where_the_config_does_not_divide(tiny_ckpt, capsys):
    """The default tiny model has o_groups = 2: TP 4 cannot give every rank whole wo_a groups."""
    assert dsv4gen(["run", "--model", str(tiny_ckpt), "--prompt", "hi", "--tp", "4"]) == 2
    assert "does not divide o_groups (2)" in capsys.readouterr().err


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    """A tiny config TP 4 divides (o_groups 4): the TP=4 acceptance layout."""
    from lib.weights.tiny_checkpoint import make_tiny
    return make_tiny(tmp_path_factory.mktemp("tp4") / "ckpt",
                     overrides={"o_groups": 4, "o_lora_rank": 128, "index_head_dim": 64})


@pytest.mark.parametrize("backend", ["cpu"] + [pytest.param(b, marks=pytest.mark.slow)
                                                for b in ("ascend310p", "ascend910", "hip936")])
def test_tp4_decodes_like_one_process(wide_ckpt, backend):
    for r in parallel_check.check(wide_ckpt, backend, 4, 1, "allgather", steps=STEPS, prompts=PROMPTS[:1]):
        assert r.first_difference is None, r.line()


def test_b11_rank0_expert_map_is_caught(tiny_ckpt):
    """Every EP rank with rank 0's expert map (the map cached before fork): tokens diverge."""
    results = parallel_check.check(tiny_ckpt, "ascend310p", 1, 2, "allgather", steps=16, prompts=PROMPTS,
                                   modes=("none",), inject="B11")
    assert results[0].first_difference is not None, results[0].line()


@pytest.fixture(scope="module")
def varied_scales(wide_ckpt, tmp_path_factory):
    """B05 needs a row-parallel wo_b whose input spans several scale blocks (the default tiny's 128
    columns are one block both ranks share) with blocks that differ: the tiny maker gives every
    block of a tensor the same E8M0 scale, so this copy gives wo_b's blocks distinct powers of two
    (a valid checkpoint: the weights are simply scaled per block)."""
    out = tmp_path_factory.mktemp("scales") / "ckpt"
    shutil.copytree(wide_ckpt, out)
    ckpt = Checkpoint(out)
    shards = {}
    for key, entry in ckpt.headers.items():
        if key.endswith("attn.wo_b.scale"):
            shards.setdefault(entry.shard, []).append(key)
    for shard, keys in shards.items():
        tensors = load_file(out / shard)
        for key in keys:
            scale = tensors[key]
            bump = torch.arange(scale.numel()).reshape(scale.shape) % 3 - 1          # -1, 0, +1 binades
            tensors[key] = (scale.float() * torch.exp2(bump.float())).to(scale.dtype)
        save_file(tensors, out / shard, metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("backend", ["cpu", pytest.param("ascend310p", marks=pytest.mark.slow)])
def test_b05_unsliced_tp_scales_are_caught(varied_scales, backend):
    """The clean TP run stays identical to one process; with B05 (rank 0's scales on every rank) it
    does not. The loading code B05 lives in is shared by every backend; -m slow shows it on 310P."""
    reference: dict = {}
    clean = parallel_check.check(varied_scales, backend, 2, 1, "allgather", steps=16, prompts=PROMPTS,
                                 modes=("none",), reference=reference)
    assert clean[0].first_difference is None, clean[0].line()
    broken = parallel_check.check(varied_scales, backend, 2, 1, "allgather", steps=16, prompts=PROMPTS,
                                  modes=("none",), inject="B05", reference=reference)
    assert broken[0].first_difference is not None, broken[0].line()


def test_conformance_cli_runs_the_parallel_check(tiny_ckpt, capsys):
    assert dsv4gen(["conformance", "--backend", "hip936", "--model", str(tiny_ckpt), "--ep", "2",
                    "--steps", "8"]) == 0
    out = capsys.readouterr().out
    assert "TP=1 EP=2 alltoall (none): 24 greedy tokens vs one process: identical" in out and "PASS" in out


class _ExitOnUnpickle:
    """Unpickling it (in a spawned worker, before the worker's code runs) exits with code 3: a rank
    that dies on its way to the rendezvous, like a worker whose import fails."""

    def __reduce__(self):
        import os
        return os._exit, (3,)


def test_a_worker_dying_before_the_rendezvous_fails_the_launch_at_once(tiny_ckpt):
    """Rank 0 would otherwise wait in the rendezvous for the group's timeout (7 days)."""
    import time

    from lib.engine.llm_engine import EngineConfig
    from lib.launcher.ranks import LaunchSpec, launch

    spec = LaunchSpec(tiny_ckpt, "cpu", _ExitOnUnpickle(), EngineConfig(max_num_seqs=1), tp=2)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) exited with code 3 before joining"):
        launch(spec, progress=False)
    assert time.monotonic() - start < 120
