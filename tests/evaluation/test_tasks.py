"""The task mix (lib/evaluation): what each task asks and answers, that held-out questions are never training ones,
that the retrieval gap is real in tokens, and that exact-match scoring accepts the answer and only the answer."""
from __future__ import annotations

import json
import random
import re

import pytest

from lib.evaluation.names import PLACES, fact_table
from lib.evaluation.scoring import is_correct
from lib.evaluation.suite import prompt_text, reply_text
from lib.evaluation.tasks import (CLOSINGS, FACT_QUESTIONS, FILLERS, OPENINGS, TASKS, arithmetic_edges, examples,
                                  worked)
from lib.text.tokenizer import EOS, Tokenizer, build_tiny_tokenizer

TOK = Tokenizer(build_tiny_tokenizer(1024))


def _count(text: str) -> int:
    return len(TOK.encode(text))


def _mix(task: str, split: str, n: int, seed: int = 0):
    return examples(task, split, n, seed, gap_tokens=128, count_tokens=_count)


@pytest.mark.parametrize("task", TASKS)
def test_every_example_is_answered_by_its_own_reply_and_the_encoding_extends_the_prompt(task):
    for split in ("train", "heldout"):
        for ex in _mix(task, split, 20):
            reply = reply_text(ex)
            assert reply.endswith(EOS) and prompt_text(ex).endswith("</think>")
            assert is_correct(ex, reply[: -len(EOS)])


