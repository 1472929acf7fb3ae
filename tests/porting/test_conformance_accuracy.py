"""Conformance's accuracy stage: the held-out suite on the reference and on the device backend, per task within
3 points; on by default only for a checkpoint trained on the task mix."""
from __future__ import annotations

import shutil

from lib.evaluation.suite import Outcome, SuiteRun
from lib.evaluation.tasks import examples
from lib.porting import conformance_accuracy
from lib.porting.conformance import Check
from lib.runtime.loaded_model import load_model
from lib.weights.tiny_checkpoint import TRAINING_RECORD


def _run(correct: int, total: int = 40) -> SuiteRun:
    exs = examples("arithmetic", "heldout", total, 0)
    outcomes = tuple(Outcome(ex, "", i < correct) for i, ex in enumerate(exs))
    return SuiteRun(outcomes, (), (), 0.0, 0)


def test_default_only_on_a_trained_checkpoint(tiny_ckpt, tmp_path):
    assert conformance_accuracy.default_per_task(tiny_ckpt) == 0
    trained = tmp_path / "trained"
    shutil.copytree(tiny_ckpt, trained)
    (trained / TRAINING_RECORD).write_text("{}\n")
    assert conformance_accuracy.default_per_task(trained) == 40


def test_one_flipped_answer_in_forty_passes_two_fail(tiny_ckpt, monkeypatch):
    runs = iter([_run(20), _run(19), _run(20), _run(18)])     # reference, device; reference, device
    monkeypatch.setattr(conformance_accuracy, "measured", lambda *a, **k: next(runs))
    monkeypatch.setattr(conformance_accuracy, "load_model", lambda *a, **k: None)
    close = conformance_accuracy.accuracy_checks(tiny_ckpt, None, "ascend910", 40, Check)
    far = conformance_accuracy.accuracy_checks(tiny_ckpt, None, "ascend910", 40, Check)
    assert [c.passed for c in close] == [True] and [c.passed for c in far] == [False]
    assert far[0].name == "accuracy arithmetic (routed experts W4A8)"
    assert far[0].value == "18/40 vs reference 20/40"


def test_runs_every_task_through_both_engines(tiny_ckpt):
    checks = conformance_accuracy.accuracy_checks(tiny_ckpt, load_model(tiny_ckpt, "ascend310p"), "ascend310p", 1, Check)
    assert [c.name for c in checks] == [f"accuracy {t}" for t in
                                        ("arithmetic", "counting", "copying", "facts", "retrieval", "tool_call")]
    assert all(c.value.endswith("/1") and "vs reference" in c.value for c in checks)
