"""`dsv4gen bench`: the side-by-side benchmark against transformers (lib/bench/runner.py), as a command.

Parses and checks the arguments, refuses early (exit 2, one message) when matplotlib or the
transformers peer is missing, prints the exact command and the machine, a progress line per row,
then the tables, and writes bench.json, bench.md and bench.png under --out. Knows formatting and
files, not measurement.
"""
from __future__ import annotations

import os
import platform
import shlex
import time
from pathlib import Path

DEFAULTS = {"prefill": "512,2048,8192", "device_prefill": "512", "decode_batches": "1,8",
            "scaling": "1024,2048,4096,8192,16384,32768"}


def _sizes(text: str) -> tuple[int, ...]:
    import argparse
    try:
        sizes = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}': expected comma-separated integers such as 512,2048") from None
    if any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"'{text}': every size must be >= 1")
    return sizes


def add_parser(sub, backend_names: list[str]) -> None:
    s = sub.add_parser("bench", help="prefill and decode tokens/s of every backend against transformers, "
                                     "and prefill cost vs context (a benchmark: nothing asserts a speed)")
    s.add_argument("--out", required=True, help="folder for bench.json, bench.md and bench.png")
    default = ",".join(["cpu", *(b for b in backend_names if b != "cpu")])       # the reference first
    s.add_argument("--backends", default=default, help=f"comma-separated (default: all, {default})")
    s.add_argument("--model", help="checkpoint to bench (default: the CPU-sized bench checkpoint, made once)")
    s.add_argument("--scaling-model", help="checkpoint for the scaling series (default: the tiny scaling one)")
    s.add_argument("--prefill", type=_sizes, default=_sizes(DEFAULTS["prefill"]),
                   help=f"prompt lengths for transformers and cpu (default {DEFAULTS['prefill']})")
    s.add_argument("--device-prefill", type=_sizes, default=_sizes(DEFAULTS["device_prefill"]),
                   help="the subset of --prefill the device emulations run (default "
                        f"{DEFAULTS['device_prefill']}: they are far slower than the devices)")
    s.add_argument("--decode-batches", type=_sizes, default=_sizes(DEFAULTS["decode_batches"]),
                   help=f"concurrent sequences per decode row (default {DEFAULTS['decode_batches']})")
    s.add_argument("--decode-context", type=int, default=160,
                   help="prompt tokens before the timed decode steps (default 160: past the 128 window)")
    s.add_argument("--decode-steps", type=int, default=16, help="timed decode steps, transformers and cpu")
    s.add_argument("--device-decode-steps", type=int, default=4, help="timed decode steps, device emulations")
    s.add_argument("--scaling", type=_sizes, default=_sizes(DEFAULTS["scaling"]),
                   help=f"cpu prefill lengths on the scaling checkpoint (default {DEFAULTS['scaling']}); "
                        "--no-scaling skips the series")
    s.add_argument("--no-scaling", action="store_true")
    s.add_argument("--scaling-runs", type=int, default=7,
                   help="timed prefills of the longest scaling length, every chunk timed; each length's "
                        "cost is the sum of its chunks' fastest times (default 7)")
    s.add_argument("--chunk", type=int, default=512, help="prefill chunk, every engine (default 512)")
    s.add_argument("--repeats", type=int, default=1, help="timed runs per row, the fastest kept (default 1)")
    s.add_argument("--threads", type=int, default=1,
                   help="torch threads, every engine (default 1: on a shared 2-core machine two threads "
                        "can be 10x slower)")
    s.add_argument("--profile", action="store_true",
                   help="then profile the cpu backend's decode steps (cProfile by op, torch.profiler by kernel)")
    s.set_defaults(func=cmd_bench)


