"""The speed planner calibrated on the field (lib/planner/calibration.py): with each measured stack's own
kernel count the model lands within 15% of the step time that stack measured (the fused, graph-captured
910C stack at 128K; the eager 310P stack), and `dsv4gen plan` prints eager and captured predictions side
by side for the three field deployments."""
from __future__ import annotations

import pytest

from lib.cli.main import main
from lib.planner.calibration import TOLERANCE, calibrations
from spec.profile import load_profile, profile_path
from spec.yamlio import SpecError

FIELD_DEPLOYMENTS = {
    "ascend910": ["--max-model-len", "131072", "--memory-fraction", "0.92", "--acceptance", "0.36"],
    "ascend310p": ["--expert-mode", "resident", "--max-model-len", "128", "--kv-cache-bytes", "128MiB",
                   "--acceptance", "0.48"],
    "hip936": ["--max-model-len", "4096", "--speculative", "none"],
}


def test_with_the_field_kernel_counts_the_planner_reproduces_the_field_steps():
    rows = {r.name: r for r in calibrations()}
    assert set(rows) == {"910C, captured", "310P, eager"}
    for row in rows.values():
        assert row.error <= TOLERANCE, row
    assert rows["910C, captured"].mode == "captured" and rows["310P, eager"].mode == "eager"
    # the per-launch cost decides it: the 910C count run eager would be far off the measured step
    eager_910 = rows["910C, captured"].launches * load_profile("ascend910").device.launch_latency_s.value
    assert eager_910 > 1.5 * rows["910C, captured"].measured_s[1]


@pytest.mark.parametrize("backend", list(FIELD_DEPLOYMENTS))
def test_plan_prints_eager_and_captured_side_by_side(backend, capsys):
    assert main(["plan", "--backend", backend, "--devices", "8", "--tp", "8", "--ep", "8",
                 *FIELD_DEPLOYMENTS[backend]]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  tok/s eager"))
    eager, captured = line.split("; captured ")
    assert float(eager.split()[2]) > 0
    if backend == "ascend310p":
        assert captured.startswith("none (L15")
    else:
        assert float(captured.split()[0]) > float(eager.split()[2])      # a replayed kernel costs less


def test_graph_mode_is_the_headline_and_refused_where_nothing_is_captured(capsys):
    args = ["plan", "--backend", "ascend910", *FIELD_DEPLOYMENTS["ascend910"]]
    assert main(args) == 0
    eager = capsys.readouterr().out
    assert main([*args, "--graph-mode"]) == 0
    captured = capsys.readouterr().out
    assert "eager: 25 us a launch" in eager and "captured: 10.7 us a kernel in a replayed graph" in captured
    assert main(["plan", "--backend", "ascend310p", "--graph-mode", *FIELD_DEPLOYMENTS["ascend310p"]]) == 2
    assert "ascend310p has no captured decode step (L15" in capsys.readouterr().err
    assert main(["plan", "--calibration"]) == 0
    assert "910C, captured" in capsys.readouterr().out


def test_a_device_says_how_it_captures_or_why_not(tmp_path):
    src = profile_path("ascend910").read_text()
    path = tmp_path / "profile.yaml"
    start = src.index("  graph_launch_s:")
    end = src.index("quirks:", start)
    path.write_text(src[:start] + src[end:])
    with pytest.raises(SpecError, match="exactly one of graph_launch_s"):
        load_profile("ascend910", path)
