"""Where the `cpu` backend's prefill time goes as the context grows (a benchmark, not a test).

    python -m lib.bench.prefill_parts [--sizes 1024,2048,4096,8192,16384,32768] [--threads 1]

Prefills the `scaling` checkpoint of `dsv4gen bench` (lib/bench/workload.py: window 128, ratios
4 / 128, index top-k 64) once per length in one process, in 512-token chunks through the engine,
with a timer around the generated model's calls of the attention-layer ops, and prints seconds
per op kind and the lightning indexer's share of each prefill. The share is what makes prefill
grow faster than the context (the indexer scores every L / 4 compressed entry per query);
`dsv4gen bench` measures the growth itself, in a process of its own and over several passes.
"""
from __future__ import annotations

import argparse
import collections
import functools
import time


def _timed(module, name: str, totals: dict, label) -> None:
    """Replace module.name by a wrapper adding its wall time to totals[label(args)]."""
    fn = getattr(module, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label(args)] += time.perf_counter() - start
    setattr(module, name, wrapper)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lib.bench.prefill_parts", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (dsv4gen bench's default: 1)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]

    import torch

    import backends.cpu.ops.attention as attention
    import backends.cpu.ops.compressor as compressor
    from lib.bench.engines import Ours
    from lib.bench.workload import checkpoint, prompts
    from lib.runtime.hostmem import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(args.threads)
    totals: dict[str, float] = collections.defaultdict(float)
    # sparse_attention(q, kv, batch, windows, entries, selection, ...): no entries = a sliding layer
    _timed(attention, "sparse_attention", totals,
           lambda a: "attention swa" if a[4] is None else "attention csa" if a[5] is not None else "attention hca")
    _timed(attention, "index_select", totals, lambda a: "indexer (index_select)")
    _timed(compressor, "compress", totals, lambda a: "compressors")
    engine = Ours(checkpoint("scaling"), "cpu", 512)
    vocab = engine.model.cfg.vocab_size
    engine.prefill(prompts(vocab, 1, min(sizes), seed=99)[0])                 # warm-up
    print(f"cpu prefill, scaling checkpoint, {args.threads} thread(s), 512-token chunks")
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
