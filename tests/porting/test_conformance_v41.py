"""`dsv4gen conformance` on the tiny DeepSeek-V4.1 checkpoint: every device backend runs V4.1's forward (the shifted
mHC, Engram, the shared compressed KV and its two-level selection as composites) and passes against the cpu
reference, its selecting layers within the measured FP4 allowance; and V4.1's own pitfalls are caught, each by
the check that sees it (lib/porting/v41_faults.py)."""
from __future__ import annotations

import pytest

from lib.porting import conformance
from lib.porting.faults import CATALOGUE

DEVICES = ("ascend310p", "ascend910", "hip936")
V41_BUGS = [bug for bug, inj in CATALOGUE.items() if inj.models == ("deepseek_v41",)]
# the check that must see each: the runtime's pool sharing, the host hashing, the block's wiring
DETECTED_BY = {"V01": "paged state vs the reference's", "V02": "Engram hash ids",
               "V03": "block input collapse with the previous sub-layer's pre"}


@pytest.fixture(scope="module")
def reference(v41_tiny_ckpt):
    return conformance.reference_run(v41_tiny_ckpt, 32)


@pytest.mark.parametrize("backend", DEVICES)
def test_clean_v41_conformance_passes(v41_tiny_ckpt, reference, backend):
    report = conformance.run(backend, v41_tiny_ckpt, steps=32, reference=reference)
    assert report.passed, "\n" + report.table()
    names = [c.name for c in report.checks]
    for kind in ("swa", "source", "reindex", "reuse"):          # every V4.1 attention role was replayed
        assert any(n.startswith(f"attention {kind}:") for n in names), kind
    assert any(n.startswith("block input collapse") for n in names) and any(n.startswith("Engram hash ids")
                                                                            for n in names)
    assert {"engine: dspark == plain greedy", "guard violations"} <= set(names)      # zero violations: it passed


def test_the_catalogue_has_v41_pitfalls():
    assert V41_BUGS == ["V01", "V02", "V03"]


@pytest.mark.parametrize("backend, bug", [(b, bug) for bug in V41_BUGS for b in DEVICES])
def test_every_v41_injection_is_detected_by_its_check(v41_tiny_ckpt, reference, backend, bug):
    report = conformance.run(backend, v41_tiny_ckpt, steps=32, inject=bug, reference=reference, stop_on_failure=True)
    failed = [c.name for c in report.checks if not c.passed]
    assert any(n.startswith(DETECTED_BY[bug]) for n in failed), f"{bug} on {backend}:\n{report.table()}"
