"""The `dsv4gen` command line: one subcommand per user task, each exiting non-zero on failure (B22).

Subcommands parse arguments and call into the library; errors the user can fix (bad spec,
broken checkpoint, bad arguments) print one clear message to stderr and exit with status 2. A
command that runs long announces its stages on stderr with their elapsed seconds (lib/console);
Ctrl-C prints one line and exits with status 130 (lib/cli/interrupt.py).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lib.cli.interrupt import catching_interrupts, interrupted, quiet_spawned_worker
from lib.console.stages import Stages

quiet_spawned_worker()          # a TP / EP rank re-running this script: rank 0 handles Ctrl-C (lib/cli/interrupt.py)


def _cmd_make_tiny(args) -> int:
    from lib.weights.tiny_checkpoint import make_tiny
    from spec.variants import parse_set_args

    with Stages("make-tiny")(f"writing a random checkpoint to {args.out} ({args.shards} shards)"):
        out = make_tiny(args.out, seed=args.seed, overrides=parse_set_args(args.set), shards=args.shards,
                        overwrite=args.force, progress=True, preset=args.preset,
                        variant=args.variant)
    print(f"wrote a {args.variant} checkpoint to {out}")
    return 0


def _cmd_build(args) -> int:
    from codegen.build import build, diff
    from spec.profile import backend_names

    backends = backend_names() if args.backend == "all" else [args.backend]
    failed = False
    for name in backends:
        if args.check:
            problems = diff(name)
            for p in problems:
                print(p, file=sys.stderr)
            if problems:
                print(f"generated code of backend '{name}' is out of date; run: dsv4gen build --backend {name}",
                      file=sys.stderr)
                failed = True
            else:
                print(f"{name}: generated code is up to date")
        else:
            changed = build(name)
            print(f"{name}: " + (", ".join(changed) if changed else "up to date"))
    return 1 if failed else 0


def _model_path(args, preset: str = "tiny") -> Path:
    if args.model:
        return Path(args.model)
    from lib.weights.tiny_checkpoint import embedded_tiny
    path = embedded_tiny(out=sys.stderr, preset=preset)      # says so when this call makes it (first use)
    print(f"using the embedded tiny checkpoint {path}", file=sys.stderr)
    return path


def _trained_model_path(args) -> Path:
    """--model, or the shipped trained tiny checkpoint: what task accuracy means something on."""
    if args.model:
        return Path(args.model)
    from lib.weights.tiny_checkpoint import shipped_trained
    path = shipped_trained()
    print(f"using the shipped trained tiny checkpoint {path}", file=sys.stderr)
    return path


def _load_options(args):
    from lib.weights.params import LoadOptions
    return LoadOptions(expert_mode=args.expert_mode, preconverted=args.preconverted)


def _cmd_convert(args) -> int:
    from lib.weights.expert_conversion import convert

    model = _model_path(args)
    if args.format == "msmodelslim":
        return _convert_msmodelslim(args, model)
    if args.backend is None:
        raise ValueError("--format preconverted needs --backend (the backend whose runtime format the experts are converted to)")
    with Stages(f"convert {args.backend}")(f"converting the routed experts of {model} for TP={args.tp} EP={args.ep}"):
        out = convert(model, args.backend, args.out, tp=args.tp, ep=args.ep, overwrite=args.force, progress=True)
    print(f"wrote {args.backend} routed experts for TP={args.tp} EP={args.ep} to {out}")
    return 0


def _convert_msmodelslim(args, model) -> int:
    from lib.weights import msmodelslim_writer

    if args.backend is not None or args.tp != 1 or args.ep != 1:
        raise ValueError("--format msmodelslim writes one checkpoint for every backend "
                         "and parallel layout; drop --backend / --tp / --ep")
    out = Path(args.out) if args.out else msmodelslim_writer.default_out(model, args.quant_type)
    with Stages("convert msmodelslim")(f"writing {model} as a ModelSlim {args.quant_type.upper()} checkpoint"):
        msmodelslim_writer.convert(model, out, args.quant_type, overwrite=args.force, progress=True)
    print(f"wrote a ModelSlim {args.quant_type.upper()} checkpoint of {model} to {out}")
    return 0


def _cmd_conformance(args) -> int:
    from lib.porting import conformance
    from lib.porting.faults import CATALOGUE

    if args.list_injections:
        for bug, inj in CATALOGUE.items():
            print(f"{bug}  {inj.what}  [{', '.join(inj.backends)}; {', '.join(inj.models)}]")
        return 0
    if args.backend is None:
        raise ValueError("--backend is required (accepted: ascend310p, ascend910, hip936)")
    inj = CATALOGUE.get(args.inject)
    if inj is not None and args.tp < inj.min_tp:
        raise ValueError(f"{args.inject} shows only on TP ranks past 0: add --tensor-parallel-size {inj.min_tp} "
                         "(or more) so conformance runs the ranks in their own processes")
    if inj is not None and (args.context or 0) < inj.min_context:
        raise ValueError(f"{args.inject} changes nothing before {inj.min_context} positions: add --context "
                         f"{inj.min_context} (or more)")
    if max(args.tp, args.ep) > 1:
        if args.context:
            raise ValueError("--context runs in one process: drop --tensor-parallel-size / --expert-parallel-size")
        from lib.cli.conformance_parallel import parallel_conformance
        return parallel_conformance(args)
    label = f"conformance {args.backend}" + (f" --context {args.context}" if args.context else "")
    stages = Stages(label + (f" +{args.inject}" if args.inject else ""))
    if inj is not None:
        stages.note(f"re-introducing {args.inject} for this run: {inj.what}")
    if args.context:
        from lib.porting import conformance_context

        model = _model_path(args, preset="tiny-long")
        report = conformance_context.run(args.backend, model, args.context, steps=args.steps or 8,
                                         chunk=args.prefill_chunk, inject=args.inject, expert_mode=args.expert_mode,
                                         ep_sim=args.ep_sim, stages=stages)
    else:
        from lib.porting.conformance_accuracy import default_per_task

        model = _model_path(args)
        per_task = default_per_task(model) if args.accuracy is None else args.accuracy
        if per_task < 0:
            raise ValueError(f"--accuracy must be >= 0 questions per task, got {per_task}")
        report = conformance.run(args.backend, model, steps=args.steps or 32, inject=args.inject,
                                 expert_mode=args.expert_mode, ep_sim=args.ep_sim, stages=stages, accuracy=per_task)
    stages.finish()
    print(f"conformance of backend {args.backend}" + (f" at context {args.context}" if args.context else "")
          + (f" with injected {args.inject}" if args.inject else ""))
    print(report.table())
    if args.inject is None:
        print("PASS" if report.passed else "FAIL")
        return 0 if report.passed else 1
    failed = [c.name for c in report.checks if not c.passed]
    print(f"{args.inject} detected by: {', '.join(failed)}" if failed else f"{args.inject} went UNNOTICED")
    return 0 if failed else 1


def _cmd_diff(args) -> int:
    from lib.porting.review_diff import backend_diff, spec_diff

    if args.spec:
        if not args.backend:
            raise ValueError("diff --spec OLD --against NEW needs --backend")
        sys.stdout.write(spec_diff(Path(args.spec), Path(args.against), args.backend))
    else:
        if not (args.backend and args.against):
            raise ValueError("diff needs --backend A --against B (or --spec OLD --against NEW --backend X)")
        sys.stdout.write(backend_diff(args.backend, args.against))
    return 0


def _parser() -> argparse.ArgumentParser:
    from spec.profile import backend_names

    p = argparse.ArgumentParser(prog="dsv4gen", description="Spec-driven DeepSeek-V4 compiler, runtime and porting tools.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("make-tiny", help="write a small random checkpoint in the official format")
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--preset", default="tiny",
                   help="tiny (default), trained (window 32: what train-tiny trains) or tiny-long (window 128, "
                        "compress ratios 4 / 128)")
    s.add_argument("--variant", default="tiny",
                   help="model variant at tiny widths: tiny (default; Flash's schedule), pro-tiny (Pro's) or "
                        "v41-tiny (DeepSeek-V4.1's; the cpu reference runs its backbone)")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key (JSON value)")
    s.add_argument("--shards", type=int, default=4)
    s.add_argument("--force", action="store_true", help="replace an existing non-empty output directory")
    s.set_defaults(func=_cmd_make_tiny)

    from lib.cli.inventory import add_parser as add_inventory
    add_inventory(sub)

    s = sub.add_parser("build", help="regenerate backends/<name>/_generated from spec + profile")
    s.add_argument("--backend", default="all", choices=["all", *backend_names()])
    s.add_argument("--check", action="store_true", help="fail if checked-in generated code is stale")
    s.set_defaults(func=_cmd_build)

    s = sub.add_parser("convert", help="convert routed experts once for a backend's preconverted expert mode, "
                                       "or write an Ascend ModelSlim W8A8 / W4A8 checkpoint")
    s.add_argument("--model", help="checkpoint directory (default: the embedded tiny checkpoint)")
    s.add_argument("--format", choices=["preconverted", "msmodelslim"], default="preconverted",
                   help="preconverted: a backend's routed experts (needs --backend); msmodelslim: the whole "
                        "checkpoint as ModelSlim's W8A8_DYNAMIC / W4A8_DYNAMIC export, which vllm-ascend loads")
    s.add_argument("--quant-type", choices=["w8a8", "w4a8"], default="w8a8",
                   help="msmodelslim: w8a8 (every quantised linear int8) or w4a8 (routed experts int4)")
    s.add_argument("--backend", choices=[b for b in backend_names() if b != "cpu"])
    s.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size it is loaded with (checked and recorded; experts are not TP-split)")
    s.add_argument("--ep", type=int, default=1, help="expert-parallel size: one file of routed experts per EP rank")
    s.add_argument("--out", help="output folder (default: <model>/converted-<backend>-tp<T>-ep<E>, "
                                 "msmodelslim: <model>-msmodelslim-<quant type> beside it)")
    s.add_argument("--force", action="store_true", help="replace an existing output folder")
    s.set_defaults(func=_cmd_convert)

    from lib.cli.plan import add_parser as add_plan
    add_plan(sub, backend_names())

    from lib.cli.bench import add_parser as add_bench
    add_bench(sub, backend_names())

    from lib.cli.capture import add_parser as add_capture
    add_capture(sub, backend_names(), _model_path)

    from lib.cli.evaluate import add_parser as add_eval
    add_eval(sub, backend_names(), _trained_model_path, _load_options)

    from lib.cli.train import add_parser as add_train
    add_train(sub)

    s = sub.add_parser("diff", help="review two backends' lowerings, or what a spec edit changes in one")
    s.add_argument("--backend", choices=backend_names())
    s.add_argument("--against", help="the other backend, or the NEW spec folder with --spec")
    s.add_argument("--spec", help="the OLD spec folder (compare generated code of --backend)")
    s.set_defaults(func=_cmd_diff)

    s = sub.add_parser("conformance", help="check a device backend against the cpu reference on CPU")
    s.add_argument("--backend", choices=[b for b in backend_names() if b != "cpu"])
    s.add_argument("--model", help="checkpoint directory (default: the embedded tiny checkpoint)")
    s.add_argument("--inject", help="re-introduce a catalogued field bug (see --list-injections)")
    s.add_argument("--list-injections", action="store_true")
    s.add_argument("--steps", type=int, help="teacher-forced decode steps (default 32; 8 with --context)")
    s.add_argument("--context", type=int, metavar="N",
                   help="long-context conformance: prefill N positions, then decode --steps past them (default "
                        "model: the embedded tiny-long checkpoint, window 128 and compress ratios 4 / 128)")
    s.add_argument("--prefill-chunk", type=int, default=1024, help="prefill chunk size with --context")
    s.add_argument("--ep-sim", type=int, default=2, help="expert-parallel ranks simulated in one process")
    s.add_argument("--accuracy", type=int, metavar="N",
                   help="held-out task questions per task, run on the reference and the backend (each task's accuracy "
                        "within 3 points; default 40 on a checkpoint written by train-tiny, else 0: none)")
    s.add_argument("--expert-mode", choices=["resident", "streaming", "preconverted"])
    s.add_argument("--preconverted", help="folder written by `dsv4gen convert` (default: inside --model)")
    from lib.launcher.arguments import add_parallel_arguments
    add_parallel_arguments(s)
    s.set_defaults(func=_cmd_conformance)

    sub.add_parser("serve", help="OpenAI-compatible server, same as `python -m serve` (see serve --help)")
    from lib.cli.run import add_arguments
    add_arguments(sub, backend_names(), _model_path, _load_options)
    return p


def main(argv: list[str] | None = None) -> int:
    """`dsv4gen ARGS` (argv None: this process's command line, the program itself)."""
    program, argv = argv is None, sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    with catching_interrupts(" ".join(["dsv4gen", *([command] if command else [])]), program) as outcome:
        status = _main(argv)
        if interrupted():                        # a Ctrl-C that something below caught and returned from
            raise KeyboardInterrupt
        return status
    return outcome.status


def _main(argv: list[str]) -> int:
    from lib.runtime.hostmem import keep_freed_memory

    keep_freed_memory()                          # lib/runtime/hostmem.py: before torch is imported
    from lib.weights.checkpoint import CheckpointError
    from spec.yamlio import SpecError

    if argv[:1] == ["serve"]:                    # the server owns its flags (python -m serve --help)
        from serve.cli import main as serve_main
        return serve_main(argv[1:])
    args = _parser().parse_args(argv)
    try:
        return args.func(args)
    except (SpecError, CheckpointError, FileExistsError, FileNotFoundError, ValueError) as err:
        if interrupted(err):                 # raised by the cleanup of a Ctrl-C: reported as that
            raise
        print(f"dsv4gen {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
