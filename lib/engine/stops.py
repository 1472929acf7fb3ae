"""When a request stops: stop token ids and EOS on the token side, stop strings on the streamed text side.

Streaming must never show part of a stop string, so `feed` holds back any tail of the text that could
still grow into one, and truncates at the earliest match (the stop string itself is not emitted, as
OpenAI does). This module must not know tensors, tokenizers or how text is detokenised: the engine
feeds it decoded text and asks it about token ids; the token that stopped is not fed as text.
"""
from __future__ import annotations

from typing import Iterable


class StopChecker:
    def __init__(self, stop_strings: Iterable[str] = (), stop_token_ids: Iterable[int] = (),
                 eos_ids: Iterable[int] = (), ignore_eos: bool = False):
        self.stop_strings = tuple(stop_strings)
        if not all(self.stop_strings):
            raise ValueError("stop strings must be non-empty (an empty one matches before any text)")
        # ignore_eos drops EOS only: explicit stop_token_ids are the user's own request and still stop.
        self.stop_ids = frozenset(stop_token_ids) | (frozenset() if ignore_eos else frozenset(eos_ids))
        self._held = ""        # text received but not emitted: it may be the start of a stop string
        self.stopped = False

    def check_token(self, token_id: int) -> bool:
        """True when this generated token ends the request (a stop token id, or EOS unless ignore_eos)."""
        return token_id in self.stop_ids

    def feed(self, new_text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string matched). After a stop, everything is dropped."""
        if self.stopped:
            return "", True
        text = self._held + new_text
        # Held text already covers any match that began before this feed, so one search finds the earliest.
        starts = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
        if starts:
            self._held, self.stopped = "", True
            return text[:min(starts)], True
        keep = self._partial_match_length(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """The held-back tail at the end of generation (it never became a stop string)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = max((len(s) for s in self.stop_strings), default=1) - 1
        for length in range(min(longest, len(text)), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self.stop_strings):
                return length
        return 0