def _check(args, backend_names: list[str]):
    from lib.bench import scaling as bench_scaling
    from lib.bench.runner import Plan
    from lib.bench.hf_peer import missing_peer

    missing = missing_peer()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        missing.append("matplotlib")
    if missing:
        raise ValueError(f"the benchmark needs {', '.join(missing)}; install with: pip install -e \".[bench]\"")
    backends = tuple(b for b in args.backends.split(",") if b.strip())
    if unknown := [b for b in backends if b not in backend_names]:
        raise ValueError(f"--backends: unknown backend '{unknown[0]}' (accepted: {', '.join(backend_names)})")
    if extra := sorted(set(args.device_prefill) - set(args.prefill)):
        raise ValueError(f"--device-prefill {extra} must be a subset of --prefill {list(args.prefill)}")
    for name in ("decode_context", "decode_steps", "device_decode_steps", "chunk", "repeats", "scaling_runs",
                 "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if not args.no_scaling:
        try:
            bench_scaling.check_sizes(args.scaling, args.chunk)
        except ValueError as err:
            raise ValueError(f"--scaling: {err} (or --no-scaling)") from None
    return Plan(backends, args.prefill, args.device_prefill, args.decode_batches, args.decode_context,
                args.decode_steps, args.device_decode_steps, () if args.no_scaling else args.scaling,
                args.chunk, args.repeats, args.scaling_runs)


def _command(args) -> str:
    """Every option spelled out, so the printed command reruns exactly this benchmark."""
    join = lambda sizes: ",".join(map(str, sizes))                       # noqa: E731
    parts = ["dsv4gen", "bench", "--out", args.out, "--backends", args.backends]
    parts += [x for flag, value in (("--model", args.model), ("--scaling-model", args.scaling_model))
              if value for x in (flag, value)]
    parts += ["--prefill", join(args.prefill), "--device-prefill", join(args.device_prefill),
              "--decode-batches", join(args.decode_batches), "--decode-context", str(args.decode_context),
              "--decode-steps", str(args.decode_steps), "--device-decode-steps", str(args.device_decode_steps)]
    parts += ["--no-scaling"] if args.no_scaling else ["--scaling", join(args.scaling),
                                                        "--scaling-runs", str(args.scaling_runs)]
    parts += ["--chunk", str(args.chunk), "--repeats", str(args.repeats), "--threads", str(args.threads)]
    parts += ["--profile"] if args.profile else []
    return shlex.join(parts)


def cmd_bench(args) -> int:
    import torch

    from lib.bench import runner as bench

    from lib.bench import workload as bench_models

    from lib.bench import report as bench_report
    from spec.profile import backend_names

    started = time.perf_counter()
    plan = _check(args, backend_names())
    command = _command(args)
    print(f"$ {command}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else bench_models.checkpoint("bench")
    scaling_model = None
    if plan.scaling:
        scaling_model = Path(args.scaling_model) if args.scaling_model else bench_models.checkpoint("scaling")
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    import transformers
    print(f"checkpoint {model}; torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.threads} thread(s), {os.cpu_count()} cores, 1-minute load {load_before:.1f}", flush=True)
    print("transformers prefill runs in the same chunks as the engine (--chunk), through its own cache; "
          "greedy everywhere", flush=True)
    try:
        result = bench.run(plan, model, scaling_model,
                           lambda row: print(bench_report.progress_line(row, time.perf_counter() - started),
                                             flush=True))
        result["profiles"] = _profiles(plan, model) if args.profile else []
    finally:                                  # cmd_bench may run inside another process (tests)
        torch.set_num_threads(previous)
    result.update({"command": command, "plan": plan._asdict(), "checkpoint": str(model), "torch": torch.__version__,
                   "transformers": transformers.__version__, "threads": args.threads, "cpu_count": os.cpu_count(),
                   "python": platform.python_version(), "platform": platform.platform(),
                   "load_average_1m_before": load_before, "load_average_1m_after": os.getloadavg()[0]})
    result["total_wall_s"] = time.perf_counter() - started
    _print(result)
    bench_report.write_json(out / "bench.json", result)
    bench_report.write_text(out / "bench.md", bench_report.markdown(result) + "\n")
    bench_report.write_plot(out / "bench.png", result)
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'}; total {result['total_wall_s']:.0f} s")
    return 0 if result["reference_agrees"] else 1


def _profiles(plan, model: Path) -> list[dict]:
    from lib.bench.runner import REFERENCE
    from lib.bench.decode_profile import profile_decode

    return [profile_decode(model, REFERENCE, batch, plan.decode_context, plan.decode_steps, plan.chunk)
            for batch in plan.decode_batches]


def _print(result: dict) -> None:
    from lib.bench import report as bench_report
    from lib.bench.decode_profile import report

    print()
    print(bench_report.table(result))
    if result["scaling"]:
        print()
        print(bench_report.scaling_table(result["scaling"]))
    print()
    print("notes: ratio = tokens/s over transformers' tokens/s on the same row (same checkpoint, prompts and chunking);")
    print("  prefill tokens/s = prompt tokens / time to the first token; decode tokens/s = batch x steps / time of")
    print("  the steps after every prompt's first token. Greedy tokens = transformers: tokens equal to its greedy")
    print("  tokens before the first difference (device backends compute in fp16/bf16 and int8: not expected to match).")
    for profile in result["profiles"]:
        print()
        print(report(profile))
    print()
    print(bench_report.summary(result))
    if not result["reference_agrees"]:
        print(f"FAILED: the cpu reference's first greedy token contradicts a decisive transformers token on: "
              f"{', '.join(result['reference_disagreements'])} (not the same model?)")
