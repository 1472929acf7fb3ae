"""`dsv4gen inventory`: a real checkpoint's tensors and bytes, or its ModelSlim export's keys, from the spec alone."""
from __future__ import annotations

import json


def cmd_inventory(args) -> int:
    from lib.weights.checkpoint import summary
    from spec.variants import variant_config

    cfg = variant_config(args.variant)
    if args.msmodelslim:
        return _modelslim_inventory(args, cfg)
    result = summary(cfg)
    if args.json:
        print(json.dumps({"variant": args.variant, **result}, indent=2))
        return 0
    print(f"{args.variant}: {result['all']['tensors']:,} tensors, {result['all']['bytes']:,} bytes")
    print(f"  of which mtp.*: {result['mtp']['tensors']:,} tensors, {result['mtp']['bytes']:,} bytes")
    print("  dtypes: " + ", ".join(f"{k} {v:,}" for k, v in result["all"]["dtypes"].items()))
    return 0


def _modelslim_inventory(args, cfg) -> int:
    from spec.msmodelslim import export_inventory

    parts = export_inventory(cfg, args.msmodelslim)
    if args.json:
        print(json.dumps({"variant": args.variant, "msmodelslim": args.msmodelslim, "parts": parts}, indent=2))
        return 0
    total = sum(n for labels in parts.values() for n in labels.values())
    print(f"{args.variant} as a ModelSlim {args.msmodelslim.upper()} export: {total:,} keys")
    for part, labels in parts.items():
        detail = ", ".join(f"{label} {n:,}" for label, n in sorted(labels.items(), key=lambda kv: -kv[1]))
        print(f"  {part}: {sum(labels.values()):,} keys ({detail})")
    return 0


def add_parser(sub) -> None:
    s = sub.add_parser("inventory", help="tensor count and bytes of a real checkpoint, from the spec alone")
    s.add_argument("--variant", default="flash-0731")
    s.add_argument("--msmodelslim", choices=["w8a8", "w4a8"],
                   help="count the keys of the Ascend ModelSlim export of that quant type instead, per part and label")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_inventory)
