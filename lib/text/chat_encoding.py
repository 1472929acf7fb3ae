"""The DeepSeek-V4 chat prompt encoding (encoding/encoding_dsv4.py; DSV4-REFERENCE §6; B19).

Turns OpenAI-style messages into the flat prompt string the checkpoint was trained on: BOS, system
text (+ tools block), <｜User｜>/<｜Assistant｜> turns with no newlines between them, <think> rules,
EOS after each finished assistant turn, tool results as <tool_result> blocks inside a user turn.
Must not know token ids or the tokenizer: it returns text, which Tokenizer.encode maps to ids.
"""
from __future__ import annotations

import json
from types import MappingProxyType

from lib.text.dsml import render_tool_calls
from lib.text.tokenizer import (ASSISTANT, BOS, DSML, EOS, LATEST_REMINDER, TASK_TOKENS, THINK_END,
                           THINK_START, USER)

ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")

_EFFORT_HIGH = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n")
_EFFORT_MAX = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
    "exhaustively decompose the problem into its most fundamental components, trace every causal "
    "chain to its root, and resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles "
    "and are certain that no assumption remains unchecked and no error remains undiscovered.\n\n")
# Prepended to the first message in thinking mode only. The April preview knew one prefix and
# called it "max"; 0731 moved that text to "high" and added a stronger "max" (None == "low").
EFFORT_PROMPTS = MappingProxyType({
    "0731": MappingProxyType({"low": "", "high": _EFFORT_HIGH, "max": _EFFORT_MAX}),
    "preview": MappingProxyType({"high": "", "max": _EFFORT_HIGH}),
})

TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. \
You can invoke tools by writing a "<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. \
For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set \
`string="false"`.

If thinking_mode is enabled (triggered by {think}), you MUST output your complete reasoning inside \
{think}...{unthink} BEFORE any tool calls or final response.

Otherwise, output directly after {unthink} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
RESPONSE_FORMAT_TEMPLATE = ("## Response Format:\n\nYou MUST strictly adhere to the following "
                            "schema to reply:\n{schema}")
# Parts of one message (text parts, several tool results) are separated by a blank line.
_PART_SEP = "\n\n"


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: list[dict]) -> str:
    """The "## Tools" block: DSML instructions, then one JSON schema per line."""
    schemas = []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or "name" not in fn:
            raise ValueError(f"tool {i}: expected "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}")
        schemas.append(_json(fn))
    return TOOLS_TEMPLATE.format(dsml=DSML, think=THINK_START, unthink=THINK_END,
                                 schemas="\n".join(schemas))


# OpenAI content parts that carry an image (chat completions' image_url, the responses API's input_image)
IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})


