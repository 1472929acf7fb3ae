"""`dsv4gen eval`: held-out exact-match accuracy per task through the engine, with and without DSpark.

The suite is lib/evaluation: arithmetic, counting, copying, the made-up fact table, long-range retrieval (the asked
record --gap-windows sliding windows before the question) and tool calls. Every run is greedy, so the DSpark run must
reply exactly as the plain one; the JSON says whether it did, and DSpark's acceptance per draft position (the DSpark
run drafts a full block every step, so that every position is measured).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from lib.console.stages import Stages

RUNS = {"both": ("plain", "dspark"), "dspark": ("dspark",), "none": ("plain",)}


def add_parser(sub, backend_names: list[str], model_path, load_options) -> None:
    from lib.evaluation.suite import GAP_WINDOWS
    from lib.evaluation.tasks import TASKS

    s = sub.add_parser("eval", help="held-out task accuracy through the engine (exact match), with and without DSpark")
    s.add_argument("--backend", default="cpu", choices=backend_names)
    s.add_argument("--model", help="checkpoint directory (default: the shipped trained tiny checkpoint)")
    s.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated tasks (default: all of {', '.join(TASKS)})")
    s.add_argument("--per-task", type=int, default=20, help="held-out questions per task (default 20)")
    s.add_argument("--seed", type=int, default=0, help="which held-out questions (default 0)")
    s.add_argument("--speculative", choices=sorted(RUNS), default="both",
                   help="both (default, where the checkpoint has a DSpark drafter): a plain run and a DSpark run")
    s.add_argument("--gap-windows", type=int, default=GAP_WINDOWS,
                   help=f"retrieval: sliding windows between the asked record and the question (default {GAP_WINDOWS})")
    s.add_argument("--max-num-seqs", type=int, default=8, help="requests decoding together (default 8)")
    s.add_argument("--max-num-batched-tokens", type=int, default=256,
                   help="tokens per step; longer prompts are prefilled in chunks (default 256)")
    s.add_argument("--expert-mode", choices=["resident", "streaming", "preconverted"])
    s.add_argument("--preconverted", help="folder written by `dsv4gen convert` (default: inside --model)")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.add_argument("--out", help="also write the JSON report to this file")
    s.add_argument("--log-samples", metavar="FILE",
                   help="also write every question with its expected and generated reply, a JSON line each")
    s.set_defaults(func=lambda args: _run(args, model_path, load_options))


def _tasks(text: str) -> tuple[str, ...]:
    from lib.evaluation.tasks import TASKS

    tasks = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise ValueError(f"--tasks '{text}': unknown task(s) {bad}; the tasks are {', '.join(TASKS)}")
    return tasks


def _run(args, model_path, load_options) -> int:
    from tqdm import tqdm

    from lib.bench import report as files        # whole files or none (written beside, renamed over)
    from lib.engine.llm_engine import Engine, EngineConfig
    from lib.evaluation import suite
    from lib.runtime.loaded_model import load_model
    from lib.text.tokenizer import Tokenizer
    from spec.schedule import drafter_kind

    tasks = _tasks(args.tasks)
    for flag in ("per_task", "gap_windows", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    for flag in ("out", "log_samples"):          # checked before the run, not after it
        value = getattr(args, flag)
        if value and not Path(value).parent.is_dir():
            raise ValueError(f"--{flag.replace('_', '-')} {value}: no folder {Path(value).parent} to write it in")
    path = model_path(args)
    tok = Tokenizer.from_dir(path)
    stages = Stages(f"eval {args.backend}")
    with stages(f"loading {path}"):
        model = load_model(path, backend=args.backend, progress=True, options=load_options(args))
    wanted = RUNS[args.speculative]
    if "dspark" in wanted and drafter_kind(model.cfg) != "dspark":
        if args.speculative == "dspark":
            raise ValueError(f"--speculative dspark: {path} has no DSpark drafter")
        wanted = ("plain",)
    gap = args.gap_windows * model.cfg.sliding_window
    exs = suite.heldout_for(model.cfg, tok, tasks, args.per_task, args.seed, args.gap_windows)
    runs = {}
    for name in wanted:
        # a full block every step: every draft position's acceptance is measured (adaptive drafting would cut blocks)
        config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                              speculative="dspark" if name == "dspark" else "none", adaptive_drafting=False)
        engine = Engine(model, config, tokenizer=tok)
        with stages(f"{len(exs)} held-out questions, {name}"), \
                tqdm(total=len(exs), desc=f"eval {name}", unit="question", file=sys.stderr) as bar:
            runs[name] = suite.run(engine, tok, exs, progress=bar)
    result = suite.report(runs, backend=args.backend, model=str(path), seed=args.seed, per_task=args.per_task,
                          retrieval_gap_tokens=gap)
    if args.out:
        files.write_json(Path(args.out), result)
    if args.log_samples:
        files.write_text(Path(args.log_samples), "".join(json.dumps(line) + "\n" for line in suite.samples(runs)))
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0


def format_report(result: dict) -> str:
    runs = result["runs"]
    names = list(runs)
    lines = [f"eval on {result['backend']}: {result['model']} (held-out seed {result['seed']}, exact match)",
             f"  {'task':<12}" + "".join(f"{n:>14}" for n in names)]
    for task in next(iter(runs.values()))["accuracy"]:
        cells = [runs[n]["accuracy"][task] for n in names]
        lines.append(f"  {task:<12}" + "".join(f"{c['correct']:>5}/{c['examples']:<3} {c['accuracy']:>4.0%}" for c in cells))
    for n in names:
        spec = runs[n]["speculation"]
        tail = "" if spec is None else (
            f"; DSpark {spec['rounds']} rounds, mean accepted {spec['mean_accepted_per_round']:.2f} per round, per position "
            + " ".join("-" if a is None else f"{a:.2f}" for a in spec["accepted_per_position"]))
        lines.append(f"  {n}: {runs[n]['generated_tokens']} tokens in {runs[n]['seconds']} s{tail}")
    if "identical_replies" in result:
        lines.append(f"  replies identical with and without DSpark: {'yes' if result['identical_replies'] else 'NO'}")
    return "\n".join(lines)


