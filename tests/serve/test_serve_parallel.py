"""`python -m serve --tensor-parallel-size 2`: the serving tests' client interactions against two ranks,
answers identical to one process; a killed worker turns /health 503 and ends in-flight requests."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai
import pytest

from serve_util import MODEL, running_server

PROMPTS = ["What is 2+2?", "Tell me about Beijing.", "写一首诗", "Hello, world!"]


def _answers(server) -> list:
    client = server.client()
    out = []
    for prompt in PROMPTS:
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        out.append((chat.choices[0].message.content, [e.token for e in chat.choices[0].logprobs.content],
                    "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens))
    return out


@pytest.fixture(scope="module")
def single_answers(tiny_ckpt):
    with running_server(tiny_ckpt) as server:
        return _answers(server)


def test_tp2_server_answers_like_one_process(tiny_ckpt, single_answers):
    with running_server(tiny_ckpt, "--tensor-parallel-size", "2") as server:
        assert _answers(server) == single_answers

        async def together():
            async with server.async_client() as client:
                async def one(prompt):
                    stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                                             temperature=0, stream=True)
                    return "".join([c.choices[0].text async for c in stream if c.choices])
                return await asyncio.gather(*(one(p) for p in PROMPTS))
        assert asyncio.run(together()) == [a[2] for a in single_answers]      # concurrent == sequential

        stream = server.client().completions.create(model=MODEL, prompt="go on", max_tokens=500, stream=True,
                                                    temperature=0, extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()
        end = time.monotonic() + 20
        while server.blocks_used() and time.monotonic() < end:
            time.sleep(0.1)
        assert server.blocks_used() == 0                                     # cancellation freed the caches


def test_a_killed_worker_makes_health_503_and_ends_requests(tiny_ckpt):
    with running_server(tiny_ckpt, "--ep", "2") as server:
        assert httpx.get(server.url + "/health").status_code == 200
        stream = server.client().completions.create(model=MODEL, prompt="go on", max_tokens=3000, stream=True,
                                                    temperature=0, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        worker = server.context.engine.engine.workers[0]
        os.kill(worker.pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError):
            for _ in chunks:                      # the stream ends with an error event, it does not hang
                assert time.monotonic() - killed < 30
        while httpx.get(server.url + "/health").status_code == 200:
            assert time.monotonic() - killed < 5, "/health still 200 five seconds after a worker died"
            time.sleep(0.1)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "worker rank 1" in health.json()["error"]["message"]
        with pytest.raises(openai.InternalServerError):
            server.client().completions.create(model=MODEL, prompt="hi", max_tokens=4)