def _text(content, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValueError(f"message {index}: content must be a string or a list of content parts, "
                         f"got {type(content).__name__}")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in IMAGE_PARTS:
            raise ValueError(f"message {index}: content part of type {kind!r}: images are not supported (the "
                             f"runtime serves the text model only, without a vision tower; send 'text' parts)")
        if kind != "text":
            raise ValueError(f"message {index}: content part of type {kind!r} is not supported "
                             f"(this model reads only 'text' parts)")
        texts.append(part.get("text") or "")
    return _PART_SEP.join(texts)


def _normalise(messages: list[dict]) -> list[dict]:
    """Validate roles and content; fold tool messages (and user text that follows them) into one
    user turn, because V4 has no tool role: results are <tool_result> blocks of a user turn."""
    out: list[dict] = []
    order: dict[str, int] = {}  # tool_call_id -> position in the latest assistant's calls
    for i, msg in enumerate(messages):
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ROLES:
            raise ValueError(f"message {i}: unknown role {role!r}; "
                             f"accepted roles: {', '.join(ROLES)}")
        m = {"role": role, "content": _text(msg.get("content"), i)}
        for key in ("tools", "response_format", "task", "tool_calls"):
            if msg.get(key):
                m[key] = msg[key]
        if role == "assistant":
            m["reasoning"] = msg.get("reasoning_content") or msg.get("reasoning") or ""
        if role == "assistant" and m.get("tool_calls"):
            order = {c["id"]: n for n, c in enumerate(m["tool_calls"])
                     if isinstance(c, dict) and c.get("id")}
        if m.get("task") is not None and m["task"] not in TASK_TOKENS:
            raise ValueError(f"message {i}: unknown task {m['task']!r}; "
                             f"accepted: {list(TASK_TOKENS)}")
        if role == "developer" and not m["content"]:
            raise ValueError(f"message {i}: a developer message needs non-empty content")
        prev = out[-1] if out and out[-1]["role"] == "user" and "parts" in out[-1] else None
        if role == "tool":
            part = ("tool", m["content"], order.get(msg.get("tool_call_id"), 0))
            if prev is not None:
                prev["parts"].append(part)
            else:
                out.append({"role": "user", "content": "", "parts": [part]})
        elif role == "user" and prev is not None and prev.get("task") is None:
            prev["parts"].append(("text", m["content"], 0))
        elif role == "user":
            out.append({**m, "parts": [("text", m["content"], 0)]})
        else:
            out.append(m)
    for m in out:  # results go back in call order, whatever order the client sent them in
        if "parts" in m:
            tools = iter(sorted((p for p in m["parts"] if p[0] == "tool"), key=lambda p: p[2]))
            m["parts"] = [next(tools) if p[0] == "tool" else p for p in m["parts"]]
    return out


def _last_user(msgs: list[dict]) -> int:
    return max((i for i, m in enumerate(msgs) if m["role"] in ("user", "developer")), default=-1)


def _drop_history(msgs: list[dict]) -> list[dict]:
    """Developer turns before the last user turn disappear. (Earlier assistants keep their place;
    their reasoning is left out by the index rule in _body.)"""
    last = _last_user(msgs)
    return [m for i, m in enumerate(msgs) if i >= last or m["role"] != "developer"]


def _body(i: int, msgs: list[dict], thinking: bool, keep_reasoning_upto: int) -> str:
    m = msgs[i]
    role, content = m["role"], m["content"]
    if role in ("system", "developer"):
        text = (USER if role == "developer" else "") + content
        if m.get("tools"):
            text += "\n\n" + render_tools(m["tools"])
        if m.get("response_format"):
            text += "\n\n" + RESPONSE_FORMAT_TEMPLATE.format(schema=_json(m["response_format"]))
        return text
    if role == "user":
        return USER + _PART_SEP.join(
            text if kind == "text" else f"<tool_result>{text}</tool_result>"
            for kind, text, _ in m["parts"])
    if role == "latest_reminder":
        return LATEST_REMINDER + content
    # assistant: a task answer (previous turn carried a task) never has a thinking part
    reasoning = ""
    if thinking and not (i > 0 and msgs[i - 1].get("task") is not None) and i > keep_reasoning_upto:
        reasoning = m["reasoning"] + THINK_END
    calls = "\n\n" + render_tool_calls(m["tool_calls"]) if m.get("tool_calls") else ""
    return reasoning + content + calls + EOS


def encode_messages(messages: list[dict], *, thinking: bool = False,
                    tools: list[dict] | None = None, reasoning_effort: str | None = None,
                    drop_thinking: bool = True, add_generation_prompt: bool = True,
                    release: str = "0731") -> str:
    """The prompt string for `messages`, as the official encoder builds it.

    thinking: the turn to generate opens with <think> (else </think>, chat mode).
    tools: OpenAI tool schemas, appended to a leading system/developer message (one is created).
    reasoning_effort: None/"low"/"high"/"max" for release "0731"; None/"high"/"max" for "preview".
    drop_thinking: earlier turns lose their reasoning; ignored whenever tools are present.
    add_generation_prompt: False leaves out the closing <｜Assistant｜><think> opener.
    """
    if release not in EFFORT_PROMPTS:
        raise ValueError(f"unknown release {release!r}; accepted: {list(EFFORT_PROMPTS)}")
    efforts = EFFORT_PROMPTS[release]
    if reasoning_effort is not None and reasoning_effort not in efforts:
        raise ValueError(f"unknown reasoning_effort {reasoning_effort!r} for release {release}; "
                         f"accepted: None, {', '.join(map(repr, efforts))}")
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of dicts, got {type(messages).__name__}")
    messages = list(messages)
    if tools:
        head = messages[0] if messages and isinstance(messages[0], dict) else {}
        if head.get("role") in ("system", "developer"):
            messages[0] = {**head, "tools": tools}
        else:  # the block then opens the prompt, as the reference server does
            messages.insert(0, {"role": "system", "content": "", "tools": tools})
    msgs = _normalise(messages)
    # Tool use keeps every turn's reasoning: the model reasons across calls within one question.
    drop = drop_thinking and not any(m.get("tools") for m in msgs)
    if thinking and drop:
        msgs = _drop_history(msgs)
    last_user = _last_user(msgs)
    keep_reasoning_upto = last_user if drop else -1  # assistants after this index keep reasoning
    prompt = [BOS]
    if thinking and msgs and reasoning_effort:
        prompt.append(efforts[reasoning_effort])
    for i, m in enumerate(msgs):
        prompt.append(_body(i, msgs, thinking, keep_reasoning_upto))
        following = msgs[i + 1]["role"] if i + 1 < len(msgs) else None
        if following not in (None, "assistant", "latest_reminder"):
            continue  # the next user/system turn follows directly
        task = m.get("task")
        opener = THINK_START if thinking and (not drop or i >= last_user) else THINK_END
        if task is not None and task != "action":
            prompt.append(TASK_TOKENS[task])
        elif task == "action":
            prompt.append(ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS[task])
        elif m["role"] in ("user", "developer") and (following or add_generation_prompt):
            prompt.append(ASSISTANT + opener)
    return "".join(prompt)
