"""`dsv4gen bench`'s scaling series: how the `cpu` backend's prefill cost grows with context.

The series prefills the scaling checkpoint at doubling lengths, `repeats` passes over all lengths
(not `repeats` runs of one length back to back; every other pass longest first), and summarises
them robustly (`summarise`): a burst of load on a shared machine then costs one run of one length,
not the ratio between two neighbouring lengths, and a steady drift cancels between directions. It runs in a fresh process: after the side-by-side rows the bench process
holds what five engines left in its heap, and the same series ran up to 10% slower at 16K-32K
there than in a process of its own (measured on this machine), which is noise, not prefill cost.
"""
from __future__ import annotations

import math
import multiprocessing
import queue as queue_module
import statistics
from pathlib import Path
from typing import Callable

from lib.bench_engines import Ours
from lib.bench_models import prompts as make_prompts

BACKEND = "cpu"
TARGET_PER_DOUBLING = 2.2          # issue 7: prefill cost per doubling of context, 1K -> 32K


def series(path: Path, sizes: tuple[int, ...], chunk: int, repeats: int, log: Callable[[dict], None]) -> dict:
    """Prefill seconds per length and pass, summarised by `summarise`."""
    engine = Ours(path, BACKEND, chunk)
    vocab = engine.model.cfg.vocab_size
    engine.prefill(make_prompts(vocab, 1, min(sizes), seed=99)[0])            # warm-up
    runs: list[list[float]] = [[] for _ in sizes]
    for attempt in range(repeats):
        order = range(len(sizes))
        for n in reversed(order) if _descending(attempt) else order:
            size = sizes[n]
            t = engine.prefill(make_prompts(vocab, 1, size, seed=2000 + n)[0]).seconds
            runs[n].append(t)
            log({"engine": BACKEND, "phase": "scaling", "size": size, "status": "ok", "run": attempt + 1,
                 "seconds": t, "tokens_per_s": size / t})
    engine.close()
    return summarise(path, sizes, runs, engine.load_s)


def _descending(attempt: int) -> bool:
    """Passes alternate: shortest to longest, then longest to shortest."""
    return attempt % 2 == 1


def _rate(a: float, b: float, n: int, m: int) -> float:
    """(t2 / t1) ** (1 / log2(n2 / n1)): the plain ratio when the sizes double, comparable otherwise."""
    return (b / a) ** (1 / math.log2(m / n))


def _balanced(ratios: list[float]) -> float:
    """One ratio from per-pass ratios: the geometric mean of the ascending passes' geometric mean and
    the descending passes'. A machine whose speed drifts during a pass inflates a ratio measured
    short-then-long and deflates it long-then-short by the same factor, so the two directions
    weigh equally (three passes: the two ascending ones share half the weight)."""
    up = [r for p, r in enumerate(ratios) if not _descending(p)]
    down = [r for p, r in enumerate(ratios) if _descending(p)]
    groups = [statistics.geometric_mean(g) for g in (up, down) if g]
    return statistics.geometric_mean(groups)


def summarise(path: Path, sizes: tuple[int, ...], runs: list[list[float]], load_s: float) -> dict:
    """The cost per doubling from `runs[length][pass]` seconds.

    Each doubling's ratio is taken within a pass (two neighbouring lengths measured seconds apart)
    and the passes are combined by `_balanced`. On this shared 2-core machine one length's time
    moved by up to 17% within two minutes (4K: 4.8 s, then 5.6 s in the same process), so the
    ratio of the fastest runs of two lengths (`per_doubling_fastest`, also reported) can pair one
    length's lucky run with its neighbour's ordinary one."""
    passes = [[r[p] for r in runs] for p in range(len(runs[0]))]            # [pass][length]
    steps = list(zip(sizes, sizes[1:]))
    per_doubling = [_balanced([_rate(t[i], t[i + 1], n, m) for t in passes]) for i, (n, m) in enumerate(steps)]
    overall = _balanced([_rate(t[0], t[-1], sizes[0], sizes[-1]) for t in passes]) if steps else None
    fastest = [min(r) for r in runs]
    return {"backend": BACKEND, "checkpoint": str(path), "sizes": list(sizes), "seconds": fastest,
            "seconds_all": runs, "tokens_per_s": [s / t for s, t in zip(sizes, fastest)],
            "per_doubling": per_doubling, "max_per_doubling": max(per_doubling, default=None),
            "per_doubling_fastest": [_rate(fastest[i], fastest[i + 1], n, m) for i, (n, m) in enumerate(steps)],
            "per_doubling_first_to_last": overall, "target_per_doubling": TARGET_PER_DOUBLING,
            "meets_target": all(r <= TARGET_PER_DOUBLING for r in per_doubling),
            "meets_target_on_average": overall is not None and overall <= TARGET_PER_DOUBLING, "load_s": load_s}


def _child(path: str, sizes, chunk: int, repeats: int, threads: int, out) -> None:
    import torch

    from lib.hostmem import keep_freed_memory

    keep_freed_memory()                       # as in the bench process (lib/cli.py)
    torch.set_num_threads(threads)
    try:
        out.put(("done", series(Path(path), tuple(sizes), chunk, repeats, lambda row: out.put(("row", row)))))
    except BaseException as err:              # reported by the parent, which owns the exit status
        out.put(("error", f"{type(err).__name__}: {err}"))


def in_fresh_process(path: Path, sizes: tuple[int, ...], chunk: int, repeats: int,
                     log: Callable[[dict], None]) -> dict:
    """`series` in a spawned process with this process's torch thread count; rows reach `log` as
    they finish. Raises RuntimeError if the child fails or dies."""
    import torch

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_child, args=(str(path), list(sizes), chunk, repeats, torch.get_num_threads(), out),
                        name="dsv4gen-bench-scaling", daemon=True)
    child.start()
    try:
        while True:
            try:
                kind, payload = out.get(timeout=5)
            except queue_module.Empty:
                if not child.is_alive():
                    raise RuntimeError(f"the scaling series process died (exit code {child.exitcode})") from None
                continue
            if kind == "row":
                log(payload)
            elif kind == "error":
                raise RuntimeError(f"the scaling series failed: {payload}")
            else:
                return payload
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
