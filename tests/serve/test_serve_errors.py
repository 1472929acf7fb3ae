"""Malformed and hostile requests each get the right 4xx in OpenAI's error shape; a property-based fuzz
run never gets a 5xx; the server answers normally afterwards."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_util import MODEL, running_server

KEY = "sk-test-key"
MAX_LEN, MAX_BYTES = 64, 65536
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    with running_server(tiny_ckpt, "--api-key", KEY, "--max-model-len", str(MAX_LEN),
                        "--max-request-bytes", str(MAX_BYTES), "--max-num-seqs", "4") as running:
        yield running


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


def _cmpl(**fields) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 4, **fields}


# (name, path, body (dict -> JSON, or raw bytes), headers override, status, words the message must contain)
CASES = [
    ("bad JSON", "/v1/completions", b'{"prompt": "hi", ', None, 400, ["not valid JSON"]),
    ("JSON array body", "/v1/completions", b"[1, 2]", None, 400, ["object"]),
    ("empty body", "/v1/chat/completions", b"", None, 400, ["empty"]),
    ("invalid UTF-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', None, 400, ["UTF-8"]),
    ("max_tokens of the wrong type", "/v1/completions", _cmpl(max_tokens="ten"), None, 400, ["max_tokens"]),
    ("missing prompt", "/v1/completions", {"model": MODEL}, None, 400, ["prompt"]),
    ("huge max_tokens", "/v1/completions", _cmpl(max_tokens=10**6), None, 400, ["maximum context length 64"]),
    ("max_tokens 0", "/v1/completions", _cmpl(max_tokens=0), None, 400, ["max_tokens"]),
    ("negative logprobs", "/v1/completions", _cmpl(logprobs=-1), None, 400, ["logprobs"]),
    ("too many logprobs", "/v1/completions", _cmpl(logprobs=21), None, 400, ["logprobs"]),
    ("unknown model", "/v1/chat/completions", _chat(model="gpt-4o"), None, 404, ["gpt-4o", "does not exist"]),
    ("oversized body", "/v1/completions", _cmpl(prompt="x" * (MAX_BYTES + 10)), None, 413, ["limit"]),
    ("missing API key", "/v1/completions", _cmpl(), {}, 401, ["API key"]),
    ("wrong API key", "/v1/completions", _cmpl(), {"Authorization": "Bearer nope"}, 401, ["API key"]),
    ("empty prompt", "/v1/completions", _cmpl(prompt=""), None, 400, ["empty"]),
    ("empty messages", "/v1/chat/completions", _chat(messages=[]), None, 400, ["messages"]),
    ("unknown role", "/v1/chat/completions", _chat(messages=[{"role": "wizard", "content": "x"}]), None, 400,
     ["role"]),
    ("message not an object", "/v1/chat/completions", _chat(messages=["hi"]), None, 400, ["messages"]),
    ("temperature below 0", "/v1/chat/completions", _chat(temperature=-1), None, 400, ["temperature"]),
    ("infinite temperature", "/v1/completions", b'{"prompt": "hi", "temperature": 1e999}', None, 400,
     ["temperature"]),
    ("top_logprobs without logprobs", "/v1/chat/completions", _chat(top_logprobs=2), None, 400, ["logprobs"]),
    ("stream_options without stream", "/v1/chat/completions", _chat(stream_options={"include_usage": True}),
     None, 400, ["stream"]),
    ("n > 1", "/v1/completions", _cmpl(n=3), None, 400, ["n=3"]),
    ("token id outside the vocabulary", "/v1/completions", _cmpl(prompt=[5, 99999]), None, 400, ["99999"]),
    ("mixed prompt list", "/v1/completions", _cmpl(prompt=["a", 3]), None, 400, ["prompt"]),
    ("stop id outside the vocabulary", "/v1/completions", _cmpl(stop_token_ids=[-4]), None, 400,
     ["stop_token_ids"]),
    ("seed of the wrong type", "/v1/completions", _cmpl(seed="lucky"), None, 400, ["seed"]),
    ("malformed tool", "/v1/chat/completions", _chat(tools=[{"type": "function"}]), None, 400, ["tool"]),
    ("thinking not a bool", "/v1/chat/completions", _chat(chat_template_kwargs={"thinking": "yes"}), None, 400,
     ["thinking"]),
    ("deeply nested JSON", "/v1/completions", b'{"prompt": ' + b"[" * 30000 + b"]" * 30000 + b"}", None, 400,
     []),
    ("unknown route", "/v1/embeddings", _cmpl(), None, 404, ["no route"]),
    ("detokenize bad id", "/detokenize", {"tokens": [1, 10**9]}, None, 400, ["vocabulary"]),
]


@pytest.mark.parametrize("name, path, body, headers, status, words", CASES, ids=[c[0] for c in CASES])
def test_malformed_request_gets_its_4xx(server, name, path, body, headers, status, words):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, timeout=30,
                   headers={"Content-Type": "application/json", **(AUTH if headers is None else headers)})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["type"] and isinstance(error["message"], str)
    for word in words:
        assert word in error["message"], error["message"]


def test_the_client_maps_errors_to_its_exceptions(server):
    good = server.client(api_key=KEY)
    with pytest.raises(openai.NotFoundError):
        good.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        good.completions.create(model=MODEL, prompt="hi", max_tokens=1000)
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    assert httpx.get(server.url + "/health").status_code == 200           # probes need no key
    assert httpx.get(server.url + "/metrics").status_code == 200


_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-3, 70), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                   st.text(max_size=12), st.lists(st.integers(-2, 2000), max_size=4),
                   st.dictionaries(st.text(max_size=6), st.integers(), max_size=2))
_FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stop",
           "logprobs", "top_logprobs", "seed", "echo", "stream_options", "tools", "tool_choice", "stop_token_ids",
           "chat_template_kwargs", "response_format", "max_completion_tokens", "ignore_eos"]
_BODY = st.dictionaries(st.sampled_from(_FIELDS), _VALUE, max_size=6).map(
    lambda d: {**d, "max_tokens": d["max_tokens"] if isinstance(d.get("max_tokens"), int)
               and d["max_tokens"] < 8 else 4})
_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
                                            "content": _VALUE}), max_size=3)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize"]), body=_BODY,
       messages=st.one_of(st.none(), _MESSAGES))
def test_fuzzed_requests_never_get_a_5xx(server, path, body, messages):
    if messages is not None:
        body = {**body, "messages": messages}
    r = httpx.post(server.url + path, json=body, headers=AUTH, timeout=60)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["code"] == r.status_code


def test_the_server_answers_normally_after_abuse(server):
    res = server.client(api_key=KEY).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5, temperature=0)
    assert res.choices[0].finish_reason in ("stop", "length") and res.usage.completion_tokens >= 1
    assert server.blocks_used() == 0
