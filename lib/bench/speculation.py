"""Engine benchmark: decode throughput with and without DSpark speculation, side by side.

    python -m lib.bench.speculation [--backend cpu] [--tokens 64] [--batches 1,4,16] [--tasks T,...] [--out DIR]

Loads one checkpoint (default: the embedded tiny one) once, then for each batch size b runs greedy requests to
completion on a fresh `lib.engine.llm_engine.Engine` (`engine.generate`), in four modes. The requests (--prompts):
- `tokens` (the default on a random checkpoint without --tasks): the first b of 16 distinct prompts of 24-40 fixed
  token ids, all at once, each running to max_tokens;
- `tasks` (the default on a checkpoint written by train-tiny, or with --tasks: what its drafter learnt to draft):
  16 held-out questions of the task mix (or of the --tasks named) in the V4 chat encoding, the tasks taking turns,
  b decoding together (max_num_seqs=b), each ending at its end of sentence: every cell does the same work.

- plain:                    speculative="none"
- dspark (adaptive):        speculative="dspark", the checkpoint's own drafter, drafting while it pays and each
                            request as far as its drafts survive (the default: lib/engine/draft_policy.py)
- dspark (every step):      the same drafter with adaptive_drafting=False: a full block at every decode step
- dspark (oracle drafter):  speculative="dspark" (adaptive), but `lib.engine.drafting.propose` is patched so every
                            draft block is the target's own greedy continuation (known from a
                            reference plain run). The real drafter still runs (its cost is kept);
                            only its tokens are replaced. An upper bound: every draft is accepted.

Each cell reports generated tokens/s over the whole run (prefill included), and the decode time per token a user
sees: the requests' seconds from their first token to their last over their tokens after the first. At batch 1 that
is each request's own decoding, its prefill (the same work in every mode) left out; in a batch it also holds the
steps a request shares with the prefill chunks of requests admitted after it.

Every run's outputs must equal the plain greedy outputs of the reference run (exit 1 otherwise).
This is a benchmark, not a test: nothing here asserts a speed.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

MODES = ("plain", "dspark", "always", "oracle")
LABELS = {"plain": "plain", "dspark": "dspark (adaptive)", "always": "dspark (every step)",
          "oracle": "dspark (oracle drafter)"}
SPECULATIVE = {"plain": "none", "dspark": "dspark", "always": "dspark", "oracle": "dspark"}
DRAFTING = ("dspark", "always", "oracle")
MAX_BATCH = 16                     # EngineConfig(max_num_seqs=16): every request of a run is concurrent
N_PROMPTS = MAX_BATCH


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m lib.bench.speculation", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cpu", help="cpu | ascend310p | ascend910 | hip936 (default cpu)")
    p.add_argument("--tokens", type=int, default=64, help="max_tokens per request (default 64)")
    p.add_argument("--batches", default="1,4,16",
                   help=f"comma-separated concurrent request counts, each 1..{MAX_BATCH} (default 1,4,16)")
    p.add_argument("--checkpoint", default=None, help="checkpoint folder (default: the embedded tiny checkpoint)")
    p.add_argument("--prompts", choices=("tokens", "tasks"), default=None,
                   help="fixed token ids, or held-out task-mix questions (default: tasks on a checkpoint written by "
                        "train-tiny, else tokens)")
    p.add_argument("--tasks", default=None,
                   help="comma-separated tasks whose questions to ask (implies --prompts tasks; default: all of them)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs per cell; the fastest is reported, every wall time is kept (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--out", default=None, help="write DIR/engine-bench.json (default: no file)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = p.parse_args(argv)
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        p.error(f"--batches {args.batches!r}: expected comma-separated integers such as 1,4,16")
    if not args.batches or any(not 1 <= b <= MAX_BATCH for b in args.batches):
        p.error(f"--batches: each batch size must be in 1..{MAX_BATCH}")
    if args.tokens < 1:
        p.error("--tokens must be >= 1")
    if args.tasks is not None:
        from lib.evaluation.tasks import TASKS
        args.tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
        unknown = [t for t in args.tasks if t not in TASKS]
        if not args.tasks or unknown:
            p.error(f"--tasks: unknown task(s) {', '.join(unknown) or '(none given)'} (accepted: {', '.join(TASKS)})")
        if args.prompts == "tokens":
            p.error("--tasks asks task questions: it does not go with --prompts tokens")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    return args


def make_prompts(cfg, n: int = N_PROMPTS) -> list[list[int]]:
    """n distinct prompts of distinct lengths 24..40 (7 is coprime to 17), fixed token ids, no specials."""
    special = {cfg.bos_token_id, cfg.eos_token_id, cfg.dspark_noise_token_id}
    usable = [t for t in range(16, cfg.vocab_size) if t not in special]
    prompts = []
    for i in range(n):
        length = 24 + (7 * i) % 17
        prompts.append([usable[(i * 131 + j * 37 + (j * j) % 11) % len(usable)] for j in range(length)])
    return prompts


def task_prompts(tok, cfg, n: int = N_PROMPTS, tasks: tuple[str, ...] | None = None) -> list[list[int]]:
    """n held-out questions of `tasks` (default: the whole task mix) in the V4 chat encoding, the tasks taking
    turns."""
    from lib.evaluation import suite
    from lib.evaluation.tasks import TASKS

    tasks = tasks or TASKS
    per_task = -(-n // len(tasks))
    exs = suite.heldout_for(cfg, tok, tasks, per_task)
    turns = [exs[t * per_task + i] for i in range(per_task) for t in range(len(tasks))][:n]
    return [tok.encode(suite.prompt_text(ex)) for ex in turns]


# ---- the oracle drafter ---------------------------------------------------------------------------
def oracle_drafter(references: dict[tuple[int, ...], list[int]]):
    """An engine drafter that proposes the target's own greedy continuation of each request.

    It runs the checkpoint's DSpark drafter first (so its cost stays in the timing), then replaces
    each row by the request's prompt + reference output after the anchor, after checking the
    row's anchor position and token against the request."""
    from lib.engine import drafting as dspark
    from lib.engine.llm_engine import dspark_drafter

    def drafter(model, requests, rings, choose):
        block = dspark_drafter(model, requests, rings, choose)            # keep the drafter's cost
        gamma, vocab = block.tokens.shape[1], model.cfg.vocab_size
        noise = model.cfg.dspark_noise_token_id
        anchors, starts = [r.output[-1] for r in requests], [r.computed for r in requests]
        rows = []
        for req, anchor, start in zip(requests, anchors, starts):
            full = req.prompt + references[tuple(req.prompt)]
            if req.computed != start or full[start] != anchor:
                raise RuntimeError(f"oracle drafter: row for {req.id} (anchor {anchor} at {start}) does not match "
                                   f"its request (computed {req.computed}, reference token "
                                   f"{full[start] if start < len(full) else None})")
            ahead = full[start + 1: start + 1 + gamma]
            rows.append(ahead + [noise] * (gamma - len(ahead)))  # past max_tokens: never verified
        tokens = torch.tensor(rows, dtype=torch.int64)
        probs = torch.zeros(*tokens.shape, vocab).scatter_(-1, tokens.unsqueeze(-1), 1.0)  # one-hot: deterministic
        return dspark.DraftBlock(tokens, probs, block.confidence)

    return drafter


