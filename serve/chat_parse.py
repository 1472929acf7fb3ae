"""Splitting a chat reply's text stream into reasoning, content and tool calls.

In thinking mode the prompt ends with `<think>`, so the reply is reasoning up to `</think>`, then
content (DSV4-REFERENCE §6). Content may end with a DSML tool-call block, which lib/text/dsml.py turns
into OpenAI `tool_calls`. Text that could still be the start of `</think>` or of a DSML block is
held back, so no marker ever reaches the client in pieces.
"""
from __future__ import annotations

from lib.text.dsml import DsmlStreamParser
from lib.text.tokenizer import THINK_END


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ChatOutputParser:
    def __init__(self, *, thinking: bool, parse_tools: bool, id_prefix: str):
        self.in_reasoning = thinking
        self._held = ""                 # reasoning text that may be the start of </think>
        self._tools = DsmlStreamParser(id_prefix=id_prefix) if parse_tools else None

    def feed(self, delta: str) -> tuple[str, str]:
        """-> (reasoning delta, content delta), either possibly empty."""
        reasoning = ""
        if self.in_reasoning:
            text = self._held + delta
            end = text.find(THINK_END)
            if end < 0:
                hold = _partial_suffix(text, THINK_END)
                self._held = text[len(text) - hold:] if hold else ""
                return text[:len(text) - hold], ""
            self.in_reasoning, self._held = False, ""
            reasoning, delta = text[:end], text[end + len(THINK_END):]
        return reasoning, self._content(delta)

    def _content(self, delta: str) -> str:
        return self._tools.feed(delta) if self._tools is not None else delta

    def finish(self) -> tuple[str, str, list[dict] | None]:
        """End of the reply -> (reasoning tail, content tail, tool calls or None). A reply cut off
        inside its reasoning (length limit) returns everything as reasoning."""
        reasoning, self._held = self._held, ""
        if self._tools is None:
            return reasoning, "", None
        content, calls = self._tools.finish()
        return reasoning, content, calls


def parse_whole(text: str, *, thinking: bool, parse_tools: bool, id_prefix: str) -> tuple[str | None, str, list[dict] | None]:
    """Non-streaming: (reasoning or None, content, tool calls or None) of a whole reply."""
    parser = ChatOutputParser(thinking=thinking, parse_tools=parse_tools, id_prefix=id_prefix)
    reasoning, content = parser.feed(text)
    r_tail, c_tail, calls = parser.finish()
    return (reasoning + r_tail) if thinking else None, content + c_tail, calls
