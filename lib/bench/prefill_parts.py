"""Where the `cpu` backend's prefill time goes as the context grows (a benchmark, not a test).

    python -m lib.bench.prefill_parts [--sizes 1024,2048,4096,8192,16384,32768] [--threads 1]

Prefills the `scaling` checkpoint of `dsv4gen bench` (lib/bench/workload.py: window 128, ratios
4 / 128, index top-k 64) once per length in one process, in 512-token chunks through the engine,
with a timer around the generated model's calls of the attention-layer ops (a rendering of the
generated code whose calls go to the timers below), and prints seconds per op kind and the
lightning indexer's share of each prefill. The share is what makes prefill
grow faster than the context (the indexer scores every L / 4 compressed entry per query);
`dsv4gen bench` measures the growth itself, in a process of its own and over several passes.
"""
from __future__ import annotations

import argparse
import collections
import functools
import time

import backends.cpu.ops.attention as attention
import backends.cpu.ops.compressor as compressor

# Seconds per op kind of this process's run: the benchmark's own tally, filled by the timers the
# rendered generated code calls and cleared before each length.
TOTALS: dict[str, float] = collections.defaultdict(float)


def _timed(fn, label):
    """`fn`, adding its wall time to TOTALS[label(args)]."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[label(args)] += time.perf_counter() - start
    return wrapper


# sparse_attention(q, kv, batch, windows, entries, selection, ...): no entries = a sliding layer
sparse_attention = _timed(attention.sparse_attention, lambda a: "attention swa" if a[4] is None
                          else "attention csa" if a[5] is not None else "attention hca")
index_select = _timed(attention.index_select, lambda a: "indexer (index_select)")
compress = _timed(compressor.compress, lambda a: "compressors")
TIMED = {op: f"lib.bench.prefill_parts:{op}" for op in ("sparse_attention", "index_select", "compress")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lib.bench.prefill_parts", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (dsv4gen bench's default: 1)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    import torch

    from codegen.lower import Rewrite
    from lib.bench.engines import Ours
    from lib.bench.workload import checkpoint, prompts
    from lib.porting.rendering import rendered
    from lib.runtime.hostmem import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(args.threads)
    with rendered("cpu", Rewrite(calls=TIMED), "prefill-parts") as code:
        return _run(Ours(checkpoint("scaling"), "cpu", 512, code=code), sizes, args.threads, prompts)


def _run(engine, sizes: list[int], threads: int, prompts) -> int:
    # the tally the rendered code's timers fill: this module by name (run as a script it is __main__)
    from lib.bench.prefill_parts import TOTALS as totals
    vocab = engine.model.cfg.vocab_size
    engine.prefill(prompts(vocab, 1, min(sizes), seed=99)[0])                 # warm-up
    print(f"cpu prefill, scaling checkpoint, {threads} thread(s), 512-token chunks")
    previous = None
    for size in sizes:
        totals.clear()
        seconds = engine.prefill(prompts(vocab, 1, size, seed=5)[0]).seconds
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(totals.items()))
        growth = "" if previous is None else f" ({seconds / previous:.2f}x)"
        share = totals["indexer (index_select)"] / seconds
        print(f"{size:>6} tokens: {seconds:7.2f} s{growth}, {size / seconds:6.1f} tokens/s, indexer {share:5.1%}; "
              f"{parts}; rest {seconds - sum(totals.values()):.2f}", flush=True)
        previous = seconds
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
