"""The speed planner against the field: its model (bytes / bandwidth + launches x per-launch cost +
collectives, lib/planner/speed.py) given each measured stack's own kernel count, eager or captured,
next to the step time that stack measured (data/field-decode-steps.json).

A launch count is what differs between stacks; bandwidth, collectives and the per-launch costs are
the profile's device numbers. So with the field's counts the model must land on the field's times:
tests/planner/test_calibration.py holds it to 15%, and `dsv4gen plan --calibration` prints the table.
"""
from __future__ import annotations

import json
from typing import NamedTuple

from lib.planner.memory import Deployment
from lib.planner.plan import make_plan
from lib.planner.speed import speed
from spec.tables import SPEC_DIR

FIELD = SPEC_DIR.parent / "data" / "field-decode-steps.json"
TOLERANCE = 0.15


class Calibration(NamedTuple):
    name: str
    mode: str                 # "eager" | "captured"
    launches: int             # the field stack's kernels per step
    predicted_s: float        # the planner's step with those launches
    measured_s: tuple[float, float]

    @property
    def error(self) -> float:
        """Relative distance of the prediction from the measured range (0 inside it)."""
        lo, hi = self.measured_s
        return 0.0 if lo <= self.predicted_s <= hi else min(abs(self.predicted_s - lo) / lo,
                                                            abs(self.predicted_s - hi) / hi)


def calibrations() -> list[Calibration]:
    out = []
    for name, entry in json.loads(FIELD.read_text())["deployments"].items():
        d = Deployment(**{**entry["plan"], "speculative": False})
        p = make_plan(d)
        step = speed(d, p.weights, p.layout, d.max_model_len, 0.0, graph=entry["graph"],
                     counts={"decode": entry["launches"]}).plain
        out.append(Calibration(name, "captured" if entry["graph"] else "eager", entry["launches"], step.seconds,
                               tuple(entry["step_s"])))
    return out


def format_calibrations(rows: list[Calibration]) -> str:
    lines = ["the planner with each field stack's own kernel count, against the step time it measured:",
             f"  {'deployment':<16} {'mode':<9} {'launches':>8}  {'predicted':>10}  {'measured':>15}  error"]
    for r in rows:
        lo, hi = r.measured_s
        lines.append(f"  {r.name:<16} {r.mode:<9} {r.launches:>8,}  {r.predicted_s * 1e3:8.1f} ms  "
                     f"{lo * 1e3:6.1f}-{hi * 1e3:.1f} ms  {r.error:.0%}")
    return "\n".join(lines)
