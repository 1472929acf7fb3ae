"""`dsv4gen conformance` on every device backend, clean and with every catalogued field bug.

The acceptance of the device backends: on the default tiny checkpoint each backend passes with
zero guard violations, every sub-layer and weight-free op within its budget, top-1 agreement on
the decisive teacher-forced steps, identical logits in another cache placement, identical batch
replicas and a rewound verify that leaves no trace; and every injection is detected. Long-context
conformance (`--context`) runs on the `tiny-long` preset: a short context here, 16384 positions
in the slow tests (where C01 and C02, exact at short contexts, are caught).
"""
from __future__ import annotations

import pytest
import torch

from lib.cli.main import main
from lib.porting import conformance, conformance_context
from lib.porting.conformance_paged import new_store
from lib.porting.faults import CATALOGUE
from lib.records.batch import make_batch
from lib.runtime.loaded_model import load_model
from lib.runtime.paged_step import paged_step, prefill_logits
from lib.weights.params import LoadOptions
from lib.weights.tiny_checkpoint import make_tiny
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


@pytest.fixture(scope="module")
def pro_tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("pro") / "ckpt", variant="pro-tiny")


@pytest.mark.parametrize("backend", DEVICES)
def test_pro_shaped_checkpoint_passes_conformance(pro_tiny, backend):
    """V4-Pro's schedule (HCA first, no sliding-only layer) and its MTP drafter, at tiny widths: the same
    checks pass, the engine drafting with the MTP layer as losslessly as with DSpark."""
    report = conformance.run(backend, pro_tiny, steps=16)
    assert report.passed, "\n" + report.table()
    names = [c.name for c in report.checks]
    assert any(n.startswith("attention hca") for n in names) and "engine: mtp == plain greedy" in names


# injections only one check can see: detection must come from that check, not from a side effect
DETECTED_BY = {"B17": "draft logits finite", "B20": "engine (dspark) under guard"}


# Bugs whose site needs TP >= 2 (B05) cannot show in one process: tests/launcher/test_parallel.py catches
# them with the ranks in their own processes. Long-context bugs (C01, C02) change nothing in a short run:
# the --context tests below catch them.
@pytest.mark.parametrize("backend, bug", [(b, bug) for bug, inj in CATALOGUE.items() for b in DEVICES
                                          if b in inj.backends and inj.min_tp == 1 and inj.min_context == 0
                                          and "deepseek_v4" in inj.models])
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
    assert main(["conformance", "--backend", "hip936", "--model", str(tiny_ckpt), "--inject", "V03"]) == 2
    assert "V03 has no bug site in a deepseek_v4 checkpoint's code path" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["ascend310p", "hip936"])
def test_expert_modes_give_identical_outputs(tiny_ckpt, backend):
    """Experts converted at load and requantised when they run give the same int8 values: the same logits,
    for a prompt of 24 tokens and of 8 (hip936 runs up to 16 tokens as (token, expert) pairs)."""
    models = {mode: load_model(tiny_ckpt, backend, options=LoadOptions(expert_mode=mode))
              for mode in ("resident", "streaming")}
    for n in (24, 8):
        ids = conformance.prompt_ids(n, 1024)
        assert torch.equal(prefill_logits(models["resident"], ids), prefill_logits(models["streaming"], ids))


def test_310p_long_prompt_uses_the_compressed_path(tiny_ckpt):
    """Prompts longer than the window: CSA and HCA layers hold compressed entries in their pools."""
    model = load_model(tiny_ckpt, "ascend310p")
    n = 3 * model.cfg.sliding_window
    store, seqs = new_store(model, [n])
    paged_step(model, make_batch([conformance.prompt_ids(n, 1024)]), store, seqs)
    live = store.live_rows(seqs[0])
    for layer in backbone(model.cfg):
        owner = f"layer{layer.index}"
        if layer.attention != "swa":
            entries = live[f"{owner}.comp.entries"]
            assert entries.shape[0] == n // layer.ratio > 0 and entries.abs().sum(-1).gt(0).all()
            assert entries.dtype == torch.float16            # fp16 on 310P (L02)
        if layer.attention == "csa":
            assert live[f"{owner}.index.entries"].shape[0] == n // layer.ratio
        else:
            assert f"{owner}.index.entries" not in live


