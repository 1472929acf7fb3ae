"""One generation request as the engine tracks it: tokens, progress through the cache, outputs.

A request's tokens are `prompt + output`; `computed` of them are folded into its cache. What is
left (`pending`) is fed next: the rest of the prompt while prefilling (in chunks), then exactly
one token (the last sampled one, the DSpark anchor) per decode step. After a preemption
`computed` drops to 0 and the whole history is recomputed the same way, so a preempted request
produces the same tokens as one never preempted.

Must not know: HTTP, chat formats, devices.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from lib.engine.sampling import SamplingParams
from lib.engine.stops import StopChecker


class Logprob(NamedTuple):
    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...]   # (token, logprob) of the most likely alternatives


class RequestOutput(NamedTuple):
    """What one engine step produced for one request (the server streams these)."""
    request_id: str
    new_tokens: tuple[int, ...]
    new_text: str
    new_logprobs: tuple[Logprob, ...]
    finished: bool
    finish_reason: str | None            # "stop" | "length" | "abort" | "error"
    error: str | None = None
    prompt_logprobs: tuple | None = None  # on the finishing output, when prompt logprobs were asked for


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    arrival: int                          # admission order; preemption evicts the newest first
    stops: StopChecker
    detok: object | None = None           # lib.text.tokenizer.DetokenizeStream when the engine has a tokenizer
    output: list[int] = field(default_factory=list)
    computed: int = 0                     # tokens folded into the cache (the committed length)
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob | None] | None = None
    drafted: list[int] = field(default_factory=list)    # per draft position: proposals verified
    accepted: list[int] = field(default_factory=list)   # per draft position: proposals accepted
    preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def pending(self) -> int:
        """Tokens not yet in the cache."""
        return len(self.prompt) + len(self.output) - self.computed

    @property
    def decoding(self) -> bool:
        """In the decode phase: only the last sampled token is left to feed."""
        return bool(self.output) and self.pending == 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        """Tokens this request may still emit."""
        return self.params.max_tokens - len(self.output)
