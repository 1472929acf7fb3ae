"""Where a backend's decode step spends its time: `dsv4gen bench --profile`.

Two views of the same timed decode steps (lib/bench/engines.py's, on the bench checkpoint):
cProfile's cumulative time of each op the generated model calls (attribution by the spec's ops:
the generated forward calls nothing else heavy), and torch.profiler's self time per aten kernel
(what those ops cost: matmuls, dtype copies, gathers). Both views are shares of the profiled
steps, whose absolute time the profilers inflate. Must not know about transformers.
"""
from __future__ import annotations

import contextlib
import cProfile
import pstats
from pathlib import Path

from lib.bench.engines import Ours
from lib.bench.workload import prompts as make_prompts

TOP = 10


def _by_op(stats: pstats.Stats) -> dict[str, float]:
    """Seconds per op function (file:function) over its calls from the generated model."""
    out: dict[str, float] = {}
    for (file, _, name), (_, _, _, _, callers) in stats.stats.items():
        from_model = sum(edge[3] for (caller_file, _, _), edge in callers.items()
                         if caller_file.endswith("_generated/model.py"))
        if from_model and "_generated" not in file:
            key = f"{Path(file).parent.name}/{Path(file).name}:{name}"
            out[key] = out.get(key, 0.0) + from_model
    return out


def profile_decode(path: Path, backend: str, batch: int, context: int, steps: int, chunk: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    engine = Ours(path, backend, chunk)
    prompts = make_prompts(engine.model.cfg.vocab_size, batch, context, seed=3000)
    engine.decode(prompts, 1)                                   # warm-up
    plain = engine.decode(prompts, steps).seconds
    prof = cProfile.Profile()

    @contextlib.contextmanager
    def cprofiled():
        prof.enable()
        yield
        prof.disable()

    profiled = engine.decode(prompts, steps, cprofiled).seconds
    ops = _by_op(pstats.Stats(prof))
    torch_prof = profile(activities=[ProfilerActivity.CPU])
    engine.decode(prompts, steps, lambda: torch_prof)
    kernels = [(k.key, k.self_cpu_time_total) for k in torch_prof.key_averages()]
    total_kernel = sum(t for _, t in kernels) or 1.0
    engine.close()
    return {
        "backend": backend, "batch": batch, "context": context, "steps": steps,
        "step_ms_unprofiled": 1e3 * plain / steps,
        "ops_share": {k: v / profiled for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:TOP]},
        "kernels_share": {k: t / total_kernel for k, t in sorted(kernels, key=lambda kv: -kv[1])[:TOP]},
    }


def report(profile: dict) -> str:
    lines = [f"decode profile, backend {profile['backend']}, batch {profile['batch']}, context {profile['context']}: "
             f"{profile['step_ms_unprofiled']:.1f} ms per step unprofiled",
             "  share of profiled step time by op (cProfile, as called by the generated model):"]
    lines += [f"    {share:6.1%}  {name}" for name, share in profile["ops_share"].items()]
    lines.append("  share of kernel self time (torch.profiler):")
    lines += [f"    {share:6.1%}  {name}" for name, share in profile["kernels_share"].items()]
    return "\n".join(lines)