def _calc(a: int, op: str, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def test_the_answers_are_the_questions_answers():
    for e in examples("arithmetic", "heldout", 50):
        a, op, b = re.search(r"(\d+) ?([-+*]) ?(\d+)", e.messages[0]["content"]).groups()
        assert e.reply["content"] == worked(int(a), op, int(b))
    questions = [(a, op, b) for op in "+-" for a in range(100) for b in range(100)]
    for a, op, b in questions + [(a, "*", b) for a in range(13) for b in range(13)]:    # every question there is
        question, rest = worked(a, op, b).split(": ")
        steps, result = rest.split(", so ") if op != "-" else rest.rsplit(" so ", 1)
        assert question == f"{a}{op}{b}" and result == f"{a}{op}{b}={_calc(a, op, b)}"
        if op == "-":                                     # the order again, just before the signed result
            steps, again = steps.rsplit(", ", 1)
            assert again == steps.split(", ")[0], (a, b)
        for i, step in enumerate(steps.split(", ")):     # every worked step is itself true
            if i == 0 and (op == "-" or op == "*" and max(a, b) >= 10):   # a difference, or a product of a factor
                # of 10 to 12, first orders its operands
                assert step == (f"{max(a, b)}>{min(a, b)}" if a != b else f"{a}={b}"), step
                continue
            left, right = step.split("=")
            terms = re.fullmatch(r"(\d+)([-+*])(\d+)(?:([-+])(\d+))?", left).groups()
            value = _calc(int(terms[0]), terms[1], int(terms[2]))
            assert int(right) == (value if terms[3] is None else _calc(value, terms[3], int(terms[4]))), step
    for e in examples("counting", "train", 50):
        letter, text = re.search(r"letter (\w) appear in (\w+)\?", e.messages[0]["content"]).groups()
        assert int(e.reply["content"]) == text.count(letter)
    table = {(f.place, f.relation): f.value for f in fact_table()}
    assert len(table) == 3 * PLACES and len({f.place for f in fact_table()}) == PLACES
    for e in examples("facts", "heldout", 30):
        place = e.messages[0]["content"].rstrip("?.").split()[-1]
        assert e.reply["content"] in {v for (p, _), v in table.items() if p == place}
    # a training question is a training phrasing of its fact, with at most a filler word, an opening and a closing
    for e in examples("facts", "train", 200):
        question = e.messages[0]["content"]
        for opening in OPENINGS:
            question = question.removeprefix(opening)
        for closing in CLOSINGS:
            question = question.removesuffix(closing)
        words = question.split(" ")
        bare = {" ".join(words)} | {" ".join(words[:i] + words[i + 1:])
                                     for i in range(len(words)) if words[i] in FILLERS}
        assert any(p.format(x=place) in bare and table[place, relation] == e.reply["content"]
                   for (place, relation) in table for p in FACT_QUESTIONS[relation][:-1]), e.messages[0]["content"]


@pytest.mark.parametrize("task", ["arithmetic", "counting", "copying", "facts", "tool_call"])
def test_no_held_out_question_is_a_training_question(task):
    def key(e):
        return (e.messages[0]["content"], json.dumps(e.reply, sort_keys=True))
    train = {key(e) for e in _mix(task, "train", 2000)}
    held = [key(e) for e in _mix(task, "heldout", 300)]
    assert not train & set(held)
    assert len(set(held)) > 30                       # and the held-out split is not a handful of questions


def test_the_same_seed_gives_the_same_questions_and_another_seed_others():
    for task in TASKS:
        assert _mix(task, "heldout", 5, seed=3) == _mix(task, "heldout", 5, seed=3)
        assert _mix(task, "heldout", 5, seed=3) != _mix(task, "heldout", 5, seed=4)


def test_the_retrieved_record_sits_at_least_the_gap_before_the_question():
    for gap in (16, 128, 400):
        for ex in examples("retrieval", "heldout", 10, gap_tokens=gap, count_tokens=_count):
            text = prompt_text(ex)
            name = ex.messages[0]["content"].rsplit(" ", 1)[1].rstrip("?")
            record = f"{name}: {ex.reply['content']}"
            assert text.count(record) == 1 and text.count(name) == 2        # asked once, stated once
            after = text[text.index(record) + len(record): text.rindex("What is the code")]
            assert _count(after) >= gap


def test_scoring_refuses_near_misses():
    ex = examples("arithmetic", "heldout", 1)[0]
    value = ex.reply["content"]
    steps, result = value.rsplit("=", 1)
    assert is_correct(ex, f" {value}\n") and not is_correct(ex, f"{steps}={int(result) + 1}")
    assert not is_correct(ex, f"{value}.") and not is_correct(ex, result)      # the bare result skips the steps
    call = examples("tool_call", "heldout", 1)[0]
    good = reply_text(call)[: -len(EOS)]
    args = json.loads(call.reply["tool_calls"][0]["function"]["arguments"])
    name = call.reply["tool_calls"][0]["function"]["name"]
    first_key = next(iter(args))
    wrong_value = good.replace(f">{args[first_key]}<", f">{args[first_key]}x<", 1)
    assert wrong_value != good and not is_correct(call, wrong_value)
    assert not is_correct(call, good.replace(f'"{name}"', '"other_tool"'))
    assert not is_correct(call, good + good[2:])                          # two calls
    assert not is_correct(call, good[:-20])                               # a truncated block
    assert not is_correct(call, json.dumps(args))                         # the arguments as plain text


def test_unknown_tasks_and_splits_are_named():
    with pytest.raises(ValueError, match="unknown task 'math'"):
        examples("math", "train", 1)
    with pytest.raises(ValueError, match="unknown split 'test'"):
        examples("facts", "test", 1)
    with pytest.raises(ValueError, match="count_tokens"):
        examples("retrieval", "train", 1)


def _operands(e) -> tuple[int, str, int]:
    a, op, b = re.search(r"(\d+) ?([-+*]) ?(\d+)", e.messages[0]["content"]).groups()
    return int(a), op, int(b)


def test_a_times_table_entry_is_a_training_question_and_never_held_out():
    held = [_operands(e) for e in examples("arithmetic", "heldout", 400)]
    products = [(a, b) for a, op, b in held if op == "*"]
    assert products and all(max(a, b) >= 10 for a, b in products)      # worked from table entries, never one
    train = {_operands(e) for e in examples("arithmetic", "train", 4000)}
    assert {(a, "*", b) for a in range(10) for b in range(10)} <= train
    # and its mirror, worked with the same steps, is a training question (so no square is held out: 10*10's step
    # 10*0 is in no other question)
    assert all((b, "*", a) in train for a, b in products) and not any(a == b for a, b in products)


def test_the_edge_draws_are_the_rare_kinds_and_keep_the_split():
    rng = random.Random(0)
    drawn = [_operands(arithmetic_edges(rng, "train")) for _ in range(600)]
    assert {op for _, op, _ in drawn} == {"+", "-"}
    one_digit = sum(min(a, b) < 10 for a, _, b in drawn)
    same_tens = sum(a // 10 == b // 10 for a, _, b in drawn)
    whole_ten = sum(a % 10 == 0 or b % 10 == 0 for a, _, b in drawn)
    # a uniform draw gives each about a tenth to a fifth of the time; the edge draw at least a third each
    assert min(one_digit, same_tens, whole_ten) > 200, (one_digit, same_tens, whole_ten)
    held = {_operands(e) for e in examples("arithmetic", "heldout", 300)}
    assert not held & set(drawn)
    held_edges = [_operands(arithmetic_edges(rng, "heldout")) for _ in range(100)]
    assert not set(held_edges) & set(drawn) and not set(held_edges) & {_operands(e) for e in
                                                                       examples("arithmetic", "train", 4000)}
