"""lib/text/chat_encoding.py and lib/text/dsml.py: golden V4 prompts (B19) and DSML render/parse/stream.

Goldens come from the official fixtures shipped with the checkpoint (encoding/tests/test_input_N.json
-> test_output_N.txt, read from vllm-project/vllm tests/tokenizers_/fixtures/deepseek_v4/) and from
the reference encoder's rules (encoding/encoding_dsv4.py). Literal strings, not the module's constants.
"""
import itertools
import json
import random

import pytest

from lib.text.chat_encoding import encode_messages
from lib.text.dsml import DsmlStreamParser, parse_tool_calls, render_tool_calls
from lib.text.tokenizer import Tokenizer, build_tiny_tokenizer

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"
SYS = "You are a helpful assistant."

WEATHER_TOOLS = [  # encoding/tests/test_input_1.json
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the weather for a specific location",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string", "description": "The city name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"],
                     "description": "Temperature unit"}},
            "required": ["location"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web for information",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "Search query"},
            "num_results": {"type": "integer", "description": "Number of results to return"}},
            "required": ["query"]}}},
]
TOOLS_HEAD = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke "
    'tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n<｜DSML｜tool_calls>\n'
    '<｜DSML｜invoke name="$TOOL_NAME">\n<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">'
    "$PARAMETER_VALUE</｜DSML｜parameter>\n...\n</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n...\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\n'
    'String parameters should be specified as is and set `string="true"`. For all other types '
    '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning "
    "inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n")
TOOLS_TAIL = ("\n\nYou MUST strictly follow the above defined tool name and parameter schemas to "
              "invoke tool calls.\n")
WEATHER_SCHEMAS = (
    '{"name": "get_weather", "description": "Get the weather for a specific location", "parameters": '
    '{"type": "object", "properties": {"location": {"type": "string", "description": "The city name"}, '
    '"unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit"}}, '
    '"required": ["location"]}}\n'
    '{"name": "search", "description": "Search the web for information", "parameters": {"type": '
    '"object", "properties": {"query": {"type": "string", "description": "Search query"}, "num_results": '
    '{"type": "integer", "description": "Number of results to return"}}, "required": ["query"]}}')
WEATHER_CALL = {"id": "call_001", "type": "function", "function": {
    "name": "get_weather", "arguments": '{"location": "Beijing", "unit": "celsius"}'}}
WEATHER_BLOCK = ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
                 '<｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>\n'
                 '<｜DSML｜parameter name="unit" string="true">celsius</｜DSML｜parameter>\n'
                 '</｜DSML｜invoke>\n</｜DSML｜tool_calls>')
EFFORT_HIGH = (  # reasoning-effort texts of encoding_dsv4.py (0731)
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough in your "
    "thinking and comprehensively decompose the problem to resolve the root cause, rigorously "
    "stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n")
EFFORT_MAX = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\nYou MUST reason with "
    "the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose the problem "
    "into its most fundamental components, trace every causal chain to its root, and resolve the "
    "underlying cause rather than any surface symptom.\nDo not stop reasoning until you have independently "
    "verified the solution from multiple angles and are certain that no assumption remains unchecked and "
    "no error remains undiscovered.\n\n")
# encoding/tests/test_input_2.json: two turns, each with reasoning
TWO_TURNS = [
    {"role": "system", "content": SYS},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "reasoning_content": "The user said hello, I should greet back.",
     "content": "Hi there! How can I help you?"},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "reasoning_content": "The user asks about the capital of France. It is Paris.",
     "content": "The capital of France is Paris."},
]
SINGLE = [{"role": "system", "content": SYS}, {"role": "user", "content": "What is 2+2?"}]


def test_single_turn_chat_mode():
    assert encode_messages(SINGLE) == f"{BOS}{SYS}{U}What is 2+2?{A}</think>"


def test_single_turn_thinking_mode():  # DSV4-REFERENCE §6 example
    assert encode_messages(SINGLE, thinking=True) == f"{BOS}{SYS}{U}What is 2+2?{A}<think>"


def test_no_generation_prompt():
    assert encode_messages(SINGLE, add_generation_prompt=False) == f"{BOS}{SYS}{U}What is 2+2?"


