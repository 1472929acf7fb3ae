"""`dsv4gen run` and `dsv4gen logits`: generation through the engine, and raw logits to .npy.

`run` drives the same engine the server uses (paged cache, scheduler, DSpark drafting), so what
it prints is what a served request would return for the same sampling settings.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lib.console.stages import Stages
from lib.launcher.arguments import add_parallel_arguments, launch_spec


def add_arguments(sub, backend_names: list[str], model_path, load_options) -> None:
    for name, helptext, func in (("run", "generate from a prompt through the engine (DSpark by default)", cmd_run),
                                 ("logits", "fp32 logits of every position, saved as .npy", cmd_logits)):
        s = sub.add_parser(name, help=helptext)
        s.add_argument("--model", help="checkpoint directory (default: the embedded tiny checkpoint)")
        s.add_argument("--backend", default="cpu", choices=backend_names)
        s.add_argument("--expert-mode", choices=["resident", "streaming", "preconverted"],
                       help="how routed experts are held (ascend310p)")
        s.add_argument("--preconverted", help="folder written by `dsv4gen convert` (default: inside --model)")
        if name == "run":
            s.add_argument("--prompt", required=True)
            s.add_argument("--max-tokens", type=int, default=32)
            s.add_argument("--raw", action="store_true", help="send the prompt as is, without the V4 chat encoding")
            s.add_argument("--speculative", choices=["dspark", "mtp", "deepseek_mtp", "none"],
                           help="drafting (default: the checkpoint's own drafter, DSpark or MTP)")
            s.add_argument("--num-speculative-tokens", type=int,
                           help="drafts per round (default: DSpark's block; one MTP step, chained when more)")
            s.add_argument("--adaptive-drafting", action=argparse.BooleanOptionalAction, default=True,
                           help="draft only while it pays (default); --no-adaptive-drafting: a full block every step")
            s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
            s.add_argument("--top-p", type=float, default=1.0)
            s.add_argument("--top-k", type=int, default=0)
            s.add_argument("--seed", type=int, help="sampling seed (reproducible output at temperature > 0)")
            s.add_argument("--stats", action="store_true", help="print drafted / accepted counts per draft position")
            s.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                           help="never replay captured step graphs (default: graphs where the device has a graph "
                                "API, eager on the CPU emulation; --no-enforce-eager captures there too)")
            add_parallel_arguments(s)
        else:
            s.add_argument("--ids", required=True, help="comma-separated token ids")
            s.add_argument("--out", required=True, help="output .npy file")
        s.set_defaults(func=func, model_path=model_path, load_options=load_options)


def cmd_run(args) -> int:
    from lib.text.chat_encoding import encode_messages
    from lib.engine.llm_engine import EngineConfig
    from lib.launcher import torchrun
    from lib.launcher.ranks import ReplicatedEngine, launch
    from lib.engine.sampling import SamplingParams
    from lib.text.tokenizer import Tokenizer

    path = args.model_path(args)
    tok = Tokenizer.from_dir(path)
    spec = launch_spec(args, path, EngineConfig(max_num_seqs=1, speculative=args.speculative or "auto",
                                                         enforce_eager=args.enforce_eager,
                                                         adaptive_drafting=args.adaptive_drafting,
                                                         num_speculative_tokens=args.num_speculative_tokens))
    layout = f", TP={spec.tp} EP={spec.ep} in {max(spec.tp, spec.ep)} processes" if max(spec.tp, spec.ep) > 1 else ""
    job = torchrun.environment()
    # under torchrun only rank 0 says anything: the others' launch() follows rank 0, then exits
    with Stages(f"run {args.backend}", enabled=job is None or not job.follower)(f"loading {path}{layout}"):
        engine = launch(spec)
    try:
        return _generate(args, engine, tok, encode_messages, SamplingParams)
    finally:
        if isinstance(engine, ReplicatedEngine):
            engine.close()


def _generate(args, engine, tok, encode_messages, SamplingParams) -> int:
    text = args.prompt if args.raw else encode_messages([{"role": "user", "content": args.prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    rid = engine.add_request(tok.encode(text), params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
                if out.error:
                    raise ValueError(out.error)
    sys.stdout.write("\n")
    if args.stats:
        req = engine.requests[rid]
        mode = engine.method or "none"
        print(f"speculative: {mode}; emitted {len(req.output)} tokens, finish reason {req.finish_reason}",
              file=sys.stderr)
        if engine.speculative:
            rounds = req.drafted[0] if req.drafted else 0
            per = ", ".join(f"{a}/{d}" for a, d in zip(req.accepted, req.drafted))
            mean = sum(req.accepted) / rounds if rounds else 0.0
            print(f"draft rounds {rounds}; accepted/drafted per position: {per}; "
                  f"mean accepted per round {mean:.2f}", file=sys.stderr)
        graphs = getattr(engine, "graphs", None)
        if graphs is not None:
            print(f"graph mode: {graphs.replayed} steps replayed captured graphs, {graphs.eager} ran eagerly",
                  file=sys.stderr)
    return 0


def cmd_logits(args) -> int:
    import numpy as np

    from lib.engine.greedy import all_logits
    from lib.runtime.loaded_model import load_model

    try:
        ids = [int(x) for x in args.ids.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--ids must be comma-separated integers, got '{args.ids}'") from None
    path, stages = args.model_path(args), Stages(f"logits {args.backend}", total=2)
    with stages(f"loading {path}"):
        model = load_model(path, backend=args.backend, progress=True, options=args.load_options(args))
    with stages(f"fp32 logits of {len(ids)} positions"):
        logits = all_logits(model, ids).numpy()
    out = Path(args.out)
    tmp = out.with_name(f".{out.name}.tmp.npy")
    np.save(tmp, logits)
    tmp.replace(out)
    print(f"wrote logits {list(logits.shape)} float32 to {out}")
    return 0
