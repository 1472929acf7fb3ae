"""Conformance's accuracy stage: what a port that went wrong costs the user, measured the way the field gated its
changes (task accuracy), beside the logit checks.

The held-out task mix (lib/evaluation) runs through the engine, greedy and batched as a server runs it, once on the
cpu reference and once on the device backend's model (the one the other stages loaded: its runtime formats, fused
kernels and quirks; on ascend910 the routed experts are W4A8); each task's exact-match accuracy must stay within
ACCURACY_POINTS of the reference's. On a checkpoint not trained on the task mix (a random `make-tiny` one) every
accuracy is 0 and the stage says nothing, so it runs by default only on a trained one (`dsv4gen train-tiny`
writes training.json beside the weights).
"""
from __future__ import annotations

from lib.engine.llm_engine import Engine, EngineConfig
from lib.evaluation import suite
from lib.evaluation.tasks import TASKS
from lib.runtime.loaded_model import load_model
from lib.text.tokenizer import Tokenizer
from lib.weights.tiny_checkpoint import trained_on_task_mix

ACCURACY_POINTS = 3.0       # the largest accuracy difference from the reference, in points, on any task


def default_per_task(model_path) -> int:
    """Held-out questions per task when the command line does not say: on a trained checkpoint 40 (one answer is
    2.5 points, so a single flipped answer passes and two do not), else none."""
    return 40 if trained_on_task_mix(model_path) else 0


def measured(model, tokenizer: Tokenizer, per_task: int, seed: int = 0) -> suite.SuiteRun:
    """The held-out suite through `model`'s engine (plain greedy decoding)."""
    exs = suite.heldout_for(model.cfg, tokenizer, TASKS, per_task, seed)
    engine = Engine(model, EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, speculative="none"),
                    tokenizer=tokenizer)
    return suite.run(engine, tokenizer, exs)


def accuracy_checks(model_path, device_model, backend: str, per_task: int, check) -> list:
    """One check per task: the device's held-out accuracy against the reference's (`check`: conformance's Check)."""
    tokenizer = Tokenizer.from_dir(model_path)
    reference = measured(load_model(model_path, "cpu"), tokenizer, per_task).accuracy()
    device = measured(device_model, tokenizer, per_task).accuracy()
    experts = " (routed experts W4A8)" if backend == "ascend910" else ""
    checks = []
    for task, ref in reference.items():
        dev = device[task]
        points = abs(dev["accuracy"] - ref["accuracy"]) * 100
        checks.append(check(f"accuracy {task}{experts}",
                            f"{dev['correct']}/{dev['examples']} vs reference {ref['correct']}/{ref['examples']}",
                            f"within {ACCURACY_POINTS:g} points", points <= ACCURACY_POINTS))
    return checks