# ---- one run ---------------------------------------------------------------------------------------
def run_once(model, prompts: list[list[int]], tokens: int, mode: str, references=None, tokenizer=None,
             concurrency: int | None = None) -> dict:
    """One engine run of `prompts`, at most `concurrency` decoding together (default: all of them); with a
    `tokenizer` each request also ends at its end of sentence (else at max_tokens)."""
    from lib.engine.llm_engine import Engine, EngineConfig
    from lib.engine.sampling import SamplingParams

    config = EngineConfig(max_num_seqs=concurrency or MAX_BATCH, max_num_batched_tokens=512, speculative=SPECULATIVE[mode],
                          adaptive_drafting=mode != "always")
    oracle = {"drafter": oracle_drafter(references)} if mode == "oracle" else {}
    engine = Engine(model, config, tokenizer=tokenizer, **oracle)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    steps = 0
    real_step = engine.step

    def step():
        nonlocal steps
        outputs = real_step()
        now = time.perf_counter()
        steps += 1
        for o in outputs:
            if o.new_tokens:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
        return outputs

    engine.step = step
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, SamplingParams(max_tokens=tokens))
    wall = time.perf_counter() - t0
    generated = sum(len(r.output) for r in reqs)
    ttft = [first[r.id] - t0 for r in reqs]
    # decoding as each request's user sees it, prefill left out: the seconds from its first token to its last, over
    # the tokens after its first. Summed over the requests before dividing, so a reply of two tokens (a round that
    # drafted in vain) counts for one token, not as much as a reply of forty.
    decode_s = sum(last[r.id] - first[r.id] for r in reqs)
    decode_tokens = sum(len(r.output) - 1 for r in reqs)
    drafted, accepted = list(engine.drafted), list(engine.accepted)
    per_step = sum(accepted) / drafted[0] if drafted and drafted[0] else None
    return {
        "mode": mode, "label": LABELS[mode], "speculative": SPECULATIVE[mode],
        "batch": concurrency or len(prompts), "requests": len(prompts),
        "max_tokens": tokens, "generated_tokens": generated, "wall_s": wall, "tokens_per_s": generated / wall,
        "ttft_mean_s": sum(ttft) / len(ttft), "ttft_s": ttft,
        "decode_s": decode_s, "decode_tokens": decode_tokens,
        "decode_s_per_token": decode_s / decode_tokens if decode_tokens else None, "engine_steps": steps,
        "gamma": engine.gamma, "drafted": drafted, "accepted": accepted,
        "dspark_steps": drafted[0] if drafted else 0,
        "mean_accepted_per_dspark_step": per_step,
        "tokens_per_target_forward": 1.0 if per_step is None else 1.0 + per_step,
        "finish_reasons": sorted({r.finish_reason for r in reqs}),
        "outputs": [list(r.output) for r in reqs],
    }


