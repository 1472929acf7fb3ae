"""`dsv4gen conformance` on every device backend, clean and with every catalogued field bug.

The acceptance of the device backends: on the default tiny checkpoint each backend passes with
zero guard violations, every sub-layer and weight-free op within its budget, top-1 agreement on
the decisive teacher-forced steps, and deterministic replicas; and every injection is detected.
"""
from __future__ import annotations

import pytest
import torch

from lib.porting import conformance
from lib.records.batch import make_batch
from lib.cli.main import main
from lib.porting.faults import CATALOGUE
from lib.weights.params import LoadOptions
from lib.runtime.loaded_model import load_model, step
from spec.schedule import backbone

DEVICES = ("ascend310p", "ascend910", "hip936")
INJECTION_STEPS = 8     # positions 24..31 still cross ratio-4 and ratio-8 window completions


@pytest.fixture(scope="module")
def references(tiny_ckpt):
    """The cpu reference's runs, made once per step count and shared by every backend check."""
    cache: dict[int, conformance.ReferenceRun] = {}

    def get(steps: int) -> conformance.ReferenceRun:
        if steps not in cache:
            cache[steps] = conformance.reference_run(tiny_ckpt, steps)
        return cache[steps]
    return get


@pytest.mark.parametrize("backend", DEVICES)
def test_clean_conformance_passes(tiny_ckpt, references, backend):
    report = conformance.run(backend, tiny_ckpt, steps=32, reference=references(32))
    assert report.passed, "\n" + report.table()
    names = [c.name for c in report.checks]
    assert any(n.startswith("attention csa") for n in names) and any(n.startswith("ffn learned") for n in names)
    # the serving side ran: the engine with DSpark under the guard, and the draft block (310P in preconverted mode)
    mode = "preconverted" if backend == "ascend310p" else "default"
    assert {"engine: dspark == plain greedy", f"draft logits finite (expert mode {mode})"} <= set(names)
    top1 = next(c for c in report.checks if c.name.startswith("top-1 agreement"))
    qualifying = int(top1.name.split("(")[1].split("/")[0])
    assert qualifying >= 16, f"only {qualifying}/32 steps are decisive: {top1}"     # most steps qualify


# injections only one check can see: detection must come from that check, not from a side effect
DETECTED_BY = {"B17": "draft logits finite", "B20": "engine (dspark) under guard"}


# Bugs whose site needs TP >= 2 (B05) cannot show in one process: tests/launcher/test_parallel.py catches
# them with the ranks in their own processes.
@pytest.mark.parametrize("backend, bug", [(b, bug) for bug, inj in CATALOGUE.items() for b in DEVICES
                                          if b in inj.backends and inj.min_tp == 1])
def test_every_injection_is_detected(tiny_ckpt, references, backend, bug):
    # a bug any check may catch ends the run at the first failing stage; one only a late check can see runs them all
    report = conformance.run(backend, tiny_ckpt, steps=INJECTION_STEPS, inject=bug, reference=references(INJECTION_STEPS),
                             stop_on_failure=bug not in DETECTED_BY)
    assert not report.passed, f"{bug} went unnoticed on {backend}:\n{report.table()}"
    if bug in DETECTED_BY:
        failed = [c.name for c in report.checks if not c.passed]
        assert any(n.startswith(DETECTED_BY[bug]) for n in failed), f"{bug} on {backend}:\n{report.table()}"


def test_injections_restore_the_code_path(tiny_ckpt, references):
    """After an injected run, the same backend is clean again (nothing leaks out of the context)."""
    ref = references(INJECTION_STEPS)
    broken = conformance.run("hip936", tiny_ckpt, steps=INJECTION_STEPS, inject="B09", reference=ref,
                             stop_on_failure=True)
    assert not broken.passed
    # the FFN sub-layer check sees it, so the run ends before the engine stage
    assert not any(c.name.startswith("engine") for c in broken.checks), broken.table()
    assert conformance.run("hip936", tiny_ckpt, steps=INJECTION_STEPS, reference=ref).passed


def test_cli_reports_detection(tiny_ckpt, capsys):
    assert main(["conformance", "--backend", "ascend310p", "--model", str(tiny_ckpt), "--steps", "4",
                 "--inject", "B07"]) == 0
    out = capsys.readouterr().out
    assert "B07 detected by: ffn hash" in out
    assert main(["conformance", "--list-injections"]) == 0
    listing = capsys.readouterr().out
    assert all(bug in listing for bug in CATALOGUE)


def test_unknown_or_inapplicable_injection_is_refused(tiny_ckpt, capsys):
    assert main(["conformance", "--backend", "hip936", "--model", str(tiny_ckpt), "--inject", "B10"]) == 2
    assert "B10 has no bug site on backend hip936" in capsys.readouterr().err
    assert main(["conformance", "--backend", "hip936", "--model", str(tiny_ckpt), "--inject", "B99"]) == 2
    assert "unknown injection 'B99'" in capsys.readouterr().err


def test_310p_expert_modes_give_identical_outputs(tiny_ckpt):
    ids = conformance.prompt_ids(24, 1024)
    outs = {}
    for mode in ("resident", "streaming"):
        model = load_model(tiny_ckpt, "ascend310p", options=LoadOptions(expert_mode=mode))
        outs[mode], _ = step(model, make_batch([ids]), [model.new_cache()])
    assert torch.equal(outs["resident"], outs["streaming"])


def test_310p_long_prompt_uses_the_compressed_path(tiny_ckpt):
    """Prompts longer than the window: CSA and HCA layers hold and attend to compressed entries."""
    model = load_model(tiny_ckpt, "ascend310p")
    n = 3 * model.cfg.sliding_window
    _, caches = step(model, make_batch([conformance.prompt_ids(n, 1024)]), [model.new_cache()])
    for layer, cache in zip(backbone(model.cfg), caches[0].layers):
        if layer.attention != "swa":
            assert cache.comp.entries.shape[0] == n // layer.ratio > 0
            assert cache.comp.entries.dtype == torch.float16            # fp16 on 310P (L02)
        if layer.attention == "csa":
            assert cache.index.entries.shape[0] == n // layer.ratio
