"""`dsv4gen eval` on a tiny checkpoint, as users call it: the JSON report, replies that are the model's own greedy
continuations (batched and chunked through the engine), and DSpark runs that reply exactly as plain ones."""
from __future__ import annotations

import json

import pytest

from lib.cli.main import main
from lib.engine.greedy import greedy
from lib.engine.llm_engine import Engine, EngineConfig
from lib.evaluation import suite
from lib.evaluation.tasks import TASKS
from lib.runtime.loaded_model import load_model
from lib.text.tokenizer import Tokenizer


def test_eval_reports_every_task_with_and_without_dspark(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(tiny_ckpt), "--per-task", "2", "--max-num-batched-tokens", "48",
                 "--json", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == printed
    assert set(printed["runs"]) == {"plain", "dspark"} and printed["identical_replies"] is True
    for run in printed["runs"].values():
        assert list(run["accuracy"]) == list(TASKS)
        for task in run["accuracy"].values():
            assert task["examples"] == 2 and 0 <= task["correct"] <= 2 and task["accuracy"] == task["correct"] / 2
    assert printed["runs"]["plain"]["speculation"] is None
    spec = printed["runs"]["dspark"]["speculation"]
    assert spec["rounds"] > 0 and len(spec["accepted_per_position"]) == len(spec["drafted"])
    assert spec["mean_accepted_per_round"] == sum(spec["accepted"]) / spec["rounds"]
    assert printed["retrieval_gap_tokens"] == 8 * 16               # 8 windows of the tiny preset's 16


def test_eval_replies_are_the_greedy_continuations_scored_by_exact_match(tiny_ckpt):
    model, tok = load_model(tiny_ckpt), Tokenizer.from_dir(tiny_ckpt)
    exs = suite.heldout(("arithmetic", "retrieval", "tool_call"), 2, 0, gap_tokens=40,
                        count_tokens=lambda s: len(tok.encode(s)))
    engine = Engine(model, EngineConfig(max_num_seqs=3, max_num_batched_tokens=32, speculative="none"), tokenizer=tok)
    run = suite.run(engine, tok, exs)
    assert not engine.requests                                      # every finished request released
    for outcome, ex in zip(run.outcomes, exs):
        limit = len(tok.encode(suite.reply_text(ex))) + suite.SLACK_TOKENS
        alone = [t for t in greedy(model, tok.encode(suite.prompt_text(ex)), limit, frozenset({tok.eos_id}))
                 if t != tok.eos_id]
        assert outcome.reply == tok.decode(alone)
        assert outcome.correct == (outcome.reply.strip() == ex.reply["content"]) or ex.task == "tool_call"
    assert run.tokens > 0 and run.accuracy()["arithmetic"]["examples"] == 2


def test_eval_names_what_is_wrong(tiny_ckpt, capsys):
    assert main(["eval", "--model", str(tiny_ckpt), "--tasks", "arithmetic,poetry"]) == 2
    assert "poetry" in capsys.readouterr().err
    assert main(["eval", "--model", str(tiny_ckpt), "--per-task", "0"]) == 2
    assert "--per-task must be at least 1" in capsys.readouterr().err
    assert main(["eval", "--model", str(tiny_ckpt), "--log-samples", "/nonexistent/samples.jsonl"]) == 2
    assert "--log-samples /nonexistent/samples.jsonl: no folder /nonexistent" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["none", "dspark"])
def test_eval_runs_one_mode_when_asked(tiny_ckpt, capsys, flag):
    assert main(["eval", "--model", str(tiny_ckpt), "--tasks", "facts", "--per-task", "1", "--speculative", flag,
                 "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert list(printed["runs"]) == (["plain"] if flag == "none" else ["dspark"]) and "identical_replies" not in printed
