"""Long context on the paged state: speed, resident state and where a step's time goes (a benchmark).

    python -m lib.bench.long_context [--backends cpu,ascend910] [--contexts 4096,16384,65536,262144]
                                     [--chunk 512] [--decode-steps 12] [--out long-context]

For each backend and context N, in one process: the `scaling` checkpoint of `dsv4gen bench`
(lib/bench/workload.py: the tiny widths with Flash's window 128 and ratios 4 / 128, index top-k
64) prefills N random tokens in chunks through the paged step, and a baseline sequence of the
smallest context beside it in the same cache, then decodes both, one step each in turn. A timing
rendering of the generated code (codegen.lower.Rewrite.time_ops) adds up the time of the
attention-layer ops per layer kind, so every step splits into the parts that must grow with the
context (the lightning indexer scoring every L / 4 key, HCA attending to every L / 128 entry) and
the rest, which must not; each part at N is also given as its ratio to the baseline's, measured
side by side (what the summary uses: separate processes minutes apart see the machine drift).
Resident state per context token is what the pools hold for the sequence: its slot in every ring
pool and its blocks of entries and keys. Each context runs in a process of its own, so its peak
resident memory (ru_maxrss) is that context's (the baseline's state is in every one of them and
cancels in the differences); the summary sets its growth from the smallest to the largest context
against the state bytes the pools added.
Writes long-context.json and long-context.png.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

GROWING = ("attention_csa.index_select", "attention_hca.sparse_attention")   # cost grows with the context
TIMED_OPS = ("index_select", "sparse_attention", "compress")


def _decode(model, store, seq: int, ids, pos: int) -> tuple[float, dict]:
    """One decode step of sequence `seq` at position `pos`: seconds and the timed ops' parts."""
    from lib.records.batch import make_batch
    from lib.runtime.paged_step import paged_step

    times = model.module.TIMES
    times.clear()
    t0 = time.perf_counter()
    paged_step(model, make_batch([[int(ids[pos])]], [pos], last_only=True), store, [seq])
    return time.perf_counter() - t0, dict(times)


def _growing(step: tuple[float, dict]) -> float:
    return sum(step[1].get(k, 0.0) for k in GROWING)


def _rest(step: tuple[float, dict]) -> float:
    return step[0] - _growing(step)


def run_context(model, n: int, chunk: int, decode_steps: int, baseline: int, seed: int = 5) -> dict:
    """Prefill n tokens (sequence 0) and `baseline` tokens (sequence 1, the smallest context) in
    one cache, then decode both, alternating step by step: the decode costs at n are also given
    as ratios to the baseline's measured side by side, so the machine's drift between processes
    (measured: 1.5x on constant-work ops over minutes on this 2-core machine) cancels."""
    import torch

    from lib.records.batch import make_batch
    from lib.runtime.paged_cache import PagedCache
    from lib.runtime.paged_step import paged_step

    times = model.module.TIMES
    gen = torch.Generator().manual_seed(seed)
    # token ids stay a tensor (a list of 256K Python ints would add 9 MiB to the resident memory measured)
    ids = [torch.randint(16, model.cfg.vocab_size, (m + decode_steps,), generator=gen) for m in (n, baseline)]
    store = PagedCache.for_lengths(model, [n + decode_steps, baseline + decode_steps])

    def prefill(seq: int, m: int) -> None:
        store.add(seq)
        for lo in range(0, m, chunk):
            paged_step(model, make_batch([ids[seq][lo:min(m, lo + chunk)].tolist()], [lo], last_only=True), store, [seq])

    prefill(1, baseline)                                    # the baseline first, untimed
    times.clear()
    t0 = time.perf_counter()
    prefill(0, n)
    prefill_s, prefill_parts = time.perf_counter() - t0, dict(times)
    pairs = [(_decode(model, store, 0, ids[0], n + i), _decode(model, store, 1, ids[1], baseline + i))
             for i in range(decode_steps)]
    pairs = pairs[1:] if len(pairs) > 2 else pairs          # the first decode step pays for warm-up
    steps = [mine for mine, _ in pairs]
    step_s = [s for s, _ in steps]
    held = store.bytes_per_sequence() + store.bytes_per_token() * n
    return {"context": n, "baseline_context": baseline, "prefill_s": prefill_s, "prefill_tokens_per_s": n / prefill_s,
            "prefill_parts_s": prefill_parts, "decode_step_s": statistics.median(step_s),
            "decode_tokens_per_s": 1 / statistics.median(step_s),
            "decode_growing_s": statistics.median(_growing(step) for step in steps),
            "decode_rest_s": statistics.median(_rest(step) for step in steps),
            "decode_parts_s": {k: statistics.median(p.get(k, 0.0) for _, p in steps) for k in steps[0][1]},
            # side by side with the baseline sequence, step by step
            "rest_vs_baseline": statistics.median(_rest(a) / _rest(b) for a, b in pairs),
            "parts_vs_baseline": {k: statistics.median(a[1].get(k, 0.0) / max(b[1].get(k, 0.0), 1e-9) for a, b in pairs)
                                  for k in steps[0][1]},
            "state_bytes": held, "state_bytes_per_token": held / n,
            "kv_bytes_per_token": store.bytes_per_token(), "kv_fixed_bytes_per_sequence": store.bytes_per_sequence()}


