"""Running the real server for tests: the same `serve.cli.prepare` path `python -m serve` takes (B21),
served by uvicorn on 127.0.0.1 on a free port from a background thread."""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from serve.cli import prepare, run_in_thread

MODEL = "dsv4-tiny"


class RunningServer:
    def __init__(self, prepared, server, thread):
        self.prepared, self.server, self.thread = prepared, server, thread
        self.url = prepared.url
        self.context = prepared.context

    def client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=120, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", "unused")
        return openai.AsyncOpenAI(base_url=self.url + "/v1", max_retries=0, timeout=120, **kwargs)

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """Every sample of /metrics as {(name, sorted labels without model_name): value}."""
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
        return out

    def blocks_used(self) -> int:
        return int(sum(v for (name, _), v in self.metrics().items() if name == "dsv4gen:kv_cache_blocks_used"))

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@contextlib.contextmanager
def running_server(model_dir, *flags: str) -> Iterator[RunningServer]:
    prepared = prepare(["--model", str(model_dir), "--port", "0", "--served-model-name", MODEL, *flags])
    server, thread = run_in_thread(prepared)
    running = RunningServer(prepared, server, thread)
    try:
        yield running
    finally:
        running.stop()


def wait_until(check, timeout: float = 20.0) -> bool:
    """Poll `check` every 50 ms until it holds or `timeout` seconds pass."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return True
        time.sleep(0.05)
    return False
