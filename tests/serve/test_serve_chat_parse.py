"""Chat replies split into reasoning, content and DSML tool calls, streamed or whole.

The tiny checkpoint's random weights never write a DSML block, so the wire format of tool calls is
checked by feeding the chat stream writer engine outputs that carry one (everything after the
engine is the real code); tools in a request are checked end to end through /tokenize and the
prompt budget error of the real server.
"""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from lib.text.dsml import render_tool_calls
from lib.engine.requests import RequestOutput
from serve.chat_completions import _stream
from serve.chat_parse import ChatOutputParser, parse_whole
from serve_util import MODEL, running_server

CALLS = [{"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": "北京", "days": 3})}},
         {"type": "function", "function": {"name": "now", "arguments": "{}"}}]
REPLY = "I should look it up.</think>Let me check.\n\n" + render_tool_calls(CALLS)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def _split_everywhere(text: str):
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    yield list(text)                                  # one character at a time


def test_whole_reply_parses_into_reasoning_content_and_calls():
    reasoning, content, calls = parse_whole(REPLY, thinking=True, parse_tools=True, id_prefix="call_x_")
    assert reasoning == "I should look it up." and content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "北京", "days": 3}
    assert [c["id"] for c in calls] == ["call_x_0", "call_x_1"]


@pytest.mark.parametrize("thinking, tools", [(True, True), (True, False), (False, True), (False, False)])
def test_streamed_split_equals_the_whole_parse_at_every_cut(thinking, tools):
    text = REPLY if thinking else REPLY.split("</think>", 1)[1]
    expected = parse_whole(text, thinking=thinking, parse_tools=tools, id_prefix="c")
    for pieces in _split_everywhere(text):
        parser = ChatOutputParser(thinking=thinking, parse_tools=tools, id_prefix="c")
        reasoning, content = "", ""
        for piece in pieces:
            r, c = parser.feed(piece)       # a leaked piece of a marker would break the equality below
            reasoning, content = reasoning + r, content + c
        r, c, calls = parser.finish()
        got = ((reasoning + r) if thinking else None, content + c, calls)
        assert got == expected, pieces


def test_a_reply_cut_inside_its_reasoning_is_all_reasoning():
    reasoning, content, calls = parse_whole("still thinking </thi", thinking=True, parse_tools=True, id_prefix="c")
    assert (reasoning, content, calls) == ("still thinking </thi", "", None)


class _Handle:
    """Engine outputs as serve.async_engine.RequestHandle delivers them (two tokens per output)."""
    prompt_len = 7

    def __init__(self, text: str):
        self.pieces = [text[i: i + 5] for i in range(0, len(text), 5)]
        self.completion_tokens = 0

    async def stream(self):
        for i, piece in enumerate(self.pieces):
            self.completion_tokens += 2
            last = i == len(self.pieces) - 1
            yield RequestOutput("r", (1, 2), piece, (), last, "stop" if last else None)


def test_stream_writer_sends_tool_calls_with_indices_and_finish_reason_tool_calls():
    async def collect():
        ctx = SimpleNamespace(model_name=MODEL, text=None)
        parse = dict(thinking=True, parse_tools=True, id_prefix="call_1_")
        return [e async for e in _stream(ctx, _Handle(REPLY), "chatcmpl-1", 0, parse, True, False, True)]
    events = [e.decode() for e in asyncio.run(collect())]
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I should look it up."
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "now")]
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2 * len(_Handle(REPLY).pieces)
    assert not any("DSML" in d.get("content", "") for d in deltas)


def test_tools_are_rendered_into_the_prompt_within_the_budget(tiny_ckpt):
    messages = [{"role": "user", "content": "Weather in Beijing?"}]
    with running_server(tiny_ckpt, "--max-model-len", "1024") as server:
        http = server.http()
        bare = http.post("/tokenize", json={"messages": messages}).json()
        with_tools = http.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()
        assert with_tools["count"] > bare["count"]
        prompt = http.post("/detokenize", json={"tokens": with_tools["tokens"]}).json()["prompt"]
        assert "## Tools" in prompt and '"name": "get_weather"' in prompt
        ok = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": TOOLS,
                                                     "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == with_tools["count"]
        too_long = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": TOOLS,
                                                           "max_tokens": 1024 - with_tools["count"] + 1})
        assert too_long.status_code == 400 and "tool schemas" in too_long.json()["error"]["message"]
        none = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": TOOLS,
                                                       "tool_choice": "none", "max_tokens": 4, "temperature": 0})
        assert none.json()["usage"]["prompt_tokens"] == bare["count"]