# ---- long context (`--context`) ---------------------------------------------------------------------
SHORT_CONTEXT = 1536     # past C02's 1028 positions (CSA entries beyond its kernel's first tile)
LONG_CONTEXT = 16384
LONG_BUGS = [bug for bug, inj in CATALOGUE.items() if inj.min_context > 0]


@pytest.fixture(scope="module")
def long_ckpt(tmp_path_factory):
    """The tiny-long preset: Flash's window 128 and compress ratios 4 / 128 at the tiny widths."""
    return make_tiny(tmp_path_factory.mktemp("tiny-long") / "ckpt", preset="tiny-long")


@pytest.fixture(scope="module")
def context_references(long_ckpt):
    cache: dict[int, conformance_context.ContextReference] = {}

    def get(context: int) -> conformance_context.ContextReference:
        if context not in cache:
            cache[context] = conformance_context.context_reference(long_ckpt, context, steps=4, chunk=512)
        return cache[context]
    return get


def test_long_bugs_are_catalogued_past_the_short_run():
    assert set(LONG_BUGS) >= {"C01", "C02"}
    assert all(CATALOGUE[bug].min_context > 24 + 32 for bug in LONG_BUGS)      # the short run never shows them


@pytest.mark.parametrize("backend", DEVICES)
def test_short_context_conformance_passes(long_ckpt, context_references, backend):
    report = conformance_context.run(backend, long_ckpt, SHORT_CONTEXT, reference=context_references(SHORT_CONTEXT))
    assert report.passed, "\n" + report.table()
    counts = {c.name.split(":")[0]: int(c.value) for c in report.checks if c.name.endswith("at the last step")}
    assert counts == {"CSA": (SHORT_CONTEXT + 4) // 4, "HCA": (SHORT_CONTEXT + 4) // 128}


@pytest.mark.parametrize("backend", DEVICES)
def test_short_context_catches_the_per_block_top_k(long_ckpt, context_references, backend):
    report = conformance_context.run(backend, long_ckpt, SHORT_CONTEXT, inject="C02",
                                     reference=context_references(SHORT_CONTEXT), stop_on_failure=True)
    failed = [c.name for c in report.checks if not c.passed]
    assert any(n.startswith("indexer: selected entries the device missed") for n in failed), report.table()


def test_short_context_catches_the_fused_compressor_state_table(long_ckpt, context_references):
    """F03 on ascend910, where the tiny-long preset's ratios 4 and 128 run the fused compressor on decode steps."""
    report = conformance_context.run("ascend910", long_ckpt, SHORT_CONTEXT, inject="F03",
                                     reference=context_references(SHORT_CONTEXT), stop_on_failure=True)
    failed = [c.name for c in report.checks if not c.passed]
    assert any(n.startswith(LONG_DETECTED_BY["F03"]) for n in failed), report.table()


def test_cli_refuses_a_long_context_bug_without_the_context(tiny_ckpt, capsys):
    assert main(["conformance", "--backend", "hip936", "--model", str(tiny_ckpt), "--inject", "C01"]) == 2
    assert "C01 changes nothing before 8200 positions: add --context 8200" in capsys.readouterr().err
    assert main(["conformance", "--backend", "hip936", "--model", str(tiny_ckpt), "--inject", "C02",
                 "--context", "512"]) == 2
    assert "add --context 1028" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("backend", DEVICES)
def test_long_context_conformance_passes(long_ckpt, context_references, backend):
    report = conformance_context.run(backend, long_ckpt, LONG_CONTEXT, reference=context_references(LONG_CONTEXT))
    assert report.passed, "\n" + report.table()


# what sees each long-context bug: C01's entries rotated one window off, C02's selection, F03's state rows
LONG_DETECTED_BY = {"C01": "attention csa entries", "C02": "indexer: selected entries the device missed",
                    "F03": "paged state vs the reference's"}


@pytest.mark.slow
@pytest.mark.parametrize("backend, bug", [(b, bug) for bug in LONG_BUGS for b in DEVICES if b in CATALOGUE[bug].backends])
def test_long_context_catches_every_long_bug(long_ckpt, context_references, backend, bug):
    report = conformance_context.run(backend, long_ckpt, LONG_CONTEXT, inject=bug,
                                     reference=context_references(LONG_CONTEXT), stop_on_failure=True)
    failed = [c.name for c in report.checks if not c.passed]
    assert any(n.startswith(LONG_DETECTED_BY[bug]) for n in failed), \
        f"{bug} on {backend} at context {LONG_CONTEXT}:\n{report.table()}"
