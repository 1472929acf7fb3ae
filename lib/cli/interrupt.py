"""Ctrl-C in `dsv4gen`: one line on stderr and exit status 130, never a traceback, from any subcommand.

`catching_interrupts(command)` wraps a subcommand. The first SIGINT stops this process's worker
processes (the ranks of a TP / EP launch, lib/launcher/ranks.py) and raises KeyboardInterrupt, so
the subcommand's cleanup runs as usual; whatever the interrupted code then raises (a collective
failing because its peers are gone, a cleanup error) is reported as the interruption it is:
`dsv4gen conformance: interrupted`, status 130 (128 + SIGINT, what a shell reports). A second
SIGINT while that cleanup runs exits at once.

The worker ranks are fresh interpreters (multiprocessing `spawn`) that re-run the console script
and so import lib.cli.main: `quiet_spawned_worker()` makes them ignore SIGINT, since a terminal's
Ctrl-C reaches every process of its foreground group and each rank would print its own
KeyboardInterrupt traceback. Rank 0 ends them (above), and they are daemons: they never outlive it.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

EXIT_INTERRUPTED = 128 + signal.SIGINT      # 130
WORKER_GRACE_S = 2.0                        # how long rank 0 waits for its workers to go after terminating them


def stop_workers(grace_s: float = WORKER_GRACE_S) -> None:
    """Terminate this process's multiprocessing children and wait for them a little, so rank 0's
    cleanup sees them gone instead of broadcasting to ranks that will not answer."""
    try:
        children = multiprocessing.active_children()
        for proc in children:
            proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in children:
            proc.join(max(0.0, deadline - time.monotonic()))
    except Exception:                        # never let the cleanup hide the interruption
        pass


class _Handler:
    def __init__(self):
        self.interrupted = False

    def __call__(self, signum, frame):
        if self.interrupted:                 # the second Ctrl-C: the cleanup of the first takes too long
            stop_workers(grace_s=0.0)
            os._exit(EXIT_INTERRUPTED)
        self.interrupted = True
        stop_workers()
        raise KeyboardInterrupt


_handlers: list[_Handler] = []             # the installed ones, innermost last


def interrupted(err: BaseException | None = None) -> bool:
    """Whether Ctrl-C reached the running subcommand, or a KeyboardInterrupt is `err` or in what `err`
    was raised from or while handling: an error to report as the interruption, not as itself."""
    if any(h.interrupted for h in _handlers):
        return True
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


class Outcome:
    """What `catching_interrupts` yields: `status` is set to EXIT_INTERRUPTED when it caught one."""
    status: int | None = None


@contextlib.contextmanager
def catching_interrupts(name: str, program: bool = False) -> Iterator[Outcome]:
    """Run a subcommand; on Ctrl-C print `<name>: interrupted` (`dsv4gen conformance: interrupted`) and set
    `outcome.status` to 130.
    `program`: this process is the `dsv4gen` program itself (not a caller of main()), so after an
    interruption the immediate-exit handler stays installed for the interpreter's shutdown."""
    handler, outcome = _Handler(), Outcome()
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, handler) if main_thread else None
    _handlers.append(handler)
    try:
        yield outcome
    except BaseException as err:             # SystemExit and the rest pass unless interrupted
        if not interrupted(err):
            raise
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        print(f"{name}: interrupted", file=sys.stderr, flush=True)
        outcome.status = EXIT_INTERRUPTED
    finally:
        _handlers.remove(handler)
        if main_thread and previous is not None and not (program and outcome.status is not None):
            signal.signal(signal.SIGINT, previous)


def quiet_spawned_worker() -> None:
    """In a worker process the CLI spawned, ignore SIGINT: the rank-0 process handles Ctrl-C and ends
    its workers. Such a worker runs the spawn bootstrap (its interpreter's own command line, which
    multiprocessing's sys.argv replacement leaves alone, ends in --multiprocessing-fork) and imports
    this module while it re-runs the console script as `__mp_main__`, before it unpickles its task.
    Its (disabled) weight-loading bars get a thread lock instead of tqdm's default named semaphore: a
    worker ended by rank 0 cannot unlink one, and the resource tracker would warn of it at exit."""
    if "--multiprocessing-fork" not in getattr(sys, "orig_argv", ()) or "__mp_main__" not in sys.modules:
        return
    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(ImportError):
        from tqdm import tqdm
        tqdm.set_lock(threading.RLock())
