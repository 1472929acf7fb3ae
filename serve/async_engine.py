"""The bridge between the asyncio server and the engine: one engine thread, many request handles.

The engine is not thread-safe and its `step()` blocks for a whole batched forward, so it runs on its
own thread; the event loop never touches it. Handlers send commands (add, abort) through a queue
and get each step's outputs back on their handle's asyncio.Queue (`call_soon_threadsafe`). A
request refused by the engine (too long, bad token id...) raises ValueError in the handler that
submitted it. If a step raises, the engine is dead: every handle gets the error, `/health` turns
503, new requests are refused, and nothing hangs. On shutdown (`end_all`) every open request ends
with ShuttingDown and is aborted in the engine, so its caches are free before the engine thread stops.
Must not know HTTP or the OpenAI formats.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import traceback
from typing import AsyncIterator, NamedTuple

from lib.engine.llm_engine import Engine
from lib.engine.requests import RequestOutput
from lib.engine.sampling import SamplingParams
from serve.errors import EngineDead, Overloaded, ShuttingDown

log = logging.getLogger("dsv4gen.serve")


class EngineSnapshot(NamedTuple):
    """What /metrics and /health read, published by the engine thread after each step."""
    running: int = 0
    waiting: int = 0
    blocks: tuple[tuple[str, int, int], ...] = ()   # cache group, used blocks, total blocks
    drafted: tuple[int, ...] = ()        # per draft position, engine-wide
    accepted: tuple[int, ...] = ()
    preemptions: int = 0


class RequestHandle:
    """One submitted request as its handler sees it."""

    def __init__(self, owner: "AsyncEngine", request_id: str, prompt_len: int):
        self.owner, self.request_id, self.prompt_len = owner, request_id, prompt_len
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.completion_tokens = 0
        self.arrival = time.monotonic()
        self.status: str | None = None    # finish reason, "error" or "aborted..." once it ended (the request log)

    async def stream(self) -> AsyncIterator[RequestOutput]:
        """The request's outputs until it finishes; raises EngineDead if the engine dies meanwhile."""
        while not self.finished:
            out = await self.outputs.get()
            if isinstance(out, BaseException):
                self.finished = True
                self.status = self.status or "error"
                raise out
            self.completion_tokens += len(out.new_tokens)
            self.finished = out.finished
            if out.finished:
                self.status = "error" if out.error else (out.finish_reason or "stop")
            yield out

    def abort(self) -> None:
        """Cancel (client gone, handler failed): the engine frees the caches at its next command drain.
        Idempotent; a no-op once finished."""
        if not self.finished:
            self.finished = True
            self.status = self.status or "aborted"
            self.owner._abort(self)


