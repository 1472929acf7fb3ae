"""Exact match of a generated reply against an example's answer (lib/evaluation/tasks.py).

A text answer matches when the reply, stripped of surrounding whitespace, is the answer; a tool-call answer when the
reply parses (lib/text/dsml.py, as the server parses it) into exactly one call of the right function whose
arguments equal the expected ones as JSON values. Must not know models or engines.
"""
from __future__ import annotations

import json

from lib.evaluation.tasks import Example
from lib.text.dsml import parse_tool_calls


def expected_call(example: Example) -> tuple[str, dict] | None:
    calls = example.reply.get("tool_calls")
    if not calls:
        return None
    fn = calls[0]["function"]
    return fn["name"], json.loads(fn["arguments"])


def is_correct(example: Example, reply: str) -> bool:
    """Whether `reply` (the generated text, markup kept, end-of-sentence left out) answers `example`."""
    call = expected_call(example)
    if call is None:
        return reply.strip() == example.reply["content"]
    _, calls = parse_tool_calls(reply)
    if not calls or len(calls) != 1:
        return False
    fn = calls[0]["function"]
    try:
        return (fn["name"], json.loads(fn["arguments"])) == call
    except json.JSONDecodeError:
        return False
