"""Clients that go away and a server that is stopped: never a traceback, every cache block freed.

The first test runs the real `python -m serve` (the shipped trained tiny checkpoint) as a subprocess with its
output captured to a file: five streams disconnected midway, then SIGINT while a sixth is open. The
second stops an in-process server with a stream and a plain request open and reads the engine's
paged cache itself. Every wait is bounded; loopback only.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from serve.streaming import EventStream
from serve_util import MODEL, running_server, wait_until

ROOT = Path(__file__).resolve().parents[2]
LONG = 3000                      # max_tokens with ignore_eos: every request is still running when cut


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _blocks_used(url: str) -> int:
    return int(sum(v for (name, _), v in _metrics(url).items() if name == "dsv4gen:kv_cache_blocks_used"))


def _aborted(url: str) -> float:
    return _metrics(url).get(("dsv4gen:request_success_total", (("finished_reason", "abort"),)), 0)


def _request(i: int) -> tuple[str, dict]:
    """Alternately a chat and a text completion, streamed, long enough to be running when cut."""
    common = {"max_tokens": LONG, "temperature": 0, "stream": True, "ignore_eos": True}
    if i % 2:
        return "/v1/completions", {"prompt": f"Story {i}: once upon a time", **common}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Tell story {i}."}], **common}


def _data_lines(lines, limit: int) -> list[str]:
    """The next `data:` lines of an SSE line iterator, at most `limit` of them."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            out.append(line)
            if len(out) >= limit:
                break
    return out


def _assert_error_then_done(lines: list[str]) -> None:
    assert lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2][len("data: "):])["error"]      # OpenAI's error shape
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503, error
    assert "shutting down" in error["message"] and error["param"] is None


def test_a_disconnect_mid_stream_closes_the_generator_after_its_task_stopped():
    """The client goes away while the stream's generator waits for the engine: the generator must be
    closed only once the task driving it has stopped (else aclose() raises: 'already running')."""
    closed, cleaned, sent = [], [], []

    async def events():
        try:
            yield b"data: 1\n\n"
            await asyncio.Event().wait()             # the next token never comes
            yield b"data: 2\n\n"
        finally:
            closed.append(True)

    async def scenario():
        gone = asyncio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if message.get("body"):
                gone.set()                           # the client leaves after the first event
        await asyncio.wait_for(EventStream(events(), lambda: cleaned.append(True))({}, receive, send), 5)
    asyncio.run(scenario())
    assert closed == [True] and cleaned == [True]
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]


def test_disconnects_and_sigint_leave_no_traceback_and_free_every_block(tmp_path):
    log_path = tmp_path / "server.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "serve", "--port", "0"], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        def listening() -> bool:
            assert proc.poll() is None, f"the server exited {proc.returncode}:\n{log_path.read_text()[-3000:]}"
            return "listening on " in log_path.read_text()
        assert wait_until(listening, timeout=240), log_path.read_text()[-3000:]
        url = log_path.read_text().split("listening on ", 1)[1].split()[0]
        assert url.startswith("http://127.0.0.1:")

        with httpx.Client(base_url=url, timeout=20) as client:
            aborted = _aborted(url)
            for i in range(5):                  # each disconnects after its third event
                path, body = _request(i)
                with client.stream("POST", path, json=body) as r:
                    assert r.status_code == 200
                    assert len(_data_lines(r.iter_lines(), 3)) == 3
                assert wait_until(lambda: _aborted(url) == aborted + i + 1), f"stream {i} was not aborted"
                assert wait_until(lambda: _blocks_used(url) == 0), f"blocks still held after stream {i}"
            assert "Traceback" not in log_path.read_text()

            path, body = _request(0)
            with client.stream("POST", path, json=body) as r:
                events = r.iter_lines()
                lines = _data_lines(events, 3)
                assert _blocks_used(url) > 0                 # it is running, holding its caches
                stopped_at = time.monotonic()
                proc.send_signal(signal.SIGINT)
                time.sleep(0.05)
                proc.send_signal(signal.SIGINT)              # an impatient second Ctrl-C changes nothing
                lines += _data_lines(events, LONG + 10)      # ends by itself, well before the read timeout
            ended_after = time.monotonic() - stopped_at
        _assert_error_then_done(lines)
        assert ended_after < 4, f"the open stream took {ended_after:.1f} s to end (uvicorn's timeout is 5 s)"
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    out = log_path.read_text()
    assert "Traceback" not in out and "ERROR" not in out, out[-3000:]
    assert "(made on first use)" not in out
    assert out.count("status=aborted latency=") == 5 and out.count("status=aborted (shutdown)") == 1, out
    assert "shutting down: 1 open request(s) ended" in out
    assert "server stopped; cache blocks in use: 0 of " in out, out[-2000:]


def test_stopping_ends_open_requests_at_once_and_frees_their_caches(tiny_ckpt, caplog):
    with running_server(tiny_ckpt) as server:
        engine = server.context.engine
        plain: dict = {}

        def plain_request():                  # a non-streaming request still generating at shutdown
            plain["response"] = httpx.post(server.url + "/v1/completions", timeout=20, json={
                "model": MODEL, "prompt": "go on", "max_tokens": LONG, "ignore_eos": True})
        waiter = threading.Thread(target=plain_request)
        waiter.start()
        with httpx.Client(base_url=server.url, timeout=20) as client:
            path, body = _request(0)
            with client.stream("POST", path, json={**body, "model": MODEL}) as r:
                events = r.iter_lines()
                lines = _data_lines(events, 3)
                assert wait_until(lambda: engine.snapshot.running == 2)
                stopper = threading.Thread(target=server.stop)
                started = time.monotonic()
                stopper.start()
                lines += _data_lines(events, LONG + 10)
        waiter.join(timeout=20)
        stopper.join(timeout=20)
        took = time.monotonic() - started
        assert not server.thread.is_alive() and not waiter.is_alive()
    _assert_error_then_done(lines)
    response = plain["response"]
    assert response.status_code == 503, response.text
    assert "shutting down" in response.json()["error"]["message"]
    assert took < 4, f"shutdown took {took:.1f} s: it waited for the open requests"
    usage = engine.engine.store.usage()           # the engine thread has stopped: read the cache itself
    assert usage and all(used == 0 for used, _ in usage.values()), usage
    assert not engine.engine.has_unfinished()
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text
