"""The trained tiny checkpoint shipped in the package is what `dsv4gen train-tiny` writes, in the official format, and
it answers: `dsv4gen eval` with no --model scores it through the engine as a user runs it."""
from __future__ import annotations

import json

from lib.cli.main import main
from lib.weights.checkpoint import summary
from lib.weights.tiny_checkpoint import REPRODUCTION_RECORD, TRAINING_RECORD, shipped_trained
from spec.config import load_config_json


def test_the_shipped_checkpoint_records_how_it_was_made():
    path = shipped_trained()
    record = json.loads((path / TRAINING_RECORD).read_text())
    assert record["command"].startswith("dsv4gen train-tiny ") and "--seed 0" in record["command"]
    assert record["config"]["seed"] == 0 and record["config"]["preset"] == "trained"
    assert 0 < record["training_seconds"] <= record["total_seconds"]
    assert record["heldout"]["dspark_replies_identical"] is True
    cfg, _ = load_config_json(path / "config.json")
    shipped_bytes = sum(f.stat().st_size for f in path.iterdir())
    assert cfg.sliding_window == 32 and summary(cfg)["all"]["bytes"] < shipped_bytes < 16 << 20     # a few MiB


def test_the_shipped_command_reproduces_the_checkpoints_accuracy_in_90_minutes():
    """The issue's bar: from scratch, the training command reproduces the shipped weights' held-out accuracy within 2
    points, training and scoring in at most 90 minutes on the 2-core machine (a run recorded whole, not repeated
    here: it takes most of those 90 minutes)."""
    shipped = json.loads((shipped_trained() / TRAINING_RECORD).read_text())
    again = json.loads((shipped_trained() / REPRODUCTION_RECORD).read_text())
    assert _arguments(again["command"]) == _arguments(shipped["command"])           # the same command, another --out
    assert again["config"] == shipped["config"] and again["torch"] == shipped["torch"]
    assert again["total_seconds"] <= 90 * 60
    assert again["heldout"]["accuracy"].keys() == shipped["heldout"]["accuracy"].keys()
    for task, accuracy in shipped["heldout"]["accuracy"].items():
        assert abs(again["heldout"]["accuracy"][task] - accuracy) <= 0.02 + 1e-9, task
    assert again["heldout"]["dspark_replies_identical"] is True


def _arguments(command: str) -> list[str]:
    words = command.split()
    return [w for i, w in enumerate(words) if w != "--out" and (i == 0 or words[i - 1] != "--out")]


def test_eval_defaults_to_the_shipped_checkpoint_and_it_answers(tmp_path, capsys):
    out, samples = tmp_path / "eval.json", tmp_path / "samples.jsonl"
    assert main(["eval", "--tasks", "copying,facts,tool_call", "--per-task", "10", "--speculative", "none",
                 "--json", "--out", str(out), "--log-samples", str(samples)]) == 0
    printed = capsys.readouterr()
    assert f"using the shipped trained tiny checkpoint {shipped_trained()}" in printed.err
    report = json.loads(out.read_text())
    accuracy = {task: r["accuracy"] for task, r in report["runs"]["plain"]["accuracy"].items()}
    assert set(accuracy) == {"copying", "facts", "tool_call"}
    # a random checkpoint gets none of these (docs/training.md); the shipped one most of them
    assert all(a >= 0.8 for a in accuracy.values()), accuracy
    # --log-samples: a line per question, the same verdicts as the report, a right reply the expected one whole
    lines = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(lines) == 30 and {line["run"] for line in lines} == {"plain"}
    for task, r in report["runs"]["plain"]["accuracy"].items():
        assert sum(line["correct"] for line in lines if line["task"] == task) == r["correct"]
    assert all(line["reply"] == line["expected"] for line in lines if line["correct"] and line["task"] != "tool_call")
    assert all(line["tools"] == (["get_weather", "set_alarm", "send_message"] if line["task"] == "tool_call" else [])
               for line in lines)
