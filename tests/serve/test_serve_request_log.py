"""One log line per request, vLLM style: id, prompt tokens, generated tokens, finish status, latency,
for completions and chat completions, streamed or not, finished or aborted; a client that goes away
logs no error."""
from __future__ import annotations

import logging
import re
import time

import httpx
import pytest

from serve_util import MODEL, running_server

LINE = re.compile(r"request (\S+) \(([a-z, ]+)\): prompt_tokens=(\d+) generation_tokens=(\d+) "
                  r"status=(.+) latency=(\d+\.\d{3})s")


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    with running_server(tiny_ckpt) as running:
        yield running


@pytest.fixture
def request_log(caplog):
    caplog.set_level(logging.INFO, logger="dsv4gen.serve.requests")

    def lines_for(request_id: str | None = None, timeout: float = 10.0) -> list[tuple]:
        """The parsed request lines (of `request_id` only, waiting for one to appear)."""
        end = time.monotonic() + timeout
        while True:
            found = [m.groups() for r in caplog.records if r.name == "dsv4gen.serve.requests"
                     for m in [LINE.fullmatch(r.getMessage())] if m]
            if request_id is not None:
                found = [f for f in found if f[0] == request_id]
            if found or time.monotonic() > end:
                return found
            time.sleep(0.05)
    lines_for.caplog = caplog
    return lines_for


def _one(lines: list[tuple]) -> tuple:
    assert len(lines) == 1, lines
    rid, kind, prompt, generated, status, latency = lines[0]
    assert float(latency) > 0
    return rid, kind, int(prompt), int(generated), status


def test_plain_chat_and_completion_log_their_usage_and_finish_reason(server, request_log):
    client = server.client()
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0)
    assert _one(request_log(chat.id)) == (chat.id, "chat", chat.usage.prompt_tokens, chat.usage.completion_tokens,
                                          chat.choices[0].finish_reason)
    cmpl = client.completions.create(model=MODEL, prompt=["one", "two three"], max_tokens=3, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert _one(request_log(cmpl.id)) == (cmpl.id, "completion", cmpl.usage.prompt_tokens,
                                          cmpl.usage.completion_tokens, "length")


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_streams_log_their_usage_and_finish_reason(server, request_log, kind):
    client = server.client()
    common = dict(model=MODEL, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True})
    if kind == "chat":
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "hello"}], **common))
    else:
        chunks = list(client.completions.create(prompt="hello there", **common))
    usage, reason = chunks[-1].usage, next(c.choices[0].finish_reason for c in chunks if c.choices and
                                           c.choices[0].finish_reason)
    assert _one(request_log(chunks[0].id)) == (chunks[0].id, f"{kind}, stream", usage.prompt_tokens,
                                               usage.completion_tokens, reason)


def test_aborted_requests_log_aborted_and_no_error(server, request_log):
    client = server.client()
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}],
                                            max_tokens=3000, temperature=0, stream=True, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    for n, _ in enumerate(stream):
        if n == 2:
            break
    stream.close()                                   # the client goes away mid-stream
    rid, kind, _, generated, status = _one(request_log(first.id))
    assert (kind, status) == ("chat, stream", "aborted") and 0 < generated < 3000

    before = {line[0] for line in request_log()}
    with pytest.raises(httpx.TimeoutException):      # a non-streaming client that gives up
        httpx.post(server.url + "/v1/completions", timeout=1.0,
                   json={"model": MODEL, "prompt": "on and on", "max_tokens": 3000, "ignore_eos": True})
    end = time.monotonic() + 10
    while time.monotonic() < end and not {line[0] for line in request_log()} - before:
        time.sleep(0.05)
    new = [line for line in request_log() if line[0] not in before]
    assert len(new) == 1 and new[0][1] == "completion" and new[0][4] == "aborted", new
    end = time.monotonic() + 10                       # the engine frees them at its next command drain
    while time.monotonic() < end and server.blocks_used():
        time.sleep(0.05)
    assert server.blocks_used() == 0
    errors = [r for r in request_log.caplog.records if r.levelno >= logging.ERROR]
    assert not errors, request_log.caplog.text       # no "Exception in ASGI application" traceback
