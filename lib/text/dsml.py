"""DSML, the V4 tool-call markup (encoding/encoding_dsv4.py; DSV4-REFERENCE §6).

Renders OpenAI-style tool calls into the block an assistant turn carries, parses a generated block
back (degrading to plain content when it is truncated or malformed), and filters a token stream so
that raw markup never reaches the client. Must not know the chat layout or any token ids.
"""
from __future__ import annotations

import json
import re

from lib.text.tokenizer import DSML

START = f"<{DSML}"  # every DSML tag opens with this; the model emits ｜DSML｜ as one token
BLOCK_OPEN = f"<{DSML}tool_calls>"
BLOCK_CLOSE = f"</{DSML}tool_calls>"
_INVOKE_OPEN = re.compile(rf'<{DSML}invoke name="([^"\n]*)">')
_INVOKE_CLOSE = f"</{DSML}invoke>"
_PARAM_OPEN = re.compile(rf'<{DSML}parameter name="([^"\n]*)" string="(true|false)">')
_PARAM_CLOSE = f"</{DSML}parameter>"
# The fixed pieces of a rendered call, in the order a call writes them (all but the `">` closing the invoke tag, which
# would match everywhere): a tokenizer may hold each as one token so that a call's argument values sit close to the
# request they are copied from.
MARKUP_PIECES = (BLOCK_OPEN, f'<{DSML}invoke name="', f'<{DSML}parameter name="', '" string="true">',
                 '" string="false">', _PARAM_CLOSE, _INVOKE_CLOSE, BLOCK_CLOSE)
# The official turn puts a blank line between the content and the block; parsing removes it.
_SEPARATOR = "\n\n"


class _Malformed(Exception):
    pass


def _call_parts(call: dict, index: int) -> tuple[str, dict]:
    fn = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(fn, dict):  # OpenAI {"function": {...}} or a bare {"name", "arguments"}
        raise ValueError(f"tool call {index}: expected "
                         f"{{'function': {{'name', 'arguments'}}}}, got {call!r}")
    name, args = fn.get("name"), fn.get("arguments", "{}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool call {index}: missing function name")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            args = {"arguments": args}  # the official encoder's fallback for non-JSON arguments
    if not isinstance(args, dict):
        raise ValueError(f"tool call {index} ({name}): arguments must be a JSON object, "
                         f"got {type(args).__name__}")
    return name, args


def render_tool_calls(calls: list[dict]) -> str:
    """The `<｜DSML｜tool_calls>` block (without the blank line the turn puts before it).

    Strings are written raw with string="true"; every other value as JSON with string="false".
    """
    invokes = []
    for i, call in enumerate(calls):
        name, args = _call_parts(call, i)
        params = "\n".join(
            f'<{DSML}parameter name="{key}" string="{"true" if isinstance(v, str) else "false"}">'
            f'{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}{_PARAM_CLOSE}'
            for key, v in args.items())
        invokes.append(f'<{DSML}invoke name="{name}">\n{params}\n{_INVOKE_CLOSE}')
    return f"{BLOCK_OPEN}\n" + "\n".join(invokes) + f"\n{BLOCK_CLOSE}"


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _parse_block(text: str) -> list[tuple[str, dict]]:
    """`text` starts at BLOCK_OPEN; returns (name, args) per invoke or raises _Malformed."""
    pos = _skip_ws(text, len(BLOCK_OPEN))
    calls = []
    while not text.startswith(BLOCK_CLOSE, pos):
        head = _INVOKE_OPEN.match(text, pos)
        if head is None:
            raise _Malformed(f"expected an invoke tag at {pos}")
        args: dict = {}
        pos = _skip_ws(text, head.end())
        while not text.startswith(_INVOKE_CLOSE, pos):
            param = _PARAM_OPEN.match(text, pos)
            end = text.find(_PARAM_CLOSE, param.end()) if param else -1
            if end < 0:
                raise _Malformed(f"expected a complete parameter at {pos}")
            key, is_str, raw = param.group(1), param.group(2), text[param.end():end]
            if key in args:
                raise _Malformed(f"duplicate parameter {key!r}")
            if is_str == "true":
                args[key] = raw
            else:
                try:
                    args[key] = json.loads(raw)
                except json.JSONDecodeError:
                    args[key] = raw  # keep the call; the client sees the model's literal text
            pos = _skip_ws(text, end + len(_PARAM_CLOSE))
        calls.append((head.group(1), args))
        pos = _skip_ws(text, pos + len(_INVOKE_CLOSE))
    if text[pos + len(BLOCK_CLOSE):].strip():
        raise _Malformed("text after the closing tool_calls tag")
    return calls


def _strip_separator(content: str) -> str:
    for sep in (_SEPARATOR, "\n"):
        if content.endswith(sep):
            return content[:-len(sep)]
    return content


def parse_tool_calls(text: str, *, id_prefix: str = "call_") -> tuple[str, list[dict] | None]:
    """Split generated text into (content before the block, OpenAI tool_calls).

    No block: (text, None). A truncated or malformed block: (text, None) too, so nothing the model
    wrote is lost and nothing raises. Ids are `{id_prefix}{n}`; a server passes a prefix unique
    to the request.
    """
    start = text.find(START)
    if start < 0 or not text.startswith(BLOCK_OPEN, start):
        return text, None
    try:
        parsed = _parse_block(text[start:])
    except _Malformed:
        return text, None
    calls = [{"id": f"{id_prefix}{n}", "type": "function",
              "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
             for n, (name, args) in enumerate(parsed)]
    return _strip_separator(text[:start]), calls


def _held_suffix(buf: str) -> int:
    """Length of the tail that might still grow into `\\n\\n<｜DSML｜`: a partial START plus the
    newlines before it (those belong to the separator if a block follows)."""
    hold = 0
    for k in range(min(len(buf), len(START) - 1), 0, -1):
        if START.startswith(buf[-k:]):
            hold = k
            break
    while hold < len(buf) and buf[-hold - 1] == "\n":
        hold += 1
    return hold


class DsmlStreamParser:
    """Feed text deltas; get back content that is safe to show. Once `<｜DSML｜` appears, everything
    after it is held and parsed by finish(), which returns (remaining content, tool calls or None).

    Concatenated feed() outputs + finish()[0] equal parse_tool_calls(full text)[0].
    """

    def __init__(self, *, id_prefix: str = "call_"):
        self._id_prefix = id_prefix
        self._held = ""        # not yet shown: a possible marker start, or the whole block
        self._in_block = False  # START seen; the rest of the stream is markup until finish()
        self._lead = ""        # newlines right before START, dropped if the block parses

    def feed(self, delta: str) -> str:
        if self._in_block:
            self._held += delta
            return ""
        buf = self._held + delta
        start = buf.find(START)
        if start >= 0:
            before = buf[:start]
            newlines = len(before) - len(before.rstrip("\n"))
            self._lead, self._held = before[len(before) - newlines:], buf[start:]
            self._in_block = True
            return before[:len(before) - newlines]
        hold = _held_suffix(buf)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold]

    def finish(self) -> tuple[str, list[dict] | None]:
        if not self._in_block:
            rest, self._held = self._held, ""
            return rest, None
        content, calls = parse_tool_calls(self._lead + self._held, id_prefix=self._id_prefix)
        self._held, self._lead = "", ""
        return content, calls