def check_lossless(run: dict, prompts: list[list[int]], references) -> str | None:
    """None if every output equals the plain greedy reference, else what differs first."""
    for i, (prompt, out) in enumerate(zip(prompts, run["outputs"])):
        ref = references[tuple(prompt)]
        if out != ref:
            at = next((k for k, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
            return (f"{run['label']} batch {run['batch']}: request {i} (prompt of {len(prompt)} tokens) differs "
                    f"from the plain greedy reference at output token {at}: got {out[at:at + 4]}, "
                    f"expected {ref[at:at + 4]} (lengths {len(out)} / {len(ref)})")
    return None


def _ratio(plain: float | None, mode: float | None) -> float | None:
    return None if plain is None or not mode else plain / mode


# ---- report ----------------------------------------------------------------------------------------
def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def table(result: dict) -> str:
    batches = result["batches"]
    cell = {(r["mode"], r["batch"]): r for r in result["runs"]}
    width = max(len(v) for v in LABELS.values()) + 4
    head = "".ljust(width) + "".join(f"{'batch ' + str(b):>12}" for b in batches)
    lines = []

    def section(title, modes, value, spec, suffix=""):
        lines.append(title)
        for m in modes:
            lines.append(("  " + LABELS[m]).ljust(width)
                         + "".join(f"{_fmt(value(m, b), spec, suffix):>12}" for b in batches))

    lines.append(head)
    section("generated tokens/s (wall clock, prefill included)", MODES,
            lambda m, b: cell[m, b]["tokens_per_s"], ".1f")
    section("ratio to plain tokens/s", DRAFTING,
            lambda m, b: result["speedup"][m][str(b)], ".2f", "x")
    section("time to first token, mean ms", MODES, lambda m, b: 1e3 * cell[m, b]["ttft_mean_s"], ".0f")
    section("decode ms per token after each request's first (prefill left out)", MODES,
            lambda m, b: None if cell[m, b]["decode_s_per_token"] is None else 1e3 * cell[m, b]["decode_s_per_token"],
            ".1f")
    section("ratio of plain decode ms per token to DSpark's", DRAFTING,
            lambda m, b: result["decode_speedup"][m][str(b)], ".2f", "x")
    section(f"accepted drafts per DSpark step (mean, of gamma={result['gamma']})", DRAFTING,
            lambda m, b: cell[m, b]["mean_accepted_per_dspark_step"], ".2f")
    section("tokens per target forward (per request)", MODES,
            lambda m, b: cell[m, b]["tokens_per_target_forward"], ".2f")
    section("engine steps (batched target forwards)", MODES, lambda m, b: cell[m, b]["engine_steps"], "d")
    section("wall s", MODES, lambda m, b: cell[m, b]["wall_s"], ".2f")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    env = "".join(f"{k}={shlex.quote(os.environ[k])} " for k in ("OMP_NUM_THREADS",) if k in os.environ)
    command = env + "python -m lib.bench.speculation" + ("" if not argv else " " + shlex.join(argv))
    print(f"$ {command}", flush=True)
    args = parse_args(argv)
    previous_threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, argv, command)
    finally:                                    # main() may run inside another process (tests)
        torch.set_num_threads(previous_threads)


def _run(args: argparse.Namespace, argv: list[str], command: str) -> int:
    from tqdm import tqdm
    from lib.runtime.loaded_model import load_model
    from lib.text.tokenizer import Tokenizer
    from lib.weights.tiny_checkpoint import embedded_tiny, trained_on_task_mix

    started = time.perf_counter()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    path = Path(args.checkpoint) if args.checkpoint else embedded_tiny()
    t0 = time.perf_counter()
    model = load_model(path, args.backend)
    load_s = time.perf_counter() - t0
    trained = trained_on_task_mix(path)
    args.prompts = args.prompts or ("tasks" if trained or args.tasks else "tokens")
    tok = Tokenizer.from_dir(path) if args.prompts == "tasks" else None     # task questions end where they answer
    prompts = task_prompts(tok, model.cfg, tasks=args.tasks) if tok is not None else make_prompts(model.cfg)
    lengths = [len(p) for p in prompts]
    print(f"checkpoint {path}{' (embedded tiny)' if not args.checkpoint else ''}; backend {args.backend} "
          f"(compute {str(model.state_dtype).removeprefix('torch.')}); torch {torch.__version__}; "
          f"threads {torch.get_num_threads()}; python {platform.python_version()}", flush=True)
    what = (f"held-out {'task-mix' if not args.tasks else '/'.join(args.tasks)} questions" if args.prompts == "tasks"
            else "distinct prompts")
    print(f"requests: greedy, max_tokens {args.tokens}, {what} of {min(lengths)}-{max(lengths)} tokens; "
          f"EngineConfig(max_num_seqs={MAX_BATCH}, max_num_batched_tokens=512); model load {load_s:.2f} s "
          "(excluded)", flush=True)

    # The reference (plain greedy outputs of every prompt the runs use) doubles as the warm-up;
    # a short DSpark run warms the drafter programs.
    # token prompts: batch b = the first b prompts at once; task questions: batch b = all of them, b at a time
    # (their replies run from 2 to 70 tokens, so the first b alone would measure whichever tasks come first)
    n_ref = N_PROMPTS if tok is not None else max(args.batches)
    t0 = time.perf_counter()
    reference = run_once(model, prompts[:n_ref], args.tokens, "plain", tokenizer=tok)
    reference_s = time.perf_counter() - t0
    references = {tuple(p): out for p, out in zip(prompts[:n_ref], reference["outputs"])}
    run_once(model, prompts[:1], min(args.tokens, 4), "dspark", tokenizer=tok)

    runs, failures = [], []
    # each repeat runs every mode once, in turn: fairer when the machine's speed drifts
    jobs = [(b, m) for b in args.batches for _ in range(args.repeats) for m in MODES]
    tries: dict[tuple[str, int], list[dict]] = {}
    for b, m in tqdm(jobs, desc="engine runs", unit="run", disable=args.no_progress, file=sys.stderr):
        asked = prompts if tok is not None else prompts[:b]
        run = run_once(model, asked, args.tokens, m, references, tok, concurrency=b)
        problem = check_lossless(run, asked, references)
        run["lossless"] = problem is None
        if problem:
            failures.append(problem)
        tries.setdefault((m, b), []).append(run)
    for cell_tries in tries.values():
        best = dict(min(cell_tries, key=lambda r: r["wall_s"]))
        best["lossless"] = all(r["lossless"] for r in cell_tries)
        best["repeats"] = len(cell_tries)
        best["wall_s_all"] = [r["wall_s"] for r in cell_tries]
        best["tokens_per_s_all"] = [r["tokens_per_s"] for r in cell_tries]
        best["ttft_mean_s_all"] = [r["ttft_mean_s"] for r in cell_tries]
        best["decode_s_per_token_all"] = [r["decode_s_per_token"] for r in cell_tries]
        runs.append(best)

    gamma = next((r["gamma"] for r in runs if r["gamma"]), 0)
    cell = {(r["mode"], r["batch"]): r for r in runs}
    speedup = {m: {str(b): cell[m, b]["tokens_per_s"] / cell["plain", b]["tokens_per_s"] for b in args.batches}
               for m in DRAFTING}
    decode_speedup = {m: {str(b): _ratio(cell["plain", b]["decode_s_per_token"], cell[m, b]["decode_s_per_token"])
                          for b in args.batches} for m in DRAFTING}
    result = {
        "command": command, "argv": argv, "backend": args.backend, "checkpoint": str(path),
        "embedded_tiny": not args.checkpoint, "prompts": args.prompts, "tasks": list(args.tasks or ()),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"), "python": platform.python_version(),
        "platform": platform.platform(), "cpu_count": os.cpu_count(), "compute_dtype": str(model.state_dtype),
        "max_tokens": args.tokens, "batches": args.batches, "repeats": args.repeats, "gamma": gamma, "prompt_lengths": lengths[:n_ref],
        "engine_config": {"max_num_seqs": MAX_BATCH, "max_num_batched_tokens": 512},
        "load_average_1m_before": load_before,
        "load_average_1m_after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "model_load_s": load_s, "reference_run_s": reference_s,
        "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs],
        "speedup": speedup, "decode_speedup": decode_speedup, "lossless": not failures, "lossless_failures": failures,
    }
    result["total_wall_s"] = time.perf_counter() - started

    print()
    print(table(result))
    print()
    print("notes:")
    per_cell = "one run per cell" if args.repeats == 1 else f"the fastest of {args.repeats} runs per cell"
    print("  - tokens/s = generated tokens / wall clock from submitting all requests to the last finishing")
    print(f"    ({per_cell}; model load excluded, prefill included); time to first token is from submission;")
    print("    decode ms per token = the requests' seconds from first token to last / their tokens after the first")
    print("    (the cell's fastest run): what speculation changes, prefill being the same work in every mode.")
    if not trained:
        print("  - this checkpoint's drafter is not trained, so real DSpark acceptance is near zero: the 'every step'")
        print("    row measures drafting + verification overhead, the 'adaptive' row how much of it the engine")
        print("    avoids by stepping aside (a probe of drafting now and then, lib/engine/draft_policy.py).")
    print("  - 'dspark (oracle drafter)' proposes the target's own greedy continuation (from a plain reference run):")
    print("    every draft is accepted, an upper bound of what the machinery yields. The real drafter still runs")
    print("    for its cost; only its proposed tokens are replaced.")
    busy = load_before is not None and load_before + torch.get_num_threads() > (os.cpu_count() or 1) + 0.5
    if busy:
        threads = torch.get_num_threads()
        print(f"  - WARNING: the machine was busy (1-minute load {load_before:.1f} on {os.cpu_count()} cores, "
              f"{threads} torch thread{'s' if threads > 1 else ''}): the numbers are noisy"
              + ("; oversubscribed threads can be several times\n    slower, try OMP_NUM_THREADS=1 or --threads 1."
                 if threads > 1 else "."))
    if failures:
        print(f"lossless: FAILED, {len(failures)} of {len(jobs)} runs differ from the plain greedy outputs:")
        for f in failures:
            print(f"  {f}")
    else:
        print(f"lossless: yes, all {len(jobs)} runs' outputs equal the plain greedy outputs (reference: plain, "
              f"batch {n_ref})")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "engine-bench.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {out / 'engine-bench.json'}")
    print(f"total {result['total_wall_s']:.1f} s")
    if failures:
        print("engine benchmark: speculative outputs are NOT lossless (see above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
