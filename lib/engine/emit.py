"""Turning accepted tokens into request output: logprobs, text, stop conditions, finish reasons.

Every emitted token counts toward `max_tokens` and usage; drafts that were not accepted never
reach here. A stop token ends the request (it is kept in the token ids, as its text is not
emitted); a stop string ends it with the text cut before the match.
"""
from __future__ import annotations

import torch

from lib.engine.requests import Logprob, Request, RequestOutput
from lib.engine.sampling import token_logprobs


def row_logprobs(rows: torch.Tensor, tokens: torch.Tensor, top: int | None, scorer=token_logprobs) -> list[Logprob]:
    """Logprob records of `tokens` [R] under logits `rows` [R, V] (gathers and top-k only: B20).
    `scorer` is the engine's (conformance passes a field bug through it)."""
    lp = scorer(rows.float(), tokens, top or 0)
    values, ranks = lp.logprob.tolist(), lp.rank.tolist()
    top_ids, top_lps = lp.top_ids.tolist(), lp.top_logprobs.tolist()
    return [Logprob(int(t), values[i], ranks[i], tuple(zip(top_ids[i], top_lps[i])))
            for i, t in enumerate(tokens.tolist())]


def emit(req: Request, tokens: list[int], rows: torch.Tensor, scorer=token_logprobs) -> RequestOutput:
    """Append `tokens` (scored by logits `rows` [len(tokens), V]) until a stop or the length limit."""
    tokens = tokens[: max(req.remaining, 0)]
    records = row_logprobs(rows[: len(tokens)], torch.tensor(tokens), req.params.logprobs, scorer) \
        if req.params.logprobs is not None and tokens else []
    new_tokens, new_logprobs, text = [], [], ""
    for i, token in enumerate(tokens):
        req.output.append(token)
        new_tokens.append(token)
        if records:
            req.logprobs.append(records[i])
            new_logprobs.append(records[i])
        if req.stops.check_token(token):
            return _done(req, new_tokens, new_logprobs, text, "stop")
        if req.detok is not None:
            piece, stopped = req.stops.feed(req.detok.feed(token))
            text += piece
            if stopped:
                return _done(req, new_tokens, new_logprobs, text, "stop", flush=False)
        if req.remaining <= 0:
            return _done(req, new_tokens, new_logprobs, text, "length")
    req.text += text
    return RequestOutput(req.id, tuple(new_tokens), text, tuple(new_logprobs), False, None)


def _done(req: Request, tokens, logprobs, text: str, reason: str, flush: bool = True) -> RequestOutput:
    if flush and req.detok is not None:
        tail, _ = req.stops.feed(req.detok.flush())
        text += tail + req.stops.flush()
    req.text += text
    req.finish_reason = reason
    prompt_logprobs = None if req.prompt_logprobs is None else tuple(req.prompt_logprobs)
    return RequestOutput(req.id, tuple(tokens), text, tuple(logprobs), True, reason, None, prompt_logprobs)


def finish(req: Request, reason: str) -> RequestOutput:
    """End a request that emits nothing more (refused, aborted)."""
    req.finish_reason = reason
    return RequestOutput(req.id, (), "", (), True, reason, req.error)
