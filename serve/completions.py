"""POST /v1/completions: text completions, streamed or not, with logprobs in the parallel-list format.

Each prompt of a batch is its own engine request and its own choice (index = prompt position).
usage.completion_tokens counts emitted tokens only: drafts the verifier rejected never reach here.
"""
from __future__ import annotations

from typing import AsyncIterator

from serve import protocol
from serve.context import ServerContext
from serve.errors import APIError, BadRequest, stream_error
from serve.streaming import EventStream, abort_all, merged, run_until_disconnect
from serve.wire import (SSE_DONE, Completion, CompletionChoice, Usage, new_id, now, sse)


async def create_completion(ctx: ServerContext, body: bytes, receive):
    req = protocol.decode(body, protocol.CompletionRequest)
    ctx.check_model(req.model)
    protocol.check_common(req)
    protocol.check_logprobs(req.logprobs, "logprobs")
    protocol.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    if req.suffix:
        raise BadRequest("suffix is not supported by this model", param="suffix")
    if req.echo and req.logprobs is not None:
        raise BadRequest("echo together with logprobs is not supported", param="echo")
    if req.prompt_logprobs is not None and req.stream:
        raise BadRequest("prompt_logprobs is not available when stream=true", param="prompt_logprobs")
    if req.max_tokens is not None and req.max_tokens < 1:
        raise BadRequest(f"max_tokens={req.max_tokens} is out of range (accepted: >= 1)", param="max_tokens")
    parts = protocol.prompt_parts(req.prompt, ctx.vocab_size)
    prompts = [ctx.encode_text(p) if isinstance(p, str) else p for p in parts]
    params = [protocol.sampling_params(req, max_tokens=req.max_tokens or ctx.default_max_tokens(len(p)),
                                       logprobs=req.logprobs, prompt_logprobs=req.prompt_logprobs,
                                       defaults=ctx.defaults) for p in prompts]
    echoes = [ctx.tokenizer.decode(p, skip_special_tokens=True) if req.echo else "" for p in prompts]
    handles = await ctx.submit_all(prompts, params)
    rid, created, model = new_id("cmpl"), now(), ctx.model_name
    if req.stream:
        usage_wanted = req.stream_options is not None and req.stream_options.include_usage
        return EventStream(_stream(ctx, handles, echoes, rid, created, usage_wanted),
                           abort_all(handles, rid, "completion, stream"))

    async def collect() -> Completion:
        choices = [CompletionChoice(i, echoes[i], None, None) for i in range(len(handles))]
        records: list[list] = [[] for _ in handles]
        async for i, out in merged(handles):
            choices[i].text += out.new_text
            records[i].extend(out.new_logprobs)
            if out.finished:
                choices[i].finish_reason = out.finish_reason
                if out.prompt_logprobs is not None:
                    choices[i].prompt_logprobs = ctx.text.prompt(list(out.prompt_logprobs))
                if out.error:
                    raise APIError(out.error)
        if req.logprobs is not None:
            for i, c in enumerate(choices):
                c.logprobs = ctx.text.completion(records[i], len(echoes[i]))
        completion = sum(h.completion_tokens for h in handles)
        prompt_tokens = sum(len(p) for p in prompts)
        return Completion(rid, "text_completion", created, model, choices,
                          Usage(prompt_tokens, completion, prompt_tokens + completion))

    return await run_until_disconnect(receive, collect(), abort_all(handles, rid, "completion"))


async def _stream(ctx: ServerContext, handles, echoes, rid: str, created: int, usage_wanted: bool) -> AsyncIterator[bytes]:
    model = ctx.model_name
    offsets = [len(e) for e in echoes]
    try:
        for i, echo in enumerate(echoes):
            if echo:
                yield sse(Completion(rid, "text_completion", created, model, [CompletionChoice(i, echo, None, None)]))
        async for i, out in merged(handles):
            if out.error:
                raise APIError(out.error)
            logprobs = None
            if out.new_logprobs:
                logprobs = ctx.text.completion(list(out.new_logprobs), offsets[i])
            offsets[i] += len(out.new_text)
            if not (out.new_text or logprobs or out.finished):
                continue                            # no empty chunks (held-back text, prefill steps)
            reason = out.finish_reason if out.finished else None
            yield sse(Completion(rid, "text_completion", created, model,
                                 [CompletionChoice(i, out.new_text, logprobs, reason)]))
        if usage_wanted:
            prompt_tokens = sum(h.prompt_len for h in handles)
            completion = sum(h.completion_tokens for h in handles)
            yield sse(Completion(rid, "text_completion", created, model, [],
                                 Usage(prompt_tokens, completion, prompt_tokens + completion)))
    except Exception as err:                       # the status line is sent: report it in the stream
        yield stream_error(err)
    yield SSE_DONE

