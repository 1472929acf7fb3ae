"""Server-sent event responses and client-disconnect handling.

A client that goes away must cancel its request at once so the engine frees its caches. Neither
path may rely on the next write failing (a long prefill writes nothing for a while) or on garbage
collection closing a generator: both race the work against the ASGI `http.disconnect` message
and cancel the loser, wait for it to unwind (a stream's generator is only closed once the task
driving it has stopped: closing a running one raises), then run the cleanup (abort the handles and
log the request) deterministically.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Awaitable, Callable

from serve.async_engine import RequestHandle

request_log = logging.getLogger("dsv4gen.serve.requests")

SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def run_until_disconnect(receive, work: Awaitable, cleanup: Callable[[], None]):
    """The result of `work`, or None if the client disconnects first (then `work` is cancelled).
    `cleanup` runs in every case."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        return None
    finally:
        try:
            await _reap(watcher, task)
        finally:
            cleanup()


async def _reap(*tasks: asyncio.Future) -> None:
    """Cancel the tasks that still run and wait until they have stopped; their exceptions count as
    seen. Only a second cancellation of our own interrupts the wait."""
    running = {task for task in tasks if not task.done()}
    for task in running:
        task.cancel()
    if running:
        await asyncio.wait(running)
    for task in tasks:
        if not task.cancelled():
            task.exception()


class EventStream:
    """An ASGI response streaming `events` (already framed SSE bytes); disconnects cancel it."""

    def __init__(self, events: AsyncIterator[bytes], cleanup: Callable[[], None]):
        self.events, self.cleanup = events, cleanup

    async def __call__(self, scope, receive, send) -> None:
        async def pump():
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await run_until_disconnect(receive, pump(), self.cleanup)
        except OSError:                 # the socket went away during a write
            pass
        finally:
            await self.events.aclose()  # the pump task has stopped: the generator is not running


async def merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, object]]:
    """(choice index, output) from several requests as they arrive; an engine error re-raises."""
    if len(handles) == 1:
        async for out in handles[0].stream():
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def forward(index: int, handle: RequestHandle):
        try:
            async for out in handle.stream():
                await queue.put((index, out))
        except Exception as err:       # EngineDead: handed to the consumer, which re-raises it
            await queue.put((index, err))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.ensure_future(forward(i, h)) for i, h in enumerate(handles)]
    try:
        open_streams = len(tasks)
        while open_streams:
            index, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def abort_all(handles: list[RequestHandle], request_id: str | None = None, kind: str = "") -> Callable[[], None]:
    """The cleanup of a request: abort what still runs (no-op for finished handles); with
    `request_id`, also log the request's one line."""
    def cleanup() -> None:
        for handle in handles:
            handle.abort()
        if request_id is not None:
            log_request(request_id, handles, kind)
    return cleanup


def request_status(handles: list[RequestHandle]) -> str:
    """The finish reason(s) of a request ("stop", "length", "stop,length" for several prompts), or
    "error" / "aborted" / "aborted (shutdown)" when any of its engine requests ended that way."""
    statuses = [h.status or "aborted" for h in handles]
    for bad in ("aborted (shutdown)", "error", "aborted"):     # an error aborts the request's other prompts
        if bad in statuses:
            return bad
    return ",".join(dict.fromkeys(statuses)) or "aborted"


def log_request(request_id: str, handles: list[RequestHandle], kind: str = "") -> None:
    """One line per request on the server log, vLLM style (cli.py sets this logger to INFO)."""
    if not request_log.isEnabledFor(logging.INFO):
        return
    started = min((h.arrival for h in handles), default=time.monotonic())
    request_log.info("request %s%s: prompt_tokens=%d generation_tokens=%d status=%s latency=%.3fs", request_id,
                     f" ({kind})" if kind else "", sum(h.prompt_len for h in handles),
                     sum(h.completion_tokens for h in handles), request_status(handles), time.monotonic() - started)
