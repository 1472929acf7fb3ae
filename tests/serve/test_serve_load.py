"""The server under concurrency: continuous batching keeps every stream exact, cancellation frees the
cache, a full queue answers 503 + Retry-After, and a dead engine turns /health 503 without hangs."""
from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from serve_util import MODEL, running_server, wait_until

N_STREAMS = 16


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    with running_server(tiny_ckpt, "--max-num-seqs", "16") as running:
        yield running


def _prompt(i: int) -> str:
    return f"Request {i}: count the words in sentence {i * 7}."


def test_sixteen_concurrent_streams_each_equal_their_sequential_output(server):
    client = server.client()
    sequential = [client.completions.create(model=MODEL, prompt=_prompt(i), max_tokens=16, temperature=0)
                  .choices[0].text for i in range(N_STREAMS)]

    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        stream = await client.completions.create(model=MODEL, prompt=_prompt(i), max_tokens=16, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def all_at_once():
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(N_STREAMS)))

    before = server.metrics()
    concurrent = asyncio.run(all_at_once())
    assert concurrent == sequential
    assert len(set(sequential)) > 1                     # distinct prompts: cross-talk would show
    assert server.blocks_used() == 0
    after = server.metrics()
    assert after[("dsv4gen:e2e_request_latency_seconds_count", ())] - \
        before[("dsv4gen:e2e_request_latency_seconds_count", ())] == N_STREAMS
    # they really ran together: some engine steps had more than one request in the batch
    single = ("dsv4gen:iteration_requests_bucket", (("le", "1.0"),))
    steps = ("dsv4gen:iteration_requests_count", ())
    assert (after[steps] - before[steps]) - (after[single] - before[single]) > 0


def _aborted(server) -> float:
    return server.metrics().get(("dsv4gen:request_success_total", (("finished_reason", "abort"),)), 0)


def test_closing_streams_midway_frees_every_cache_block(server):
    aborted = _aborted(server)
    client = server.client()
    for i in range(6):
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": _prompt(i)}],
                                                max_tokens=2000, temperature=0, stream=True)
        for n, _ in enumerate(stream):
            if n == 2:
                break
        stream.close()
        assert wait_until(lambda: server.blocks_used() == 0), f"blocks still held after closing stream {i}"
    assert wait_until(lambda: _aborted(server) == aborted + 6)
    assert httpx.get(server.url + "/health").status_code == 200
    res = client.completions.create(model=MODEL, prompt="still alive?", max_tokens=4, temperature=0)
    assert res.usage.completion_tokens >= 1


def test_a_non_streaming_client_that_gives_up_cancels_its_request(server):
    aborted = _aborted(server)
    generated = server.metrics().get(("dsv4gen:generation_tokens_total", ()), 0)   # absent until a token is made
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", timeout=1.0,
                   json={"model": MODEL, "prompt": "go on and on", "max_tokens": 3000, "temperature": 0,
                         "ignore_eos": True})
    assert wait_until(lambda: _aborted(server) == aborted + 1)
    # the abort count and the block gauge are published by different engine steps: wait for both
    assert wait_until(lambda: server.blocks_used() == 0), f"{server.blocks_used()} blocks still held"
    time.sleep(0.5)
    # it stopped: nowhere near the 3000 tokens it asked for were generated
    assert server.metrics()[("dsv4gen:generation_tokens_total", ())] - generated < 3000


def test_a_full_queue_answers_503_with_retry_after(tiny_ckpt):
    with running_server(tiny_ckpt, "--max-num-seqs", "2", "--max-queued-requests", "1") as small:
        async def fire():
            async with httpx.AsyncClient(base_url=small.url, timeout=120) as http:
                body = {"model": MODEL, "prompt": "a long answer", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(8)))
        responses = asyncio.run(fire())
        codes = sorted(r.status_code for r in responses)
        refused = [r for r in responses if r.status_code == 503]
        assert codes.count(200) >= 3 and refused, codes
        for r in refused:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "ServiceUnavailableError" and r.json()["error"]["code"] == 503
        with pytest.raises(openai.InternalServerError):      # the client sees the 503 (no retries here)
            async def burst():
                async with small.async_client() as client:
                    await asyncio.gather(*(client.completions.create(model=MODEL, prompt="x", max_tokens=48,
                                                                     temperature=0, extra_body={"ignore_eos": True})
                                           for _ in range(8)))
            asyncio.run(burst())
        assert wait_until(lambda: small.blocks_used() == 0)


def test_a_dead_engine_makes_health_503_and_ends_requests_with_an_error(tiny_ckpt):
    with running_server(tiny_ckpt) as doomed:
        engine = doomed.context.engine.engine
        real_step, calls = engine.step, []

        def failing_step():               # a device fault on the third step
            calls.append(1)
            if len(calls) >= 3:
                raise RuntimeError("simulated device fault")
            return real_step()
        engine.step = failing_step
        with httpx.stream("POST", doomed.url + "/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 50, "stream": True}) as r:
            events = r.read().decode().split("\n\n")
        assert events[-2] == "data: [DONE]" and '"error"' in events[-3] and "simulated device fault" in events[-3]
        health = httpx.get(doomed.url + "/health", timeout=5)
        assert health.status_code == 503 and "simulated device fault" in health.json()["error"]["message"]
        with pytest.raises(openai.InternalServerError, match="engine"):
            doomed.client().completions.create(model=MODEL, prompt="hi", max_tokens=5)
        assert doomed.metrics()[("dsv4gen:engine_healthy", ())] == 0
