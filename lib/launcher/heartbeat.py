"""Liveness across hosts: every rank but 0 bumps a counter in the job's store, and rank 0 calls a rank
dead when its counter stops moving.

Rank 0 cannot see another host's processes, and a node that loses power or its network sends no
connection reset, so a collective could wait for the group's whole timeout. The store (the
TCPStore at MASTER_ADDR:MASTER_PORT, on node 0) is reachable from every rank. Only counters travel:
how long a counter has stood still is measured on rank 0's own monotonic clock, so clock skew
between hosts does not matter, and a rank 0 that was itself stalled sees the counters moved when it
looks again instead of calling a live rank dead.

Each side opens its own store client, apart from the process group's, with a short timeout. A
follower also watches that its beats are answered: when node 0 is gone the broadcast it waits in
would otherwise last the group's whole timeout (days), so it exits instead.
"""
from __future__ import annotations

import datetime
import os
import sys
import threading
import time
from typing import Callable

PERIOD_S = 0.5          # a follower's beat
STALE_S = 2.5           # five beats missed: dead (rank 0 polls every 0.5 s, so it says so within ~3 s)
LOST_S = 10.0           # a follower whose beats go unanswered this long: node 0 is gone
STORE_TIMEOUT = datetime.timedelta(seconds=10)      # connecting, and waiting for a key


def _key(attempt: str, rank: int, what: str = "heartbeat") -> str:
    return f"dsv4gen/{attempt}/{what}/{rank}"


def _client(host: str, port: int):
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=STORE_TIMEOUT, wait_for_workers=False)


def _exit_store_lost(reason: str) -> None:
    """A follower whose store is gone: node 0 is gone, and rank 0 will send nothing more."""
    print(f"dsv4gen: {reason}; rank 0's node is gone, exiting", file=sys.stderr, flush=True)
    os._exit(1)


class Beat:
    """A follower's daemon thread bumping its counter every `period` seconds until `stop()`, and a
    second one watching that the bumps are answered. `on_lost(reason)` runs (on a daemon thread)
    when the store raises or has answered nothing for `lost_after` seconds; by default the process
    exits, since its broadcast from rank 0 would otherwise wait for the group's timeout."""

    def __init__(self, host: str, port: int, rank: int, attempt: str, period: float = PERIOD_S,
                 lost_after: float = LOST_S, on_lost: Callable[[str], None] = _exit_store_lost):
        self._store, self._key, self._left = _client(host, port), _key(attempt, rank), _key(attempt, rank, "left")
        self._where, self._period, self._lost_after, self._on_lost = f"{host}:{port}", period, lost_after, on_lost
        self._stop = threading.Event()
        self._store.add(self._key, 1)               # the first beat before returning: rank 0 sees it at once
        self._answered = time.monotonic()
        self.thread = threading.Thread(target=self._loop, name=f"dsv4gen-heartbeat-rank{rank}", daemon=True)
        self.thread.start()
        threading.Thread(target=self._watch, name=f"dsv4gen-heartbeat-watch-rank{rank}", daemon=True).start()

    def _loop(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self._store.add(self._key, 1)
            except Exception as err:                # RuntimeError / DistStoreError: reset, refused
                if not self._stop.is_set():
                    self._on_lost(f"the job's store at {self._where} stopped answering ({type(err).__name__}: {err})")
                return
            self._answered = time.monotonic()

    def _watch(self) -> None:
        """A silent host (stopped, powered off, cut off) sends no reset, and a store call then waits
        for a reply with no timeout of its own (TCPStore's timeout bounds waits for keys)."""
        while not self._stop.wait(self._period):
            if time.monotonic() - self._answered > self._lost_after:
                self._on_lost(f"the job's store at {self._where} answered no heartbeat for {self._lost_after:.0f} s")
                return

    def stop(self) -> None:
        """Stop beating and wait for the thread: one still inside a store call when the interpreter
        exits is ended mid-C++ call, which aborts the process ("terminate called")."""
        self._stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=self._lost_after)

    def leave(self) -> None:
        """Tell rank 0 this rank has left the process group (after rank 0's "stop")."""
        self.stop()
        self._store.set(self._left, "1")


class Watcher:
    """Rank 0's view of the followers' counters. `dead()` (any thread) names the first rank whose
    counter has not moved for `stale_after` seconds, or the store when it stopped answering."""

    def __init__(self, host: str, port: int, ranks: range, attempt: str, stale_after: float = STALE_S):
        self._store, self._where = _client(host, port), f"{host}:{port}"
        self._keys = {rank: _key(attempt, rank) for rank in ranks}
        self._left = [_key(attempt, rank, "left") for rank in ranks]
        self._stale_after = stale_after
        self._lock = threading.Lock()
        now = time.monotonic()
        self._seen = {rank: (None, now) for rank in ranks}     # rank -> (counter, when it last moved)

    def dead(self) -> str | None:
        with self._lock:
            now = time.monotonic()
            for rank, key in self._keys.items():
                try:
                    count = self._store.add(key, 0)            # reads without blocking on a missing key
                except Exception as err:
                    return f"the job's store at {self._where} stopped answering ({type(err).__name__}: {err})"
                last, moved = self._seen[rank]
                if count != last:
                    self._seen[rank] = (count, now)
                elif now - moved > self._stale_after:
                    return f"rank {rank} sent no heartbeat for {now - moved:.1f} s (its node or process is gone)"
            return None

    def wait_left(self, timeout: float) -> bool:
        """Wait until every follower has left the process group, so rank 0 tears its side down last,
        as it does after joining spawned workers: gloo on a rank 0 that destroys its group and exits
        while its "stop" is still on the way can abort at exit. False after `timeout` seconds, or
        at once when a rank is dead."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            try:
                if self._store.check(self._left):
                    return True
            except Exception:
                return False
            if self.dead():
                return False
            time.sleep(0.05)
        return False
