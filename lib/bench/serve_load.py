"""Bounded load benchmark of the OpenAI-compatible server (a benchmark, not a test).

Starts the real server (the `python -m serve` build path) on a free local port, then at each
concurrency level keeps that many streaming /v1/chat/completions requests in flight until a fixed
number have finished, and prints aggregate generated tokens/s, time to first token and time per
output token, all measured by the client over HTTP in one run. The requests are chat turns asking
for a difference of two numbers: the trained tiny checkpoint answers them with visible text past 32
tokens (its worked digit steps), so the first and last streamed text are the first and last tokens;
to a raw-text prompt it answers with end-of-sentence tokens, which `ignore_eos` keeps generating
and the stream does not show.

    python -m lib.bench.serve_load [--concurrency 1,4,16] [--requests-per-level 2] [--max-tokens 32]
                               [--speculative dspark|none] [--model DIR] [--out DIR]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx


async def _one(http: httpx.AsyncClient, model: str, question: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start, first, last, tokens = time.perf_counter(), None, None, 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    tpot = (last - first) / (tokens - 1) if tokens > 1 and first is not None else 0.0
    return {"ttft": (first or time.perf_counter()) - start, "tpot": tpot, "tokens": tokens}


async def _level(url: str, model: str, concurrency: int, total: int, max_tokens: int) -> dict:
    prompts = iter(f"What is {90 - i % 37}-{17 + i % 23}?" for i in range(total))
    results: list[dict] = []

    async def worker(http):
        for prompt in prompts:
            results.append(await _one(http, model, prompt, max_tokens))

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(concurrency)))
        wall = time.perf_counter() - start
    ttft = sorted(r["ttft"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "generated_tokens": sum(r["tokens"] for r in results),
            "wall_s": wall, "tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50_s": statistics.median(ttft), "ttft_p95_s": ttft[min(len(ttft) - 1, int(0.95 * len(ttft)))],
            "tpot_mean_s": statistics.fmean(r["tpot"] for r in results)}


def main(argv: list[str] | None = None) -> int:
    from serve.cli import prepare, run_in_thread

    p = argparse.ArgumentParser(prog="python -m lib.bench.serve_load", description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests-per-level", type=int, default=2, help="requests per concurrent client")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--speculative", choices=["dspark", "none"], default="none")
    p.add_argument("--model", help="checkpoint directory (default: the shipped trained tiny checkpoint)")
    p.add_argument("--backend", default="cpu")
    p.add_argument("--out", help="folder for serve_bench.json")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    flags = ["--port", "0", "--backend", args.backend, "--speculative", args.speculative,
             "--max-num-seqs", str(max(levels))] + (["--model", args.model] if args.model else [])
    prepared = prepare(flags)
    server, thread = run_in_thread(prepared)
    model = prepared.context.model_name
    try:
        asyncio.run(_level(prepared.url, model, 1, 1, 4))              # warm-up, not reported
        rows = [asyncio.run(_level(prepared.url, model, c, c * args.requests_per_level, args.max_tokens))
                for c in levels]
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    print(f"\nserver load benchmark: backend {args.backend}, speculative {args.speculative}, "
          f"{args.max_tokens} tokens per request, streaming /v1/chat/completions over HTTP")
    print("| concurrency | requests | generated tok/s | TTFT p50 | TTFT p95 | time per output token |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['requests']} | {r['tokens_per_s']:.1f} | {r['ttft_p50_s'] * 1e3:.0f} ms | "
              f"{r['ttft_p95_s'] * 1e3:.0f} ms | {r['tpot_mean_s'] * 1e3:.1f} ms |")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "serve_bench.json").write_text(json.dumps({"args": vars(args), "levels": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