def test_multi_turn_drops_earlier_reasoning():  # encoding/tests/test_output_2.txt
    assert encode_messages(TWO_TURNS, thinking=True) == (
        f"{BOS}{SYS}{U}Hello{A}</think>Hi there! How can I help you?{EOS}"
        f"{U}What is the capital of France?{A}<think>The user asks about the capital of France. "
        f"It is Paris.</think>The capital of France is Paris.{EOS}")
    assert encode_messages(TWO_TURNS[:-1], thinking=True).endswith(
        f"{EOS}{U}What is the capital of France?{A}<think>")


def test_multi_turn_keeps_reasoning_without_drop():
    assert encode_messages(TWO_TURNS, thinking=True, drop_thinking=False) == (
        f"{BOS}{SYS}{U}Hello{A}<think>The user said hello, I should greet back.</think>"
        f"Hi there! How can I help you?{EOS}{U}What is the capital of France?{A}<think>The user asks "
        f"about the capital of France. It is Paris.</think>The capital of France is Paris.{EOS}")


def test_thinking_drop_removes_earlier_developer_turns():
    messages = [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"},
                {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q"}]
    assert encode_messages(messages, thinking=True) == f"{BOS}SA1{EOS}{U}Q{A}<think>"
    assert encode_messages(messages) == f"{BOS}S{U}D{A}</think>A1{EOS}{U}Q{A}</think>"


def test_chat_mode_ignores_reasoning():
    assert encode_messages(TWO_TURNS) == (
        f"{BOS}{SYS}{U}Hello{A}</think>Hi there! How can I help you?{EOS}"
        f"{U}What is the capital of France?{A}</think>The capital of France is Paris.{EOS}")


def test_tool_call_round_matches_official_fixture_1():  # encoding/tests/test_output_1.txt
    messages = [
        {"role": "system", "content": SYS},
        {"role": "user", "content": "What's the weather in Beijing?"},
        {"role": "assistant", "reasoning_content": "The user wants to know the weather in Beijing. "
         "I should use the get_weather tool.", "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "tool_call_id": "call_001",
         "content": '{"temperature": 22, "condition": "sunny", "humidity": 45}'},
        {"role": "assistant", "reasoning_content": "Got the weather data. Let me format a nice response.",
         "content": "The weather in Beijing is currently sunny with a temperature of 22°C and 45% humidity."},
    ]
    assert encode_messages(messages, thinking=True, tools=WEATHER_TOOLS) == (
        f"{BOS}{SYS}\n\n{TOOLS_HEAD}{WEATHER_SCHEMAS}{TOOLS_TAIL}{U}What's the weather in Beijing?{A}"
        "<think>The user wants to know the weather in Beijing. I should use the get_weather tool.</think>"
        f"\n\n{WEATHER_BLOCK}{EOS}{U}"
        '<tool_result>{"temperature": 22, "condition": "sunny", "humidity": 45}</tool_result>'
        f"{A}<think>Got the weather data. Let me format a nice response.</think>The weather in Beijing "
        f"is currently sunny with a temperature of 22°C and 45% humidity.{EOS}")


def test_tools_without_system_message_open_the_prompt():
    tool = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    assert encode_messages([{"role": "user", "content": "time?"}], tools=tool) == (
        f'{BOS}\n\n{TOOLS_HEAD}{{"name": "now", "parameters": {{"type": "object"}}}}{TOOLS_TAIL}'
        f"{U}time?{A}</think>")


def test_parallel_results_are_sorted_by_call_order_and_merge_with_user_text():
    calls = [{"id": i, "type": "function", "function": {"name": "now", "arguments": "{}"}} for i in "ab"]
    messages = [{"role": "user", "content": "U"}, {"role": "assistant", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "b", "content": "R2"},
                {"role": "tool", "tool_call_id": "a", "content": "R1"},
                {"role": "user", "content": "U2"}]
    block = '<｜DSML｜tool_calls>\n' + "\n".join(['<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>'] * 2) + \
        "\n</｜DSML｜tool_calls>"
    assert encode_messages(messages) == (
        f"{BOS}{U}U{A}</think>\n\n{block}{EOS}"
        f"{U}<tool_result>R1</tool_result>\n\n<tool_result>R2</tool_result>\n\nU2{A}</think>")


def test_developer_reminder_and_tools_on_a_message():  # test_output_3.txt, tools cut to `search`
    search = {"type": "function", "function": {"name": "search", "description": "Web search."}}
    messages = [
        {"role": "system", "content": "该助手为DeepSeek，由深度求索公司创造。"},
        {"role": "latest_reminder", "content": "2026-02-21,星期六,广州,App,中文"},
        {"role": "developer", "content": "小柴胡冲剂和布洛芬能一起吃吗？", "tools": [search]},
        {"role": "assistant", "content": "", "reasoning_content": "想一想。", "tool_calls": [
            {"type": "function", "function": {"name": "search", "arguments": '{"queries": "布洛芬"}'}}]},
        {"role": "tool", "content": "[0]"},
        {"role": "assistant", "content": "请及时就医。", "reasoning_content": "现在开始组织回答。", "tool_calls": []},
    ]
    assert encode_messages(messages, thinking=True) == (
        f"{BOS}该助手为DeepSeek，由深度求索公司创造。<｜latest_reminder｜>2026-02-21,星期六,广州,App,中文"
        f'{U}小柴胡冲剂和布洛芬能一起吃吗？\n\n{TOOLS_HEAD}{{"name": "search", "description": "Web search."}}'
        f"{TOOLS_TAIL}{A}<think>想一想。</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"search\">\n"
        '<｜DSML｜parameter name="queries" string="true">布洛芬</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        f"</｜DSML｜tool_calls>{EOS}{U}<tool_result>[0]</tool_result>{A}<think>现在开始组织回答。</think>"
        f"请及时就医。{EOS}")


def test_action_task():  # test_output_4.txt (the long first answer shortened to "X")
    messages = [{"role": "system", "content": "S"}, {"role": "latest_reminder", "content": "R"},
                {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "X"},
                {"role": "user", "content": "世界著名温泉有哪些", "task": "action"},
                {"role": "assistant", "content": "Search"}]
    assert encode_messages(messages) == (
        f"{BOS}S<｜latest_reminder｜>R{U}Q1{A}</think>X{EOS}{U}世界著名温泉有哪些{A}</think><｜action｜>Search{EOS}")


def test_other_tasks_append_their_token_and_keep_the_next_user_turn_apart():
    assert encode_messages([{"role": "user", "content": "Q", "task": "title"}]) == f"{BOS}{U}Q<｜title｜>"
    assert encode_messages([{"role": "user", "content": "Q", "task": "query"},
                            {"role": "user", "content": "Q2"}]) == f"{BOS}{U}Q{U}Q2{A}</think>"
    with pytest.raises(ValueError, match="message 0: unknown task 'nope'"):
        encode_messages([{"role": "user", "content": "Q", "task": "nope"}])


@pytest.mark.parametrize("effort,prefix",
                         [(None, ""), ("low", ""), ("high", EFFORT_HIGH), ("max", EFFORT_MAX)])
def test_reasoning_effort_0731(effort, prefix):
    body = encode_messages(TWO_TURNS, thinking=True)[len(BOS):]
    assert encode_messages(TWO_TURNS, thinking=True, reasoning_effort=effort) == BOS + prefix + body
    assert encode_messages(SINGLE, reasoning_effort=effort) == encode_messages(SINGLE)  # chat: none


def test_reasoning_effort_preview_and_errors():
    assert encode_messages(SINGLE, thinking=True, reasoning_effort="max", release="preview") == \
        f"{BOS}{EFFORT_HIGH}{SYS}{U}What is 2+2?{A}<think>"
    with pytest.raises(ValueError, match="'medium'.*accepted: None, 'low', 'high', 'max'"):
        encode_messages(SINGLE, thinking=True, reasoning_effort="medium")


def test_content_parts_are_joined_and_others_refused():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert encode_messages([{"role": "user", "content": parts}]) == f"{BOS}{U}a\n\nb{A}</think>"
    bad = [{"role": "system", "content": "s"},
           {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match="message 1: content part of type 'image_url'"):
        encode_messages(bad)


def test_unknown_role_names_index_and_accepted_roles():
    with pytest.raises(ValueError, match=r"message 1: unknown role 'function'; accepted roles: system, "
                                         r"developer, user, assistant, tool"):
        encode_messages([{"role": "user", "content": "a"}, {"role": "function", "content": "b"}])


def test_prompt_tokenizes_with_single_special_ids():
    tok = Tokenizer(build_tiny_tokenizer(512))
    ids = tok.encode(encode_messages(TWO_TURNS, thinking=True, tools=WEATHER_TOOLS))
    assert ids[0] == 0 and ids.count(0) == 1 and ids.count(1) == 2  # BOS once, EOS per answer
    assert ids.count(tok.token_to_id("<think>")) == 2 + 2  # tools text mentions <think> twice


# ---- DSML -------------------------------------------------------------------------------------
CALLS = [
    {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(
        {"location": "a<b & c\nline2", "days": 3, "opts": {"a": [1, 2], "b": True}, "x": None})}},
    {"id": "call_1", "type": "function", "function": {"name": "now", "arguments": "{}"}},
    {"id": "call_2", "type": "function", "function": {"name": "say", "arguments": '{"text": "你好 🙂"}'}},
]
SAMPLE = "Let me check. a<b\n\n" + render_tool_calls(CALLS)


def _args(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_render_non_string_values_as_json():
    assert render_tool_calls(CALLS[:2]) == (
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">a<b & c\nline2</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="opts" string="false">{"a": [1, 2], "b": true}</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="x" string="false">null</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        '<｜DSML｜invoke name="now">\n\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>')


def test_render_odd_arguments():
    raw = render_tool_calls([{"function": {"name": "f", "arguments": "not json"}}])
    assert '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>' in raw
    with pytest.raises(ValueError, match="tool call 0 \\(f\\): arguments must be a JSON object"):
        render_tool_calls([{"function": {"name": "f", "arguments": "[1]"}}])


def test_parse_round_trip():
    content, calls = parse_tool_calls(SAMPLE)
    assert content == "Let me check. a<b"
    assert _args(calls) == _args(CALLS) and [c["id"] for c in calls] == ["call_0", "call_1", "call_2"]
    assert parse_tool_calls(f"\n\n{WEATHER_BLOCK}")[1][0]["function"] == {
        "name": "get_weather", "arguments": '{"location": "Beijing", "unit": "celsius"}'}


def test_parse_without_block_or_with_broken_block_returns_text():
    assert parse_tool_calls("plain <b>text</b>") == ("plain <b>text</b>", None)
    start = SAMPLE.index("<｜DSML｜")
    for cut in range(start, len(SAMPLE)):  # every truncation of the block
        assert parse_tool_calls(SAMPLE[:cut]) == (SAMPLE[:cut], None)
    for broken in (SAMPLE.replace('name="now"', "nam=now"), SAMPLE + " trailing",
                   SAMPLE.replace('name="days"', 'name="location"'),
                   SAMPLE.replace("<｜DSML｜tool_calls>", "<｜DSML｜invoke>", 1)):
        assert parse_tool_calls(broken) == (broken, None)


def _stream(deltas):
    parser = DsmlStreamParser()
    shown = [parser.feed(d) for d in deltas]
    rest, calls = parser.finish()
    return shown, rest, calls


def test_stream_never_shows_markup_at_any_split():
    expected_content, expected_calls = parse_tool_calls(SAMPLE)
    rng = random.Random(0)
    splits = [[i] for i in range(len(SAMPLE) + 1)] + [sorted(rng.sample(range(len(SAMPLE)), 6))
                                                      for _ in range(200)]
    splits.append(list(range(len(SAMPLE))))  # one character per delta
    for cuts in splits:
        bounds = [0, *cuts, len(SAMPLE)]
        shown, rest, calls = _stream([SAMPLE[a:b] for a, b in itertools.pairwise(bounds)])
        assert "".join(shown) + rest == expected_content, cuts
        assert not any("｜" in s or s.endswith("\n") for s in shown), cuts
        assert calls == expected_calls, cuts


@pytest.mark.parametrize("text", ["no tools here\n\n", "a < b and <｜ not dsml",
                                  "x\n\n<｜DSML｜invoke broken"])
def test_stream_without_valid_block_matches_parse(text):
    for cut in range(len(text) + 1):
        shown, rest, calls = _stream([text[:cut], text[cut:]])
        assert ("".join(shown) + rest, calls) == parse_tool_calls(text) == (text, None)
