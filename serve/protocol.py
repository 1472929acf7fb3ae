"""Request bodies of the OpenAI-compatible API as msgspec structs, and their checks.

Decoding is strict about types (msgspec names the field and the JSON path of a wrong type) and
lenient about unknown fields (clients send vendor extras; they are ignored, as vLLM does). What a
type cannot say (ranges, options this server does not implement, option combinations) is checked
in `sampling_params` / `check_*`, each raising BadRequest with the field named.
Must not know the engine, HTTP or the model: it turns JSON into SamplingParams and prompt parts.
"""
from __future__ import annotations

from typing import Any, Union

import msgspec

from lib.engine.sampling import MAX_LOGPROBS, SamplingParams
from serve.errors import BadRequest


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = True            # vLLM: on by default once stream_options is given
    continuous_usage_stats: bool = False


class _Common(msgspec.Struct, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: Union[str, None] = None
    temperature: Union[float, None] = None   # None: the checkpoint's generation_config.json
    top_p: Union[float, None] = None
    top_k: Union[int, None] = None           # vLLM extra; -1 or 0 = off
    n: int = 1
    stream: bool = False
    stream_options: Union[StreamOptions, None] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Union[list[int], None] = None
    seed: Union[int, None] = None
    ignore_eos: bool = False
    presence_penalty: Union[float, None] = None
    frequency_penalty: Union[float, None] = None
    repetition_penalty: Union[float, None] = None
    logit_bias: Union[dict[str, float], None] = None
    best_of: Union[int, None] = None
    user: Union[str, None] = None


class CompletionRequest(_Common, kw_only=True):
    prompt: Union[str, list[Any]]            # str | list[str] | list[int] | list[list[int]]
    max_tokens: Union[int, None] = 16
    logprobs: Union[int, None] = None
    echo: bool = False
    suffix: Union[str, None] = None
    prompt_logprobs: Union[int, None] = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[dict[str, Any]]
    max_tokens: Union[int, None] = None          # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: Union[int, None] = None
    logprobs: bool = False
    top_logprobs: Union[int, None] = None
    tools: Union[list[dict[str, Any]], None] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Union[bool, None] = None
    response_format: Union[dict[str, Any], None] = None
    reasoning_effort: Union[str, None] = None
    chat_template_kwargs: Union[dict[str, Any], None] = None
    add_generation_prompt: bool = True
    include_reasoning: bool = True


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: Union[str, None] = None
    prompt: Union[str, None] = None
    messages: Union[list[dict[str, Any]], None] = None
    tools: Union[list[dict[str, Any]], None] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Union[dict[str, Any], None] = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: Union[str, None] = None
    tokens: list[int]


def decode(body: bytes, kind: type):
    """JSON bytes -> `kind`, or BadRequest naming the JSON path of the first wrong field."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as err:
        raise BadRequest(f"invalid request: {err}", param=_path_of(str(err))) from None
    except msgspec.DecodeError as err:
        raise BadRequest(f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise BadRequest("the request body is nested too deeply") from None


def _path_of(message: str) -> str | None:
    return message.rsplit("at `$.", 1)[1].rstrip("`") if "at `$." in message else None


def check_common(req: _Common) -> None:
    """Options this server does not implement are refused, never silently ignored."""
    if req.stream_options is not None and not req.stream:
        raise BadRequest("stream_options can only be given when stream=true", param="stream_options")
    if req.n != 1:
        raise BadRequest(f"n={req.n} is not supported: this server returns one choice per prompt (n=1)", param="n")
    if req.best_of not in (None, 1):
        raise BadRequest(f"best_of={req.best_of} is not supported (only 1)", param="best_of")
    for field in ("presence_penalty", "frequency_penalty"):
        if getattr(req, field) not in (None, 0, 0.0):
            raise BadRequest(f"{field} is not supported (only 0)", param=field)
    if req.repetition_penalty not in (None, 1, 1.0):
        raise BadRequest("repetition_penalty is not supported (only 1)", param="repetition_penalty")
    if req.logit_bias:
        raise BadRequest("logit_bias is not supported", param="logit_bias")


def sampling_params(req: _Common, *, max_tokens: int, logprobs: int | None, defaults: dict,
                    prompt_logprobs: int | None = None, keep_markup: bool = False) -> SamplingParams:
    """The engine's SamplingParams for a request; range errors name the request field."""
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    top_k = req.top_k if req.top_k is not None else 0
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature if req.temperature is not None else defaults.get("temperature", 1.0),
        top_p=req.top_p if req.top_p is not None else defaults.get("top_p", 1.0),
        top_k=top_k, seed=req.seed, stop=stop, stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs, keep_markup=keep_markup)
    try:
        return params.validate(defaults["vocab_size"])
    except ValueError as err:
        raise BadRequest(str(err), param=str(err).split("=", 1)[0]) from None


def check_logprobs(value: int | None, field: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise BadRequest(f"{field}={value} is out of range (accepted: 0..{MAX_LOGPROBS})", param=field)


def prompt_parts(prompt: str | list, vocab_size: int) -> list[str | list[int]]:
    """The prompts of a completions request: a string, token ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise BadRequest("prompt is empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(_is_id(t) for t in prompt):
        return [_ids(prompt, "prompt", vocab_size)]
    if all(isinstance(p, list) for p in prompt):
        return [_ids(p, f"prompt[{i}]", vocab_size) for i, p in enumerate(prompt)]
    raise BadRequest("prompt must be a string, a list of strings, a list of token ids or a list of "
                     "token-id lists", param="prompt")


def _is_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ids(values: list, where: str, vocab_size: int) -> list[int]:
    for j, t in enumerate(values):
        if not _is_id(t) or not 0 <= t < vocab_size:
            raise BadRequest(f"{where}[{j}] = {t!r} is not a token id in 0..{vocab_size - 1}", param="prompt")
    return list(values)
