"""`dsv4gen bench`'s scaling series: how the `cpu` backend's prefill cost grows with context.

The series prefills the scaling checkpoint at doubling lengths in a zigzag: up over all lengths,
down, up, down (`zigzag`), so every pair of neighbouring lengths is measured back to back once per
sweep, as often upwards as downwards, and the turning lengths are not run twice in a row; then the
short lengths zigzag as often again (`schedule`). Each doubling's ratio comes from those
back-to-back pairs only (`summarise`): a burst of load on a shared machine then costs one pair, not
the ratio between two lengths measured minutes apart, and a steady drift cancels between directions. It runs in a fresh process: after the side-by-side rows the bench
process holds what five engines left in its heap, and the same series ran up to 10% slower at
16K-32K there than in a process of its own (measured on this machine), which is noise, not prefill cost.
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


def zigzag(count: int, sweeps: int) -> list[int]:
    """Length indices in measurement order: sweep 1 shortest to longest, sweep 2 back down without
    repeating the longest, sweep 3 up again without repeating the shortest, and so on."""
    order = list(range(count))
    for sweep in range(1, sweeps if count > 1 else 1):
        order += list(range(count - 2, -1, -1)) if sweep % 2 else list(range(1, count))
    return order


def schedule(sizes: tuple[int, ...], sweeps: int) -> list[int]:
    """`zigzag` over every length, then as many sweeps again over the short lengths (at most an
    eighth of the longest: about a tenth of a sweep's time), when the first zigzag ends at the
    shortest (an even number of sweeps). A short prefill averages over less of
    the machine's drift than a long one: in two bench runs here the pairs of the doublings up to
    4K spread about twice as wide as those at 16K -> 32K, so they get twice the pairs."""
    order = zigzag(len(sizes), sweeps)
    short = sum(1 for n in sizes if n * 8 <= max(sizes, default=0))
    extra = zigzag(short, sweeps)[1:] if short > 1 else []         # from the shortest, where `order` ends
    return order + extra if order[-1] == 0 else order


def series(path: Path, sizes: tuple[int, ...], chunk: int, sweeps: int, log: Callable[[dict], None]) -> dict:
    """Prefill seconds per length in `schedule` order, summarised by `summarise`."""
    engine = Ours(path, BACKEND, chunk)
    vocab = engine.model.cfg.vocab_size
    for size in sorted(set(sizes))[:2]:                     # warm-up: allocator and caches, not timed
        engine.prefill(make_prompts(vocab, 1, size, seed=99)[0])
    timeline: list[list] = []                               # [length index, seconds] in measurement order
    for n in schedule(sizes, sweeps):
        size = sizes[n]
        t = engine.prefill(make_prompts(vocab, 1, size, seed=2000 + n)[0]).seconds
        timeline.append([n, t])
        log({"engine": BACKEND, "phase": "scaling", "size": size, "status": "ok",
             "run": sum(1 for i, _ in timeline if i == n), "seconds": t, "tokens_per_s": size / t})
    engine.close()
    return summarise(path, sizes, timeline, engine.load_s)


def _rate(a: float, b: float, n: int, m: int) -> float:
    """(t2 / t1) ** (1 / log2(n2 / n1)): the plain ratio when the sizes double, comparable otherwise."""
    return (b / a) ** (1 / math.log2(m / n))


def _balanced(up: list[float], down: list[float]) -> float:
    """One ratio from the pairs measured shorter-then-longer (`up`) and longer-then-shorter
    (`down`): the geometric mean of each direction's geometric mean. A machine whose speed drifts
    inflates a ratio measured one way and deflates it the other way by the same factor, so the
    two directions weigh equally whatever their counts."""
    groups = [statistics.geometric_mean(g) for g in (up, down) if g]
    return statistics.geometric_mean(groups)


def summarise(path: Path, sizes: tuple[int, ...], timeline: list[list], load_s: float) -> dict:
    """The cost per doubling from `timeline` ([length index, seconds] in measurement order).

    A doubling's samples are the timeline's neighbouring measurements of its two lengths, combined
    by `_balanced`. On this shared 2-core machine one length's time moved by up to 17% within two
    minutes (4K: 4.8 s, then 5.6 s in the same process), so the ratio of the fastest runs of two
    lengths (`per_doubling_fastest`, also reported) can pair one length's lucky run with its
    neighbour's ordinary one."""
    runs = [[t for i, t in timeline if i == n] for n in range(len(sizes))]
    steps = list(zip(sizes, sizes[1:]))
    samples: list[dict[str, list[float]]] = [{"up": [], "down": []} for _ in steps]
    for (i, a), (j, b) in zip(timeline, timeline[1:]):
        if abs(i - j) == 1:
            lo, (t_lo, t_hi) = min(i, j), ((a, b) if i < j else (b, a))
            samples[lo]["up" if i < j else "down"].append(_rate(t_lo, t_hi, sizes[lo], sizes[lo + 1]))
    per_doubling = [_balanced(s["up"], s["down"]) for s in samples]
    overall = statistics.geometric_mean(per_doubling) if steps else None
    fastest = [min(r) for r in runs]
    return {"backend": BACKEND, "checkpoint": str(path), "sizes": list(sizes), "seconds": fastest,
            "seconds_all": runs, "timeline": timeline, "tokens_per_s": [s / t for s, t in zip(sizes, fastest)],
            "per_doubling": per_doubling, "per_doubling_samples": samples,
            "max_per_doubling": max(per_doubling, default=None),
            "per_doubling_fastest": [_rate(fastest[i], fastest[i + 1], n, m) for i, (n, m) in enumerate(steps)],
            "per_doubling_average": overall, "target_per_doubling": TARGET_PER_DOUBLING,
            "meets_target": all(r <= TARGET_PER_DOUBLING for r in per_doubling),
            "meets_target_on_average": overall is not None and overall <= TARGET_PER_DOUBLING, "load_s": load_s}


def _child(path: str, sizes, chunk: int, sweeps: int, threads: int, out) -> None:
    import torch

    from lib.hostmem import keep_freed_memory

    keep_freed_memory()                       # as in the bench process (lib/cli.py)
    torch.set_num_threads(threads)
    try:
        out.put(("done", series(Path(path), tuple(sizes), chunk, sweeps, lambda row: out.put(("row", row)))))
    except BaseException as err:              # reported by the parent, which owns the exit status
        out.put(("error", f"{type(err).__name__}: {err}"))


def in_fresh_process(path: Path, sizes: tuple[int, ...], chunk: int, sweeps: int,
                     log: Callable[[dict], None]) -> dict:
    """`series` in a spawned process with this process's torch thread count; rows reach `log` as
    they finish. Raises RuntimeError if the child fails or dies."""
    import torch

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_child, args=(str(path), list(sizes), chunk, sweeps, torch.get_num_threads(), out),
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
