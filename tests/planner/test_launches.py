"""`dsv4gen plan --ops`: launches and host syncs of one decode step on the real Flash schedule.

Launch counts bound a real NPU; decode must never wait on the host. Runs every backend on the
shrunken-width Flash-0731 checkpoint (one layer per kind, 256 experts, top-6, scaled to the real
43-layer schedule) through the real loader and the engine's paged cache, and checks the counts the
speed planner reads (data/decode-launches.json) are the ones measured here, and that a decode step
of 16 sequences launches the kernels one of a single sequence does (the ops are batch-wide) but
for copies of rows strided only at 16 and ascend910's stacked GEMMs split by row range; `-m slow`
also checks the scaling against the full 43-layer checkpoint.
"""
from __future__ import annotations

import pytest

from lib.cli.main import main
from lib.planner.launch_counts import as_record, count_launches, load_counted, recorded, shrunk_flash
from spec.profile import backend_names, load_profile


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    """The default (reduced-depth) shrunk Flash, made in a cache of this module's own: the tests
    count it the way `dsv4gen plan --ops` does, scaled to the real schedule."""
    mp = pytest.MonkeyPatch()
    mp.setenv("DSV4GEN_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield shrunk_flash()
    mp.undo()


@pytest.fixture(scope="module")
def loaded(flash):
    """backend -> the shrunk Flash loaded on it, once for every test of this module."""
    models = {}

    def get(backend):
        if backend not in models:
            models[backend] = load_counted(backend)
        return models[backend]
    return get


@pytest.fixture(scope="module")
def sixteen(loaded):
    """backend -> its decode step of 16 sequences, counted once for the module."""
    reports = {}

    def get(backend):
        if backend not in reports:
            reports[backend] = count_launches(loaded(backend), 16, with_round=False)
        return reports[backend]
    return get


@pytest.mark.parametrize("backend", backend_names())
def test_decode_step_has_no_host_sync(loaded, sixteen, backend):
    report = count_launches(loaded(backend))
    kinds = {row.kind: row for row in report.rows}
    assert {k: r.layers for k, r in kinds.items()} == {"swa / hash": 2, "csa / hash": 1, "hca / learned": 20,
                                                       "csa / learned": 20}
    assert report.syncs == 0 and all(r.syncs == 0 for r in report.rows)
    assert report.total == report.outside + sum(r.launches * r.layers for r in report.rows)
    assert kinds["csa / learned"].launches > kinds["hca / learned"].launches     # the indexer costs launches
    assert report.dspark["verify"] > report.dspark["draft"] > report.dspark["context"] > 0
    assert as_record(report, sixteen(backend)) == recorded(backend), (
        f"data/decode-launches.json is stale for {backend}; run: dsv4gen plan --ops --backend {backend} --record")


def _stacked_pairs(counted) -> int:
    """GEMM pairs of a decode step the profile stacks into one weight (shared_inputs one_gemm) on the real schedule:
    per layer kind, the pairs whose weights the shrunk model's layer of that kind holds, times that kind's layers."""
    from lib.planner.launch_counts import _kind_counts
    from spec.schedule import backbone

    pairs = [p.keys for p in load_profile(counted.model.backend).shared_inputs.values() if p.one_gemm]
    per_kind = {f"{layer.attention} / {layer.routing}": sum(all(k in lp for k in keys) for keys in pairs)
                for layer, lp in zip(backbone(counted.model.cfg), counted.model.params.layers)}
    return sum(per_kind[kind] * n for kind, n in _kind_counts(counted.schedule).items())


@pytest.mark.parametrize("backend", backend_names())
def test_decode_kernels_do_not_depend_on_the_batch(loaded, sixteen, backend):
    """The ops are batch-wide: 16 sequences launch the kernels one does, except copies that a view-schema op makes
    of rows strided at 16 rows and not at one (a [T, k] expand flattened on hip936, a transposed group split on
    310P), and ascend910's stacked W8A8 GEMMs: one GEMM whose column ranges are contiguous at one row, one GEMM
    per row range of the stacked weight at more (a column range would be strided, and its copy a launch too)."""
    one, many = count_launches(loaded(backend), 1, with_round=False), sixteen(backend)
    assert many.batch == 16 and many.syncs == 0
    split = _stacked_pairs(loaded(backend)) if backend == "ascend910" else 0
    assert many.total - many.copies == one.total - one.copies + split and many.copies >= one.copies > 0
    assert split == (0 if backend != "ascend910" else 43 + 21)     # wq_a | wkv in every layer, wq_b | index wq_b in CSA


def test_plan_ops_cli(flash, capsys):
    assert main(["plan", "--backend", "cpu", "--ops", "--batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "decode step of 16 sequence(s)" in out and "csa / learned          20" in out and "host syncs 0" in out
    assert f"total launches {recorded('cpu')['decode_batch16']} (" in out
    assert main(["plan", "--backend", "all"]) == 2
    assert "dsv4gen plan needs one --backend" in capsys.readouterr().err
    assert main(["plan", "--backend", "cpu", "--ops", "--batch", "0"]) == 2
    assert "--batch must be at least 1" in capsys.readouterr().err
    assert main(["plan", "--backend", "cpu", "--ops", "--batch", "2", "--record"]) == 2
    assert "--record keeps counts of batch 1" in capsys.readouterr().err


@pytest.mark.slow
def test_reduced_depth_counts_equal_the_full_schedule(tmp_path_factory):
    """One layer per kind, scaled, counts what all 43 layers launch (the premise of the default)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("DSV4GEN_CACHE", str(tmp_path_factory.mktemp("full")))
    full = shrunk_flash(full_depth=True)
    mp.undo()
    counted = load_counted("cpu", full)
    assert as_record(count_launches(counted), count_launches(counted, 16, with_round=False)) == recorded("cpu")
