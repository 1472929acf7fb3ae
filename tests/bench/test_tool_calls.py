"""Tool calls through the real openai client: the verdict rules, and per question the same verdict as `dsv4gen
eval`'s engine-side scoring of the same held-out questions."""
from __future__ import annotations

import json
from types import SimpleNamespace

from lib.bench import tool_calls
from lib.engine.llm_engine import Engine, EngineConfig
from lib.evaluation import suite
from lib.evaluation.tasks import examples
from lib.runtime.loaded_model import load_model
from lib.text.tokenizer import Tokenizer


def _message(*calls: tuple[str, str]):
    return SimpleNamespace(tool_calls=[SimpleNamespace(function=SimpleNamespace(name=n, arguments=a))
                                       for n, a in calls] or None)


def test_a_reply_counts_only_as_the_one_expected_call():
    ex = examples("tool_call", "heldout", 1, 0)[0]
    fn = ex.reply["tool_calls"][0]["function"]
    spaced = json.dumps(json.loads(fn["arguments"]), indent=1)          # the same JSON values, other spacing
    assert tool_calls._verdict(ex, _message((fn["name"], spaced))) == (True, True)
    assert tool_calls._verdict(ex, _message(("other_function", fn["arguments"]))) == (True, False)
    assert tool_calls._verdict(ex, _message((fn["name"], "{not json"))) == (True, False)
    assert tool_calls._verdict(ex, _message()) == (False, False)
    assert tool_calls._verdict(ex, _message((fn["name"], fn["arguments"]), (fn["name"], fn["arguments"]))) == (False, False)


def test_the_client_sees_what_eval_scores(tiny_ckpt, capsys):
    model, n = tiny_ckpt, 6
    assert tool_calls.main(["--model", str(model), "--prompts", str(n), "--concurrency", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    client = json.loads("\n".join(lines[:-1]))
    assert client["prompts"] == n and lines[-1].startswith(f"{client['right_name_and_arguments']}/{n} tool-call")
    tok = Tokenizer.from_dir(model)
    engine = Engine(load_model(model, "cpu"), EngineConfig(max_num_seqs=8, speculative="none"), tokenizer=tok)
    scored = suite.run(engine, tok, examples("tool_call", "heldout", n, 0))
    assert client["right_per_prompt"] == [o.correct for o in scored.outcomes]
