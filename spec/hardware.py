"""The `device:` section of a backend profile: the numbers the planner predicts memory and speed with.

Each number says where it comes from: `basis` is `datasheet` (vendor specification), `field` (a
field report, seeds/ via data/porting-lessons.yaml), `third-party` (someone else's published
measurement) or `estimate` (reasoned, unmeasured), and `source` says which and how it was derived,
so a reviewer can tell a measured fact from a guess. This module knows units, not models or ops.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from spec.yamlio import SpecError

Basis = Literal["datasheet", "field", "third-party", "estimate"]


class Sourced(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    value: float
    basis: Basis
    source: str


class Device(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One device of the deployment (a chip, or a die where a package holds two)."""
    doc: str
    memory_bytes: Sourced                   # device memory the runtime can address
    memory_bandwidth_bytes_per_s: Sourced   # peak device-memory read bandwidth
    launch_latency_s: Sourced               # cost of one eager kernel launch when a step is launch-bound
    link_bandwidth_bytes_per_s: Sourced     # per-device bandwidth of the collective links
    collective_latency_s: Sourced           # fixed cost of one small collective (all-reduce / all-gather)
    runtime_reserve_bytes: Sourced          # held outside weights and KV: driver context, communicators, activations
    # cost of one kernel inside a replayed captured decode graph (`dsv4gen plan --graph-mode`), or why
    # the device has no captured decode step: exactly one of the two
    graph_launch_s: Sourced | None = None
    no_graph: str | None = None


# fields that may be zero (a runtime could reserve nothing); every other number must be positive
MAY_BE_ZERO = frozenset({"runtime_reserve_bytes"})


def check_device(device: Device, path: Path | str, lines: dict) -> None:
    """Values in range, a source for every number, and a reserve that leaves room for weights."""
    for field in device.__struct_fields__:
        number = getattr(device, field)
        if not isinstance(number, Sourced):
            continue
        where = f"{path}:{lines.get(('device', field, 'value'), lines.get(('device', field), '?'))}"
        low_ok = number.value >= 0 if field in MAY_BE_ZERO else number.value > 0
        if not low_ok:
            bound = "zero or positive" if field in MAY_BE_ZERO else "positive"
            raise SpecError(f"{where}: device.{field}.value must be {bound}, found {number.value:g}")
        if not number.source.strip():
            raise SpecError(f"{path}:{lines.get(('device', field, 'source'), '?')}: device.{field}.source is "
                            f"empty: say where the number comes from (a datasheet, a field report, a measurement)")
    if (device.graph_launch_s is None) == (device.no_graph is None):
        raise SpecError(f"{path}:{lines.get(('device',), '?')}: device needs exactly one of graph_launch_s (the cost "
                        f"of a kernel in a replayed graph) and no_graph (why decode is not captured)")
    if device.runtime_reserve_bytes.value >= device.memory_bytes.value:
        raise SpecError(f"{path}:{lines.get(('device', 'runtime_reserve_bytes', 'value'), '?')}: "
                        f"device.runtime_reserve_bytes ({device.runtime_reserve_bytes.value:.0f}) must be less than "
                        f"device.memory_bytes ({device.memory_bytes.value:.0f})")
