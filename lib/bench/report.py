"""What `dsv4gen bench` shows: progress lines, the ratio and scaling tables, bench.json and bench.png.

Formatting only: every number comes from lib/bench/runner.py's result; nothing here measures or decides.
Files are written to a temporary name and renamed, so a killed run leaves no half-written output.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


def _size(row: dict) -> str:
    return f"{row['size']} tokens" if row["phase"] in ("prefill", "scaling") else f"batch {row['size']}"


def progress_line(row: dict, elapsed: float) -> str:
    head = f"[{elapsed:6.0f} s] {row['engine']:<12} {row['phase']:<8} {_size(row):>13}"
    if row["status"] != "ok":
        return f"{head}: not run ({row['reason']})"
    steps = f", {row['decode_steps']} steps" if row.get("decode_steps") else ""
    run = f", run {row['run']}" if row.get("run") else ""
    return f"{head}: {row['tokens_per_s']:8.1f} tokens/s ({row['seconds']:.2f} s{steps}{run})"


def _agree(row: dict) -> str:
    if "agree" not in row:
        return "-"
    text = f"{row['agree']}/{row['compared']}"
    return text + (" CONTRADICTS" if row.get("first_token_contradicts_decisive_peer") else "")


HEAD = ("engine", "phase", "size", "tokens/s", "transformers tokens/s", "ratio", "greedy tokens = transformers")


def _cells(r: dict) -> tuple[str, ...]:
    if r["status"] != "ok":
        return (r["engine"], r["phase"], _size(r), "not run", "-", "-", r["reason"])
    steps = f" ({r['decode_steps']} steps)" if r.get("decode_steps") else ""
    peer = r.get("peer_tokens_per_s")
    return (r["engine"], r["phase"], _size(r) + steps, f"{r['tokens_per_s']:.1f}",
            "-" if peer is None else f"{peer:.1f}", "-" if "ratio" not in r else f"{r['ratio']:.2f}x", _agree(r))


def table(result: dict) -> str:
    """One row per (engine, phase, size); ratio = tokens/s over transformers' tokens/s on that row."""
    lines = [HEAD, *(_cells(r) for r in result["rows"])]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEAD) - 1)]   # the last column is free text
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) + "  " + line[-1] for line in lines)


def scaling_table(scaling: dict) -> str:
    """Per length: the sum of its chunks' fastest times, and the ratio per doubling from those; then
    the range of each single run's own wall-clock ratios."""
    runs = scaling["per_doubling_runs"]
    lines = [f"prefill cost vs context, backend {scaling['backend']} (target: at most "
             f"{scaling['target_per_doubling']}x per doubling)",
             f"{'tokens':>8}  {'seconds':>9}  {'tokens/s':>9}  {'x per doubling':>14}  {'single runs':>13}"]
    for i, (n, t, rate) in enumerate(zip(scaling["sizes"], scaling["seconds"], scaling["tokens_per_s"])):
        ratio = f"{scaling['per_doubling'][i - 1]:.2f}x" if i else "-"
        spread = [r[i - 1] for r in runs]
        single = f"{min(spread):.2f}-{max(spread):.2f}x" if i else "-"
        lines.append(f"{n:>8}  {t:>9.2f}  {rate:>9.1f}  {ratio:>14}  {single:>13}")
    lines.append(f"  {scaling['sizes'][0]} -> {scaling['sizes'][-1]}: {scaling['per_doubling_average']:.2f}x per "
                 f"doubling on average. Seconds: each length's {scaling['chunk']}-token chunks, the fastest of "
                 f"{len(runs)} timed {scaling['sizes'][-1]}-token prefills each (a length's prefill is the first "
                 f"chunks of the longest); single runs: each run's own wall-clock ratios")
    return "\n".join(lines)


