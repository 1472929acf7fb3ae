"""`dsv4gen capture`: export a backend's step per batch bucket and replay it against eager.

The check itself is lib/porting/capture_check.py. Bit equality with eager on unpadded batches needs
ATen's scalar-consistent kernels (docs/porting.md), which are chosen when torch starts: without
ATEN_CPU_CAPABILITY=default in its environment the command runs itself again with it set.
"""
from __future__ import annotations

import json
import os
import sys


def add_parser(sub, backend_names: list[str], model_path) -> None:
    s = sub.add_parser("capture", help="export the step as one graph per batch bucket (torch.export) and check "
                                       "its replay against eager, bit for bit")
    s.add_argument("--backend", required=True, choices=backend_names)
    s.add_argument("--model", help="checkpoint directory (default: the embedded tiny checkpoint)")
    s.add_argument("--buckets", default="1,4,16", help="batch buckets, comma-separated (default 1,4,16)")
    s.add_argument("--tokens", type=int, default=1,
                   help="new tokens per sequence per step (1: decode; 1 + draft length: a DSpark verify)")
    s.add_argument("--steps", type=int, default=8, help="replayed steps per bucket (default 8)")
    s.add_argument("--max-len", type=int, default=512, help="positions per sequence a graph reads (default 512)")
    s.add_argument("--json", action="store_true", help="print the results as JSON")
    s.set_defaults(func=lambda args: _run(args, model_path))


def _buckets(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--buckets '{text}': expected comma-separated integers such as 1,4,16") from None
    if not sizes or any(n < 1 for n in sizes):
        raise ValueError(f"--buckets '{text}': every bucket must be >= 1")
    return sizes


def _run(args, model_path) -> int:
    buckets = _buckets(args.buckets)
    if args.tokens < 1 or args.steps < 3:
        raise ValueError("capture needs --tokens >= 1 and --steps >= 3 (a mix change needs a few steps)")
    if os.environ.get("ATEN_CPU_CAPABILITY") != "default":
        env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "lib.cli.main", *sys.argv[1:]], env)
    from lib.console.stages import Stages
    from lib.porting.capture_check import check_bucket, table
    from lib.runtime.loaded_model import load_model

    stages = Stages(f"capture {args.backend}", total=1 + len(buckets))
    with stages(f"loading {args.backend}"):
        model = load_model(model_path(args), args.backend)
    checks = []
    for b in buckets:
        with stages(f"bucket {b}: export, then {args.steps} steps replayed beside eager"):
            checks.append(check_bucket(model, b, tokens=args.tokens, steps=args.steps, max_len=args.max_len))
    stages.finish()
    if args.json:
        print(json.dumps({"backend": args.backend, "checks": [{**c._asdict(), "passed": c.passed} for c in checks]},
                         indent=2))
    else:
        print(table(args.backend, checks))
        print("PASS" if all(c.passed for c in checks) else "FAIL")
    return 0 if all(c.passed for c in checks) else 1
