"""Response bodies and stream chunks, field for field as OpenAI clients read them (research/serving.md §3-4).

Fields a client expects to see as `null` (finish_reason, logprobs) are always written; optional
extras (usage on chunks, reasoning_content in a delta) are left out when unset (omit_defaults).
Logprob records from the engine become either format here: completions' parallel lists or chat's
`content[]` entries. JSON cannot carry -inf: such logprobs are written as -9999.0, like vLLM.
"""
from __future__ import annotations

import math
import time
import uuid
from typing import Any, Union

import msgspec

from lib.engine.requests import Logprob

NEG_INF_LOGPROB = -9999.0


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[Union[float, None]]
    top_logprobs: list[Union[dict[str, float], None]]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: Union[CompletionLogprobs, None]
    finish_reason: Union[str, None]
    stop_reason: Union[str, int, None] = None
    prompt_logprobs: Union[list[Any], None] = None


class Completion(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Union[Usage, None] = None


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: Union[list[int], None]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: Union[list[int], None]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class ChatMessage(msgspec.Struct):
    role: str
    content: Union[str, None]
    reasoning_content: Union[str, None] = None
    tool_calls: list[dict] = []


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    logprobs: Union[ChatLogprobs, None]
    finish_reason: Union[str, None]


class Delta(msgspec.Struct, omit_defaults=True):
    role: Union[str, None] = None
    content: Union[str, None] = None
    reasoning_content: Union[str, None] = None
    tool_calls: Union[list[dict], None] = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    logprobs: Union[ChatLogprobs, None]
    finish_reason: Union[str, None]


class ChatCompletion(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[Union[ChatChoice, ChatChunkChoice]]
    usage: Union[Usage, None] = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def _finite(value: float) -> float:
    return value if math.isfinite(value) else NEG_INF_LOGPROB


class TokenText:
    """Token id -> display string and UTF-8 bytes, for logprob records."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def text(self, token: int) -> str:
        return self.tokenizer.token_bytes(token).decode("utf-8", errors="replace")

    def bytes(self, token: int) -> list[int]:
        return list(self.tokenizer.token_bytes(token))

    def completion(self, records: list[Logprob], start_offset: int) -> CompletionLogprobs:
        """Parallel lists; each top dict has the alternatives plus the chosen token."""
        out = CompletionLogprobs([], [], [], [])
        offset = start_offset
        for r in records:
            token = self.text(r.token)
            top = {self.text(t): _finite(lp) for t, lp in r.top}
            top.setdefault(token, _finite(r.logprob))
            out.tokens.append(token)
            out.token_logprobs.append(_finite(r.logprob))
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(token)
        return out

    def chat(self, records: list[Logprob]) -> ChatLogprobs:
        return ChatLogprobs([
            ChatTokenLogprob(self.text(r.token), _finite(r.logprob), self.bytes(r.token),
                             [TopLogprob(self.text(t), _finite(lp), self.bytes(t)) for t, lp in r.top])
            for r in records])

    def prompt(self, records: list) -> list:
        """vLLM's prompt_logprobs: None for the first token, then {id: {logprob, rank, decoded_token}}."""
        out = []
        for r in records:
            if r is None:
                out.append(None)
                continue
            entry = {str(r.token): {"logprob": _finite(r.logprob), "rank": r.rank, "decoded_token": self.text(r.token)}}
            for rank, (t, lp) in enumerate(r.top, start=1):
                entry.setdefault(str(t), {"logprob": _finite(lp), "rank": rank, "decoded_token": self.text(t)})
            out.append(entry)
        return out


def sse(payload) -> bytes:
    """One server-sent event: `data: <compact JSON>` and a blank line."""
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