def summary(result: dict) -> str:
    """The issue's two goals, each with its measured value: reference decode >= 5x transformers and
    prefill cost <= 2.2x per doubling of context."""
    decode = [r for r in result["rows"] if r["engine"] == "cpu" and r["phase"] == "decode" and "ratio" in r]
    lines = []
    if decode:
        ratios = ", ".join(f"{r['ratio']:.2f}x at batch {r['size']}" for r in decode)
        met = all(r["ratio"] >= 5 for r in decode)
        lines.append(f"cpu decode vs transformers: {ratios} (goal >= 5x: {'met' if met else 'NOT met'})")
    if result.get("scaling"):
        sc = result["scaling"]
        lines.append(f"cpu prefill cost per doubling of context, {sc['sizes'][0]} -> {sc['sizes'][-1]} tokens: at most "
                     f"{sc['max_per_doubling']:.2f}x at one doubling (goal <= {sc['target_per_doubling']}x: "
                     f"{'met' if sc['meets_target'] else 'NOT met'} at every doubling)")
        if sc.get("per_doubling_average"):
            lines.append(f"  on average over the {len(sc['per_doubling'])} doublings: "
                         f"{sc['per_doubling_average']:.2f}x ({'met' if sc['meets_target_on_average'] else 'NOT met'})")
    return "\n".join(lines)


def markdown(result: dict) -> str:
    """The ratio table as Markdown, for the README."""
    return "\n".join(["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD),
                      *("| " + " | ".join(_cells(r)) + " |" for r in result["rows"])])


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str) -> None:
    _atomic(path, lambda tmp: tmp.write_text(text))


def write_json(path: Path, result: dict) -> None:
    write_text(path, json.dumps(result, indent=2) + "\n")


def write_plot(path: Path, result: dict) -> None:
    """Left: each backend row's ratio to transformers (log scale, 1x marked). Right: scaling seconds
    against context on log-log axes (each run faint, the fastest chunks bold) with a linear-cost
    line through the first point."""
    import matplotlib
    matplotlib.use("Agg")                     # files only, never a window
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "ratio" in r]
    scaling = result.get("scaling")
    fig, axes = plt.subplots(1, 2 if scaling else 1, figsize=(13 if scaling else 8, 5.5), squeeze=False)
    ax = axes[0][0]
    labels = [f"{r['engine']} {r['phase']} {_size(r)}" for r in rows]
    colors = {"prefill": "tab:blue", "decode": "tab:orange"}
    ax.barh(range(len(rows)), [r["ratio"] for r in rows], color=[colors[r["phase"]] for r in rows])
    for i, r in enumerate(rows):
        ax.annotate(f"{r['ratio']:.2f}x", (r["ratio"], i), textcoords="offset points", xytext=(3, -3), fontsize=7)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_xlabel("tokens/s relative to transformers 5.23.0 (same weights; log scale)")
    ax.set_title("throughput vs transformers (blue prefill, orange decode)")
    if scaling:
        ax = axes[0][1]
        sizes, seconds = scaling["sizes"], scaling["seconds"]
        for k, run in enumerate(scaling["seconds_runs"]):
            ax.loglog(sizes, run, "-", color="tab:blue", alpha=0.25, linewidth=1,
                      label="single runs (wall clock)" if k == 0 else None)
        ax.loglog(sizes, seconds, "o-", label=f"backend {scaling['backend']}: fastest chunks")
        ax.loglog(sizes, [seconds[0] * n / sizes[0] for n in sizes], "--", color="gray", label="linear cost")
        for n, t, r in zip(sizes[1:], seconds[1:], scaling["per_doubling"]):
            ax.annotate(f"{r:.2f}x", (n, t), textcoords="offset points", xytext=(-10, 8), fontsize=8)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("prefill seconds")
        ax.set_title("prefill cost vs context (x per doubling)")
        ax.legend()
    fig.tight_layout()
    _atomic(path, lambda tmp: fig.savefig(tmp, dpi=80, format="png"))
    plt.close(fig)