def one_context(backend: str, n: int, chunk: int, decode_steps: int, baseline: int) -> dict:
    """`run_context` in this process (a fresh one: its peak resident memory is this context's)."""
    from codegen.lower import Rewrite
    from lib.bench.workload import checkpoint
    from lib.porting.rendering import rendered
    from lib.runtime.loaded_model import load_model

    with rendered(backend, Rewrite(time_ops=TIMED_OPS), f"long-context-{backend}") as code:
        model = load_model(checkpoint("scaling", progress=False), backend, code=code)
        run_context(model, min(n, 2 * chunk), chunk, 2, min(baseline, chunk))      # warm-up
        row = run_context(model, n, chunk, decode_steps, baseline)
    row["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024    # Linux: KiB
    return row


def _child(backend: str, n: int, args) -> dict:
    out = subprocess.run([sys.executable, "-m", "lib.bench.long_context", "--one", str(n), "--backends", backend,
                          "--contexts", args.contexts,
                          "--chunk", str(args.chunk), "--decode-steps", str(args.decode_steps),
                          "--threads", str(args.threads)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lib.bench.long_context", description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="cpu,ascend910")
    parser.add_argument("--contexts", default="4096,16384,65536,262144")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk (max_num_batched_tokens)")
    parser.add_argument("--decode-steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("long-context"))
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)    # a child: one context
    args = parser.parse_args(argv)

    from lib.runtime.hostmem import keep_freed_memory

    keep_freed_memory()                                     # before torch is imported (MKL's buffer cache)
    import torch

    from lib.bench.workload import checkpoint

    torch.set_num_threads(args.threads)
    backends, contexts = args.backends.split(","), sorted(int(c) for c in args.contexts.split(","))
    if args.one is not None:
        print(json.dumps(one_context(backends[0], args.one, args.chunk, args.decode_steps, contexts[0])))
        return 0
    checkpoint("scaling")                                   # made here once, with its progress shown
    result = {"chunk": args.chunk, "threads": args.threads, "checkpoint": "scaling", "backends": {}}
    for backend in backends:
        rows = []
        for n in contexts:
            row = _child(backend, n, args)
            rows.append(row)
            print(f"{backend:>10} {n:>7}: prefill {row['prefill_tokens_per_s']:7.1f} tok/s; decode "
                  f"{row['decode_tokens_per_s']:6.2f} tok/s (indexer + HCA {row['decode_growing_s'] * 1e3:7.1f} ms, "
                  f"rest {row['decode_rest_s'] * 1e3:6.1f} ms = {row['rest_vs_baseline']:.2f}x the "
                  f"{row['baseline_context']}-token sequence's beside it); state {row['state_bytes_per_token']:6.1f} B/token; "
                  f"peak RSS {row['peak_rss_bytes'] / 2**20:7.1f} MiB", flush=True)
        first, last = rows[0], rows[-1]
        added = last["state_bytes"] - first["state_bytes"]
        summary = {"rest_ratio": last["rest_vs_baseline"],
                   "rest_ratio_across_processes": last["decode_rest_s"] / first["decode_rest_s"],
                   "growing_ratio": last["decode_growing_s"] / max(first["decode_growing_s"], 1e-9),
                   "state_bytes_added": added,
                   "peak_rss_added": last["peak_rss_bytes"] - first["peak_rss_bytes"],
                   "peak_rss_added_over_state_added": (last["peak_rss_bytes"] - first["peak_rss_bytes"]) / added}
        print(f"{backend:>10}: from {first['context']} to {last['context']} tokens the decode step's rest costs "
              f"{summary['rest_ratio']:.2f}x side by side ({summary['rest_ratio_across_processes']:.2f}x across "
              f"processes; indexer + HCA {summary['growing_ratio']:.1f}x); peak RSS grew "
              f"{summary['peak_rss_added'] / 2**20:.1f} MiB = {summary['peak_rss_added_over_state_added']:.2f}x "
              f"the {added / 2**20:.1f} MiB of state the pools added", flush=True)
        result["backends"][backend] = {"rows": rows, "summary": summary}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "long-context.json").write_text(json.dumps(result, indent=2) + "\n")
    _plot(args.out / "long-context.png", result)
    print(f"wrote {args.out / 'long-context.json'} and {args.out / 'long-context.png'}")
    return 0


def _plot(path: Path, result: dict) -> None:
    """Left: the decode step's rest and its growing ops as multiples of the baseline sequence's,
    measured beside it (flat = independent of context), per backend. Right: prefill tokens/s.
    Both against context on log axes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for backend, data in result["backends"].items():
        rows = data["rows"]
        n = [r["context"] for r in rows]
        left.loglog(n, [r["rest_vs_baseline"] for r in rows], "o-", label=f"{backend}: rest")
        for op in GROWING:
            left.loglog(n, [r["parts_vs_baseline"].get(op, float("nan")) for r in rows], "s--", label=f"{backend}: {op}")
        right.semilogx(n, [r["prefill_tokens_per_s"] for r in rows], "o-", label=backend)
    left.set(xlabel="context tokens", ylabel=f"x the {rows[0]['baseline_context']}-token sequence beside it",
             title="decode step: what grows with context")
    right.set(xlabel="context tokens", ylabel="prefill tokens/s", title=f"chunked prefill ({result['chunk']}-token chunks)")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
