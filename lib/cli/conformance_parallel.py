"""`dsv4gen conformance --tensor-parallel-size T --expert-parallel-size E`: TP / EP ranks (processes this
command spawns, or torchrun's) must decode exactly like one process."""
from __future__ import annotations

from pathlib import Path

from lib.cli.main import _load_options, _model_path
from lib.console.stages import Stages


def parallel_conformance(args) -> int:
    """TP / EP ranks in their own processes must decode exactly like one process."""
    from lib.launcher import torchrun
    from lib.porting import parallel_check
    from spec.profile import load_profile

    dispatch = args.ep_dispatch or load_profile(args.backend).ep_dispatch.mode
    steps = args.steps or 32
    # under torchrun every rank runs this; ranks past 0 only take their part in each parallel job, and say nothing
    job = torchrun.environment()
    follower = job is not None and job.follower
    if not follower:
        print(f"conformance of backend {args.backend} on TP={args.tp} EP={args.ep} ({dispatch})"
              + (f" with injected {args.inject}" if args.inject else ""))
    path, options, layout = _model_path(args), _load_options(args), f"TP={args.tp} EP={args.ep} {dispatch}"
    modes, prompts = decode_modes(path), parallel_check.DEFAULT_PROMPTS
    where = "torchrun's processes" if job is not None else "their own processes"
    stages = Stages(f"conformance {args.backend} {layout}" + (f" +{args.inject}" if args.inject else ""),
                    total=2 * len(modes), enabled=not follower)
    reference, results = {}, []
    for mode in modes:               # one mode at a time, so each part is announced
        if not follower:
            with stages(f"one-process greedy reference ({mode}: {len(prompts)} prompts x {steps} tokens)"):
                reference[mode] = parallel_check.greedy_tokens(path, args.backend, prompts, steps, speculative=mode,
                                                               options=options)
        with stages(f"{max(args.tp, args.ep)} ranks in {where} ({mode}: load, then the same decode)"):
            got = parallel_check.greedy_tokens(path, args.backend, prompts, steps, tp=args.tp, ep=args.ep,
                                               dispatch=dispatch, speculative=mode, options=options, inject=args.inject)
        if not follower:
            results.append(parallel_check.Agreement(layout, mode, reference[mode], got))
    if follower:
        return 0
    stages.finish()
    for r in results:
        print(r.line())
    differ = [r for r in results if r.first_difference is not None]
    if args.inject is None:
        print("FAIL" if differ else "PASS")
        return 1 if differ else 0
    print(f"{args.inject} detected by: TP/EP greedy agreement" if differ else f"{args.inject} went UNNOTICED")
    return 0 if differ else 1


def decode_modes(path) -> tuple[str, ...]:
    """Plain decoding, and drafting with the checkpoint's own drafter where it has one (DSpark or MTP)."""
    from lib.weights.checkpoint import Checkpoint
    from spec.schedule import drafter_kind

    kind = drafter_kind(Checkpoint(path).config)
    return ("none",) if kind == "none" else ("none", kind)
