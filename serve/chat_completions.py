"""POST /v1/chat/completions: the V4 chat encoding, thinking on/off, reasoning_content, DSML tool calls.

Thinking is switched with `chat_template_kwargs: {"thinking": true}` (vLLM's DeepSeek convention;
`enable_thinking` is accepted too). Tools are rendered into the system turn and the reply's DSML
block is returned as OpenAI `tool_calls` with finish_reason "tool_calls". Logprobs use the chat
format (`content[]` with `top_logprobs`).
"""
from __future__ import annotations

from typing import AsyncIterator

from serve import protocol
from serve.chat_parse import ChatOutputParser, parse_whole
from serve.context import ServerContext
from serve.errors import APIError, BadRequest, stream_error
from serve.streaming import EventStream, abort_all, run_until_disconnect
from serve.wire import (SSE_DONE, ChatChoice, ChatChunkChoice, ChatCompletion, ChatMessage, Delta,
                        Usage, new_id, now, sse)


def _thinking(req: protocol.ChatCompletionRequest) -> bool:
    kwargs = req.chat_template_kwargs or {}
    value = kwargs.get("thinking", kwargs.get("enable_thinking", False))
    if not isinstance(value, bool):
        raise BadRequest(f"chat_template_kwargs.thinking must be true or false, got {value!r}",
                         param="chat_template_kwargs")
    return value


def _tools(req: protocol.ChatCompletionRequest) -> list | None:
    choice = req.tool_choice
    if choice in (None, "auto"):
        return req.tools or None
    if choice == "none":
        return None
    raise BadRequest(f"tool_choice={choice!r} is not supported (accepted: 'auto', 'none')", param="tool_choice")


def _with_response_format(messages: list, fmt: dict | None) -> list:
    """A JSON response format goes into the system turn, as the V4 encoder renders it."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return messages
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema" and isinstance(fmt.get("json_schema"), dict):
        schema = fmt["json_schema"].get("schema", {"type": "object"})
    else:
        raise BadRequest(f"response_format {fmt!r} is not supported (accepted types: text, json_object, "
                         "json_schema with a json_schema object)", param="response_format")
    if messages and isinstance(messages[0], dict) and messages[0].get("role") in ("system", "developer"):
        return [{**messages[0], "response_format": schema}, *messages[1:]]
    return [{"role": "system", "content": "", "response_format": schema}, *messages]


async def create_chat_completion(ctx: ServerContext, body: bytes, receive):
    req = protocol.decode(body, protocol.ChatCompletionRequest)
    ctx.check_model(req.model)
    protocol.check_common(req)
    protocol.check_logprobs(req.top_logprobs, "top_logprobs")
    if req.top_logprobs is not None and not req.logprobs:
        raise BadRequest("top_logprobs needs logprobs=true", param="top_logprobs")
    thinking, tools = _thinking(req), _tools(req)
    messages = _with_response_format(req.messages, req.response_format)
    prompt = ctx.encode_chat(messages, thinking=thinking, tools=tools, reasoning_effort=req.reasoning_effort,
                             add_generation_prompt=req.add_generation_prompt)
    max_tokens = req.max_completion_tokens or req.max_tokens
    for field in ("max_completion_tokens", "max_tokens"):
        value = getattr(req, field)
        if value is not None and value < 1:
            raise BadRequest(f"{field}={value} is out of range (accepted: >= 1)", param=field)
    max_tokens = max_tokens or ctx.default_max_tokens(len(prompt))
    if tools and len(prompt) + max_tokens > ctx.max_model_len:
        bare = len(ctx.encode_chat(messages, thinking=thinking, reasoning_effort=req.reasoning_effort))
        raise BadRequest(f"the prompt with its tools takes {len(prompt)} tokens ({len(prompt) - bare} of them the "
                         f"tool schemas) + max_tokens {max_tokens} exceeds the maximum context length "
                         f"{ctx.max_model_len}", param="tools")
    params = protocol.sampling_params(req, max_tokens=max_tokens, defaults=ctx.defaults, keep_markup=True,
                                      logprobs=(req.top_logprobs or 0) if req.logprobs else None)
    handles = await ctx.submit_all([prompt], [params])
    handle, rid, created = handles[0], new_id("chatcmpl"), now()
    parse = dict(thinking=thinking, parse_tools=bool(tools), id_prefix=f"call_{rid[-12:]}_")
    show_reasoning = req.include_reasoning
    if req.stream:
        usage_wanted = req.stream_options is not None and req.stream_options.include_usage
        return EventStream(_stream(ctx, handle, rid, created, parse, show_reasoning, req.logprobs, usage_wanted),
                           abort_all(handles, rid, "chat, stream"))

    async def collect() -> ChatCompletion:
        text, records, reason = "", [], None
        async for out in handle.stream():
            if out.error:
                raise APIError(out.error)
            text += out.new_text
            records.extend(out.new_logprobs)
            reason = out.finish_reason
        reasoning, content, calls = parse_whole(text, **parse)
        message = ChatMessage("assistant", content, reasoning if show_reasoning else None, calls or [])
        logprobs = ctx.text.chat(records) if req.logprobs else None
        usage = Usage(len(prompt), handle.completion_tokens, len(prompt) + handle.completion_tokens)
        return ChatCompletion(rid, "chat.completion", created, ctx.model_name,
                              [ChatChoice(0, message, logprobs, "tool_calls" if calls else reason)], usage)

    return await run_until_disconnect(receive, collect(), abort_all(handles, rid, "chat"))


async def _stream(ctx: ServerContext, handle, rid: str, created: int, parse: dict, show_reasoning: bool,
                  want_logprobs: bool, usage_wanted: bool) -> AsyncIterator[bytes]:
    model = ctx.model_name

    def chunk(delta: Delta, logprobs=None, reason=None) -> bytes:
        return sse(ChatCompletion(rid, "chat.completion.chunk", created, model,
                                  [ChatChunkChoice(0, delta, logprobs, reason)]))

    parser = ChatOutputParser(**parse)
    try:
        yield chunk(Delta(role="assistant", content=""))
        async for out in handle.stream():
            if out.error:
                raise APIError(out.error)
            reasoning, content = parser.feed(out.new_text)
            tail_calls, reason = None, None
            if out.finished:
                r_tail, c_tail, tail_calls = parser.finish()
                reasoning, content = reasoning + r_tail, content + c_tail
                reason = "tool_calls" if tail_calls else out.finish_reason
            logprobs = ctx.text.chat(list(out.new_logprobs)) if want_logprobs and out.new_tokens else None
            delta = Delta(content=content or None, reasoning_content=(reasoning or None) if show_reasoning else None,
                          tool_calls=[{"index": i, **c} for i, c in enumerate(tail_calls)] if tail_calls else None)
            if delta == Delta() and logprobs is None and reason is None:
                continue                            # no empty chunks
            yield chunk(delta, logprobs, reason)
        if usage_wanted:
            total = handle.prompt_len + handle.completion_tokens
            yield sse(ChatCompletion(rid, "chat.completion.chunk", created, model, [],
                                     Usage(handle.prompt_len, handle.completion_tokens, total)))
    except Exception as err:                       # the status line is sent: report it in the stream
        yield stream_error(err)
    yield SSE_DONE