class AsyncEngine:
    def __init__(self, engine: Engine, *, max_queued: int, on_output=None, on_abort=None, on_step=None):
        self.engine = engine
        self.max_in_flight = engine.config.max_num_seqs + max_queued
        self.on_output, self.on_abort = on_output, on_abort   # metrics hooks, called on the loop thread
        self.on_step = on_step                                # called on the engine thread (thread-safe metrics)
        self.snapshot = EngineSnapshot()
        self.dead: str | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._handles: dict[str, RequestHandle] = {}
        self._ids = itertools.count()
        self._stopping = False
        self.closing: str | None = None                       # why new requests are refused (shutdown)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="dsv4gen-engine", daemon=True)

    # ---- loop side ---------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._publish()
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        close = getattr(self.engine, "close", None)      # worker ranks of a TP / EP engine
        if close is not None and not self._thread.is_alive():
            try:
                close()
            except Exception as err:                     # the group may already be broken: workers are killed
                log.warning("closing the worker ranks: %s", err)

    def end_all(self, reason: str = "the server is shutting down") -> int:
        """Shutdown: refuse new requests and end every open one now: its handler gets ShuttingDown
        (a stream sends it as an error event, then [DONE]) and the engine frees its caches at its
        next command drain (`stop` drains once more). Returns how many were open. Loop thread only."""
        self.closing = reason
        handles = list(self._handles.values())
        for handle in handles:
            handle.status = "aborted (shutdown)"
            handle.outputs.put_nowait(ShuttingDown(f"{reason}; the request was aborted"))
            self._abort(handle)                     # not handle.abort(): its stream must still read the error
        return len(handles)

    def fail(self, reason: str) -> None:
        """The engine cannot go on (a worker rank died): refuse and end everything now. Any thread."""
        if self.dead:
            return
        self.dead = reason
        log.error("engine failed: %s; the server is now unhealthy", reason)
        try:
            self._loop.call_soon_threadsafe(self._fail_all, EngineDead(f"the engine failed: {reason}"))
        except RuntimeError:                             # loop closed: the worker monitor outlived shutdown
            pass

    @property
    def in_flight(self) -> int:
        return len(self._handles)

    async def submit(self, prompt: list[int], params: SamplingParams) -> RequestHandle:
        if self.dead:
            raise EngineDead(f"the engine is not running: {self.dead}")
        if self.closing:
            raise ShuttingDown(self.closing)
        if self.in_flight >= self.max_in_flight:
            raise Overloaded(f"the server is at capacity ({self.in_flight} requests in flight); retry shortly",
                             headers={"Retry-After": "1"})
        handle = RequestHandle(self, f"req-{next(self._ids)}", len(prompt))
        accepted = self._loop.create_future()
        self._handles[handle.request_id] = handle
        self._command(("add", handle.request_id, (prompt, params), accepted))
        try:
            await accepted                          # ValueError from the engine's own checks
        except ValueError:
            self._handles.pop(handle.request_id, None)
            raise
        except BaseException:
            handle.abort()                          # cancelled while waiting: the add may still land
            raise
        return handle

    def _abort(self, handle: RequestHandle) -> None:
        if self._handles.pop(handle.request_id, None) is not None and self.on_abort is not None:
            self.on_abort(handle)
        self._command(("abort", handle.request_id, None, None))

    def _command(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    def _deliver(self, out: RequestOutput) -> None:
        handle = self._handles.get(out.request_id)
        if handle is None:
            return
        if out.finished:
            del self._handles[out.request_id]
        if self.on_output is not None:
            self.on_output(handle, out)
        handle.outputs.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        for handle in list(self._handles.values()):
            handle.outputs.put_nowait(error)
        self._handles.clear()

    def _settle(self, future: asyncio.Future, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    # ---- engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                for out in outputs:
                    if out.finished:
                        self.engine.release(out.request_id)
                    self._loop.call_soon_threadsafe(self._deliver, out)
                self._publish()
                if self.on_step is not None:
                    self.on_step(self.snapshot.running)
            self._drain(refuse=True)                # aborts sent just before stop() still free their caches
        except BaseException as err:                # the engine is unusable: say so everywhere
            self.dead = self.dead or self._worker_death() or f"{type(err).__name__}: {err}"
            log.error("engine step failed; the server is now unhealthy\n%s", traceback.format_exc())
            self._publish()
            self._loop.call_soon_threadsafe(self._fail_all, EngineDead(f"the engine failed: {self.dead}"))
            self._drain(refuse=True)

    def _worker_death(self) -> str | None:
        """A failed collective usually means a rank died: name it (its exit shows within a second)."""
        dead_worker = getattr(self.engine, "dead_worker", None)
        for _ in range(10 if dead_worker else 0):
            reason = dead_worker()
            if reason:
                return reason
            time.sleep(0.1)
        return None

    def _drain(self, refuse: bool = False) -> None:
        while True:
            try:
                kind, rid, payload, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "abort":
                self.engine.abort(rid)
                self.engine.release(rid)
                continue
            error = EngineDead(f"the engine is not running: {self.dead or 'stopped'}") if refuse else None
            if error is None:
                try:
                    self.engine.add_request(*payload, request_id=rid)
                except ValueError as err:
                    error = err
            try:
                self._loop.call_soon_threadsafe(self._settle, future, error)
            except RuntimeError:                    # the loop is closed: nobody waits for the answer
                pass
        self._publish()

    def _publish(self) -> None:
        engine = self.engine
        blocks = tuple((group, used, total) for group, (used, total) in engine.store.usage().items())
        self.snapshot = EngineSnapshot(len(engine.scheduler.running), len(engine.scheduler.waiting), blocks,
                                       tuple(engine.drafted), tuple(engine.accepted),
                                       engine.scheduler.preemptions)
