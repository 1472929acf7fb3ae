"""`dsv4gen bench`'s scaling series: how the `cpu` backend's prefill cost grows with context.

The series prefills one prompt of the longest length several times (`runs`) and times every
engine step, one per 512-token chunk. Prefill is causal and chunked, so the first k steps of that
prefill are exactly the prefill of the prompt's first k chunks: every shorter length's cost is
read off the same runs at its chunk boundary, and the pools are the same size for all lengths.
Each chunk's cost is its fastest time over the runs. This shared 2-core machine only ever adds
time, and unevenly: the same prefill moved by up to 17% within two minutes, and whole prefills
timed one after the other (a zigzag over the lengths) put that into single
doublings, from 1.81x to 2.29x for the same doubling; chunk by chunk, the fastest of several
runs is the chunk's cost with the interference left out (the reasoning of Python's timeit), and
every chunk has the same number of runs to pick from, so no length is favoured. Each run's own
wall-clock ratios are reported beside (`per_doubling_runs`). The series runs in a fresh process:
after the side-by-side rows the bench process holds what five engines left in its heap, and the
same series ran up to 10% slower at 16K-32K there than in a process of its own (measured on this
machine), which is noise, not prefill cost.
"""
from __future__ import annotations

import math
import multiprocessing
import queue as queue_module
import statistics
from pathlib import Path
from typing import Callable

from lib.bench.engines import Ours
from lib.bench.workload import prompts as make_prompts

BACKEND = "cpu"
TARGET_PER_DOUBLING = 2.2          # issue 7: prefill cost per doubling of context, 1K -> 32K


def check_sizes(sizes: tuple[int, ...], chunk: int) -> None:
    """Raise ValueError unless the lengths can be read off one prefill: two or more, increasing,
    each a whole number of chunks."""
    if len(sizes) < 2 or list(sizes) != sorted(set(sizes)):
        raise ValueError(f"scaling lengths {list(sizes)}: need two or more, in increasing order")
    if odd := [n for n in sizes if n % chunk]:
        raise ValueError(f"scaling length {odd[0]} is not a multiple of the chunk ({chunk} tokens): each "
                         "length is read off the longest prefill at a chunk boundary")


def series(path: Path, sizes: tuple[int, ...], chunk: int, runs: int, log: Callable[[dict], None]) -> dict:
    """`runs` timed prefills of the longest length, every step timed, summarised by `summarise`."""
    check_sizes(sizes, chunk)
    engine = Ours(path, BACKEND, chunk)
    vocab = engine.model.cfg.vocab_size
    engine.prefill(make_prompts(vocab, 1, sizes[1], seed=99)[0])      # warm-up: allocator and caches, not timed
    prompt = make_prompts(vocab, 1, sizes[-1], seed=2000)[0]
    steps: list[list[float]] = []                                     # [run][chunk] seconds
    for run in range(runs):
        steps.append(engine.prefill_steps(prompt))
        log({"engine": BACKEND, "phase": "scaling", "size": sizes[-1], "status": "ok", "run": run + 1,
             "seconds": sum(steps[-1]), "tokens_per_s": sizes[-1] / sum(steps[-1])})
    engine.close()
    return summarise(path, sizes, chunk, steps, engine.load_s)


def _rate(a: float, b: float, n: int, m: int) -> float:
    """(t2 / t1) ** (1 / log2(n2 / n1)): the plain ratio when the sizes double, comparable otherwise."""
    return (b / a) ** (1 / math.log2(m / n))


def _ratios(seconds: list[float], sizes: tuple[int, ...]) -> list[float]:
    return [_rate(seconds[i], seconds[i + 1], n, m) for i, (n, m) in enumerate(zip(sizes, sizes[1:]))]


def summarise(path: Path, sizes: tuple[int, ...], chunk: int, steps: list[list[float]], load_s: float) -> dict:
    """The cost per doubling from `steps` ([run][chunk] seconds of the longest prefill): a length's
    cost is the sum of its chunks' fastest times."""
    check_sizes(sizes, chunk)
    ends = [n // chunk for n in sizes]
    if not steps or any(len(run) != ends[-1] for run in steps):
        raise ValueError(f"every run needs {ends[-1]} step times (the {sizes[-1]}-token prefill in "
                         f"{chunk}-token chunks), got {[len(run) for run in steps]}")
    fastest = [min(times) for times in zip(*steps)]
    seconds = [sum(fastest[:end]) for end in ends]
    per_doubling = _ratios(seconds, sizes)
    per_run = [[sum(run[:end]) for end in ends] for run in steps]
    overall = statistics.geometric_mean(per_doubling)
    return {"backend": BACKEND, "checkpoint": str(path), "sizes": list(sizes), "chunk": chunk,
            "seconds": seconds, "tokens_per_s": [n / t for n, t in zip(sizes, seconds)],
            "step_seconds": steps, "step_fastest": fastest, "seconds_runs": per_run,
            "per_doubling": per_doubling, "per_doubling_runs": [_ratios(run, sizes) for run in per_run],
            "max_per_doubling": max(per_doubling), "per_doubling_average": overall,
            "target_per_doubling": TARGET_PER_DOUBLING,
            "meets_target": all(r <= TARGET_PER_DOUBLING for r in per_doubling),
            "meets_target_on_average": overall <= TARGET_PER_DOUBLING, "load_s": load_s}


def _child(path: str, sizes, chunk: int, runs: int, threads: int, out) -> None:
    import torch

    from lib.runtime.hostmem import keep_freed_memory

    keep_freed_memory()                       # as in the bench process (lib/cli/main.py)
    torch.set_num_threads(threads)
    try:
        out.put(("done", series(Path(path), tuple(sizes), chunk, runs, lambda row: out.put(("row", row)))))
    except BaseException as err:              # reported by the parent, which owns the exit status
        out.put(("error", f"{type(err).__name__}: {err}"))


def in_fresh_process(path: Path, sizes: tuple[int, ...], chunk: int, runs: int,
                     log: Callable[[dict], None]) -> dict:
    """`series` in a spawned process with this process's torch thread count; rows reach `log` as
    they finish. Raises RuntimeError if the child fails or dies."""
    import torch

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_child, args=(str(path), list(sizes), chunk, runs, torch.get_num_threads(), out),
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
