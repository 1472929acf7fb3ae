"""`dsv4gen bench`: prefill and decode tokens/s of every backend against transformers, in one run.

One checkpoint, one set of prompts, greedy. Every engine (transformers, `cpu`, each device
backend's CPU emulation) is loaded once and warmed up once; then each row times the same work on
every engine back to back, and its ratio is ours / transformers from those two measured times.
Device emulations are much slower than the devices they emulate, so by default they get fewer
prefill sizes and decode steps; the rows they skip stay in the result, marked with the reason. Then the `cpu` backend prefills the scaling checkpoint at doubling
context lengths. Nothing here asserts a speed: first greedy tokens are compared with transformers
and reported, and only a `cpu` token that contradicts a decisive transformers token fails the run.
Printing and plotting live in lib/bench/report.py.
"""
from __future__ import annotations

import gc
from pathlib import Path
from typing import Callable, NamedTuple

from lib.bench import scaling as bench_scaling
from lib.bench.engines import Ours, Peer, Timed
from lib.bench.workload import prompts as make_prompts

PEER = "transformers"
REFERENCE = "cpu"              # the backend that must agree with transformers (BRIEF §3)
DECISIVE = 1e-3                # a top-2 logit gap above fp32 noise of two implementations (~1e-5)


class Plan(NamedTuple):
    backends: tuple[str, ...]
    prefill: tuple[int, ...]            # prompt lengths for transformers and `cpu`
    device_prefill: tuple[int, ...]     # for the device emulations
    decode_batches: tuple[int, ...]
    decode_context: int                 # prompt length before the timed decode steps
    decode_steps: int                   # transformers and `cpu`
    device_decode_steps: int
    scaling: tuple[int, ...]            # `cpu` prefill lengths on the scaling checkpoint
    chunk: int = 512                    # prefill chunk (the engine's max_num_batched_tokens)
    repeats: int = 1                    # timed runs per row; the fastest is reported
    scaling_runs: int = 7               # prefills of the longest scaling length (lib/bench/scaling.py)


def _is_device(engine: str) -> bool:
    return engine not in (PEER, REFERENCE)


def _agreement(ours: list[list[int]], peer: list[list[int]]) -> tuple[int, int]:
    """(tokens equal to the peer's before each sequence's first difference, tokens compared)."""
    same = total = 0
    for a, b in zip(ours, peer):
        n = min(len(a), len(b))
        total += n
        same += next((i for i in range(n) if a[i] != b[i]), n)
    return same, total


def _measure(engine, phase: str, size: int, work: Callable[[], Timed], repeats: int, log) -> dict:
    runs = [work() for _ in range(repeats)]
    best = min(runs, key=lambda r: r.seconds)
    steps = len(best.tokens[0]) - 1 if phase == "decode" else 0
    tokens = size * steps if phase == "decode" else size          # decode: size is the batch
    row = {"engine": engine.name, "phase": phase, "size": size, "status": "ok", "tokens": tokens,
           "decode_steps": steps or None, "seconds": best.seconds, "seconds_all": [r.seconds for r in runs],
           "tokens_per_s": tokens / best.seconds, "greedy_tokens": best.tokens, "margins": best.margins}
    log(row)
    return row


def _skipped(engine: str, phase: str, size: int, reason: str, log) -> dict:
    row = {"engine": engine, "phase": phase, "size": size, "status": "skipped", "reason": reason}
    log(row)
    return row


def _warm_up(engine, plan: Plan, vocab: int) -> None:
    """One short prefill and a two-step decode (untimed) touch every program and allocator path."""
    engine.prefill(make_prompts(vocab, 1, min(64, min(plan.prefill)), seed=99)[0])
    engine.decode(make_prompts(vocab, 1, min(64, plan.decode_context), seed=98), 2)


def _rows(engines: list, plan: Plan, vocab: int, log) -> list[dict]:
    """Row by row, every engine back to back on the same prompts: a drift in the machine's load
    then moves an engine and its baseline together instead of biasing one side of a ratio."""
    rows = []
    for n, size in enumerate(plan.prefill):
        ids = make_prompts(vocab, 1, size, seed=n)[0]
        for engine in engines:
            if _is_device(engine.name) and size not in plan.device_prefill:
                rows.append(_skipped(engine.name, "prefill", size, "device emulation: only --device-prefill "
                                     f"sizes ({', '.join(map(str, plan.device_prefill))}) fit the time budget", log))
                continue
            rows.append(_measure(engine, "prefill", size, lambda: engine.prefill(ids), plan.repeats, log))
    batch_prompts = make_prompts(vocab, max(plan.decode_batches), plan.decode_context, seed=1000)
    for batch in plan.decode_batches:
        for engine in engines:
            steps = plan.device_decode_steps if _is_device(engine.name) else plan.decode_steps
            rows.append(_measure(engine, "decode", batch, lambda: engine.decode(batch_prompts[:batch], steps),
                                 plan.repeats, log))
    return rows


def _compare(rows: list[dict]) -> None:
    """Add each backend row's transformers tokens/s, ratio and greedy-token agreement, in place."""
    peer = {(r["phase"], r["size"]): r for r in rows if r["engine"] == PEER}
    for row in rows:
        base = peer.get((row["phase"], row["size"]))
        if row["engine"] == PEER or row["status"] != "ok" or base is None or base["status"] != "ok":
            continue
        row["peer_tokens_per_s"] = base["tokens_per_s"]
        row["ratio"] = row["tokens_per_s"] / base["tokens_per_s"]
        same, total = _agreement(row["greedy_tokens"], base["greedy_tokens"])
        row["agree"], row["compared"] = same, total
        first = [a[0] == b[0] for a, b in zip(row["greedy_tokens"], base["greedy_tokens"])]
        row["first_token_contradicts_decisive_peer"] = any(
            not ok and m > DECISIVE for ok, m in zip(first, base["margins"]))


def run(plan: Plan, model: Path, scaling_model: Path | None, log) -> dict:
    """Every row of the plan, then the scaling series; `log(row)` is called as each row finishes."""
    engines = [Peer(model, plan.chunk)] + [Ours(model, name, plan.chunk) for name in plan.backends]
    vocab = engines[0].model.config.vocab_size
    for engine in engines:
        _warm_up(engine, plan, vocab)
    rows = _rows(engines, plan, vocab, log)
    load_s = {engine.name: engine.load_s for engine in engines}
    for engine in engines:
        engine.close()
    del engines
    gc.collect()
    _compare(rows)
    order = {name: i for i, name in enumerate((PEER, *plan.backends))}
    rows.sort(key=lambda r: (order[r["engine"]], r["phase"] != "prefill", r["size"]))
    scaling = None
    if scaling_model and plan.scaling:
        scaling = bench_scaling.in_fresh_process(scaling_model, plan.scaling, plan.chunk, plan.scaling_runs, log)
    failures = [r for r in rows if r.get("first_token_contradicts_decisive_peer") and r["engine"] == REFERENCE]
    return {"rows": rows, "load_s": load_s, "scaling": scaling,
            "reference_agrees": not failures,
            "reference_disagreements": [f"{r['phase']} {r['size']}" for r in failures]}
