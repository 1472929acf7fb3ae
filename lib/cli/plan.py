"""`dsv4gen plan`: predicted memory and decode speed of a deployment on a real device, and `--ops`.

Parses the arguments, lets lib/planner/plan.py refuse what the spec or profile cannot honour (a
ValueError becomes one message and exit status 2 in lib/cli/main.py), and prints the plan as a table
or, with --json, as the JSON lib/planner/plan.py lays out. A plan that does not fit is still a plan:
it prints with "DOES NOT FIT: <reason>" and a warning on stderr, and exits 0 unless --check asks for
status 1 (as `dsv4gen build --check` does for stale code). Knows formatting, not arithmetic.
"""
from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path

GIB = 1 << 30
_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def parse_bytes(text: str) -> int:
    """'134217728', '128MiB', '4GiB', '48GB' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"cannot read '{text}' as a size (examples: 134217728, 128MiB, 4GiB, 48GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _size(text: str) -> int:
    import argparse
    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_parser(sub, backend_names: list[str]) -> None:
    s = sub.add_parser("plan", help="memory and decode speed of a deployment on a real device, from the spec and "
                                    "the backend profile (--ops: launches per decode step)")
    s.add_argument("--backend", default="all", choices=["all", *backend_names])
    s.add_argument("--ops", action="store_true", help="count kernel launches and host syncs of one decode step")
    s.add_argument("--record", action="store_true",
                   help="with --ops: keep the counts in data/decode-launches.json for the speed planner")
    s.add_argument("--batch", type=int, default=1,
                   help="with --ops: sequences stepping together (each prefilled, then one decode step of all)")
    s.add_argument("--model", help="with --ops: checkpoint to count on (default: Flash-0731's schedule, widths shrunk)")
    s.add_argument("--variant", default="flash-0731", help="model variant (spec/models)")
    s.add_argument("--devices", type=int,
                   help="devices in all (default: --nodes x --devices-per-node, 8 per node)")
    s.add_argument("--nodes", "--nnodes", dest="nodes", type=int, default=1,
                   help="nodes the devices are spread over evenly (torchrun's --nnodes)")
    s.add_argument("--devices-per-node", "--nproc-per-node", dest="devices_per_node", type=int,
                   help="devices (ranks) per node (torchrun's --nproc-per-node; default: --devices / --nodes, or 8)")
    s.add_argument("--tp", type=int, help="tensor-parallel size of attention and the dense layers (default: "
                                          "--devices); less than --devices plans devices / TP data-parallel "
                                          "attention replicas")
    s.add_argument("--ep", type=int, help="expert-parallel size of the routed experts (default: --devices)")
    s.add_argument("--expert-mode", help="routed-expert mode of the profile (ascend310p: resident, streaming, "
                                         "preconverted)")
    s.add_argument("--max-model-len", type=int, default=4096)
    s.add_argument("--memory-fraction", type=float, default=0.9, help="share of device memory the runtime may use")
    s.add_argument("--kv-cache-bytes", type=_size, help="explicit KV pool (e.g. 128MiB) instead of the fraction")
    s.add_argument("--max-num-seqs", type=int, default=16, help="engine max_num_seqs (sizes the entry groups)")
    s.add_argument("--speculative", choices=["dspark", "mtp", "none"], default="dspark",
                   help="drafting with the checkpoint's own drafter (DSpark, or the MTP layer of the Flash preview and "
                        "Pro; either name plans it); none: no drafter rings and no draft round (the drafter's weights "
                        "still load: the runtime loads every checkpoint tensor)")
    s.add_argument("--acceptance", type=float, default=0.5, help="DSpark accepted / drafted (310P field: 0.48)")
    s.add_argument("--context", type=int, help="context length of the predicted decode step (default: max-model-len)")
    s.add_argument("--shard-bytes", type=_size, default=4 * GIB, help="preconverted shard limit (default 4GiB)")
    s.add_argument("--json", action="store_true", help="print the plan as JSON")
    s.add_argument("--check", action="store_true",
                   help="exit with status 1 when the plan does not fit (the plan is printed either way)")
    s.add_argument("--calibration", action="store_true",
                   help="the planner with the field stacks' own kernel counts against their measured steps")
    s.add_argument("--graph-mode", action="store_true",
                   help="predict the decode step replayed as a captured graph (the profile's graph_launch_s per "
                        "kernel) instead of eager launches; both are printed either way")
    s.set_defaults(func=cmd_plan)


def _ops(args) -> int:
    from lib.console.stages import Stages
    from lib.planner.launch_counts import count_launches, format_report, load_counted, record, shrunk_flash
    from spec.profile import backend_names

    if args.batch < 1:
        raise ValueError(f"--batch must be at least 1, got {args.batch}")
    if args.record and args.batch != 1:      # the speed planner's step is one sequence's
        raise ValueError("--record keeps counts of batch 1; drop --batch")
    if args.record and args.model:
        raise ValueError("--record keeps counts of the default shrunk Flash-0731 checkpoint only; drop --model")
    backends = backend_names() if args.backend == "all" else [args.backend]
    model = Path(args.model) if args.model else None
    if model is None:           # made once (minutes), then reused: said either way
        shrunk_flash(stages=Stages("plan --ops"))
    stages = Stages("plan --ops", total=len(backends))
    reports, sixteen = [], []
    for backend in backends:
        with stages(f"counting launches of one decode step and one DSpark round of {args.batch} sequence(s) on "
                    f"{backend} ({model or 'shrunk Flash-0731'}: load, prefill, then under the guard)"):
            counted = load_counted(backend, model)
            reports.append(count_launches(counted, args.batch))
            if args.record:             # the record keeps batch 16's step too (its strided rows may copy)
                sixteen.append(count_launches(counted, 16, with_round=False))
        print(format_report(reports[-1]), flush=True)
    if args.record:
        print(f"recorded in {record(reports, sixteen)}")
    stages.finish()
    return 0


def cmd_plan(args) -> int:
    from lib.planner.plan import as_json, make_plan
    from lib.planner.memory import Deployment
    from spec.profile import backend_names

    if args.ops:
        return _ops(args)
    if args.calibration:
        from lib.planner.calibration import calibrations, format_calibrations

        print(format_calibrations(calibrations()))
        return 0
    if args.record:
        raise ValueError("--record goes with --ops (it records launch counts)")
    if args.batch != 1:
        raise ValueError("--batch goes with --ops (the plan's decode step is one sequence's)")
    if args.backend == "all":
        devices = [b for b in backend_names() if b != "cpu"]
        raise ValueError(f"dsv4gen plan needs one --backend (accepted: {', '.join(devices)}); "
                         f"`--backend all` is for --ops")
    # a generation without recorded launch counts (V4.1-Flash) is planned for memory only, and the plan says so
    devices = _devices(args)
    d = Deployment(args.backend, args.variant, devices, args.tp or devices, args.ep or devices,
                   args.expert_mode, args.max_model_len, args.memory_fraction, args.kv_cache_bytes, args.max_num_seqs,
                   args.speculative != "none", args.shard_bytes, args.nodes)
    plan = make_plan(d, args.context, args.acceptance, graph_mode=args.graph_mode)
    if args.json:
        print(json.dumps(as_json(plan), indent=2))
    else:
        print(format_plan(plan))
    if plan.does_not_fit:
        print(f"dsv4gen plan: warning: DOES NOT FIT: {plan.does_not_fit}", file=sys.stderr)
    return 1 if args.check and plan.does_not_fit else 0


def _devices(args) -> int:
    """--devices, or --nodes x --devices-per-node; both given must agree."""
    if args.devices_per_node is None:
        return 8 * args.nodes if args.devices is None else args.devices
    if args.devices_per_node < 1:
        raise ValueError(f"--devices-per-node must be at least 1, got {args.devices_per_node}")
    devices = args.nodes * args.devices_per_node
    if args.devices is not None and args.devices != devices:
        raise ValueError(f"--devices {args.devices} does not match --nodes {args.nodes} x --devices-per-node "
                         f"{args.devices_per_node} = {devices}")
    return devices


def _g(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def format_plan(p) -> str:
    d, w, dev = p.deployment, p.weights, p.device
    roll = w.rollup()
    mode = f"experts {d.expert_mode or 'default'} ({w.expert_format})"
    where = (f"{d.nodes} nodes x {d.devices_per_node} {d.backend} = {d.devices} devices" if d.nodes > 1
             else f"{d.devices} x {d.backend}")
    sizes = f"TP {d.tp}, EP {d.ep}" if d.classic else f"TP {d.tp} x DP {d.dp}, EP {d.ep}"
    out = [f"{d.variant} on {where}, {sizes}, {mode}",
           *_layout(p),
           f"device: {dev.doc}",
           "  " + ", ".join(f"{label} {fmt(getattr(dev, name).value)} [{getattr(dev, name).basis}]" for label, name, fmt in (
               ("memory", "memory_bytes", _g), ("bandwidth", "memory_bandwidth_bytes_per_s", lambda v: f"{v / 1e9:g} GB/s"),
               ("launch", "launch_latency_s", lambda v: f"{v * 1e6:g} us"),
               ("link", "link_bandwidth_bytes_per_s", lambda v: f"{v / 1e9:g} GB/s"),
               ("collective", "collective_latency_s", lambda v: f"{v * 1e6:g} us"),
               ("reserve", "runtime_reserve_bytes", _g))),
           *_verdict(p),
           "", "weights per device",
           *(f"  {label:<42}{_g(roll[key]):>11}" for label, key in (
               ("resident weights (target, non-expert)", "resident_weights"),
               (f"routed experts ({w.n_local} per rank, {w.expert_format})", "routed_experts"),
               ("scales (target)", "scales"), ("draft (mtp.*, every class)", "draft"), ("total", "total"))),
           *textwrap.wrap("by class (target, GiB): " + ", ".join(
               f"{c.tensor_class} {c.runtime_format} {(c.data + c.scale) / GIB:.3f}"
               for c in sorted(w.target, key=lambda c: -(c.data + c.scale))), 110, initial_indent="  ",
               subsequent_indent="    "),
           *_splits(p),
           *_host(p),
           "", "KV cache per device (one shared KV head: every TP rank holds the whole cache" +
               ("" if d.dp == 1 else " of its DP replica's sequences") + ")",
           *_kv(p),
           "", _budget(p), *_capacity(p),
           f"  occupied: {_g(p.occupied)} of {_g(p.device_memory)}",
           "", f"preconverted checkpoint (target only, B17; each rank's runtime tensors, {p.preconverted.runtime_format}):",
           f"  {_g(p.preconverted.total_bytes)} in {p.preconverted.shards_per_rank * p.preconverted.ranks} shards "
           f"({p.preconverted.shards_per_rank} per rank, <= {_g(d.shard_bytes)}); " + (
               f"`dsv4gen convert` output (routed experts only): {_g(p.preconverted.convert_output_bytes)}"
               if p.preconverted.convert_output_bytes is not None else
               f"{d.backend} has no preconverted expert mode (`dsv4gen convert` refuses it)"),
           "", *_speed(p)]
    return "\n".join(out)


def _wrap(text: str, indent: str) -> list[str]:
    """110 columns, never breaking a --flag-name at its hyphens."""
    return textwrap.wrap(text, 110, subsequent_indent=indent, break_on_hyphens=False)


def _n(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def _layout(p) -> list[str]:
    """Where each part of the model lives, and whether the runtime can launch the layout."""
    d, w = p.deployment, p.weights
    out = []
    if not d.classic:
        if d.devices_per_node % d.tp == 0:
            tp = f"TP {d.tp} within a node"
        elif d.tp % d.devices_per_node == 0:
            tp = f"TP {d.tp} across {d.tp // d.devices_per_node} nodes (its all-reduces leave the node)"
        else:
            tp = f"TP {d.tp} in groups that straddle nodes (their all-reduces leave the node)"
        copies = d.devices // d.ep
        out += _wrap(
            f"layout: attention and the dense layers {tp}, DP {d.dp} = {d.devices} / {d.tp} attention replicas (each "
            f"holds its sequences' KV cache); routed experts EP {d.ep}, {w.n_local} of "
            f"{w.n_local * d.ep} per device" + (f", the split repeated {copies} times" if copies > 1 else "") +
            "; shared experts, router, compressors, hyper-connections and norms whole on every device "
            "(tensors.yaml tp: replicate)", "  ")
    if p.no_speed is not None:
        out += _wrap(f"memory only: {p.no_speed}; weights per device, host memory and the KV cache (in the formats of "
                     f"spec/shared_kv.yaml) are planned, no decode step is predicted", "  ")
    if p.runtime_refusal is not None:
        out += _wrap(f"PLANNING ONLY, the runtime cannot launch this layout yet: {p.runtime_refusal}", "  ")
    elif not d.classic:
        out.append(f"runtime: launchable, one job of {d.devices} ranks ({d.devices_per_node} per node)")
    return out


def _verdict(p) -> list[str]:
    """What does not fit, first of all; a layout beyond one replica on one node also says what fits."""
    from lib.planner.plan import nodes_that_fit

    d, c = p.deployment, p.capacity
    if p.does_not_fit is None:
        if d.classic:
            return []
        return [f"fits: weights {_g(p.weights_bytes)} + workspace {_g(p.workspace)} + reserve {_g(p.reserve)} + KV "
                f"pool {_g(c.pool_bytes)} = {_g(p.occupied)} of {_g(p.device_memory)} per device; "
                f"{_n(c.sequences, 'sequence')} of --max-model-len {d.max_model_len:,} per DP replica, "
                f"{p.sequences_total:,} in all"]
    out = _wrap(f"DOES NOT FIT: {p.does_not_fit}", "  ")
    wider = nodes_that_fit(p)
    if wider is not None:
        e, wc = wider.deployment, wider.capacity
        out += _wrap(
            f"  fits on {e.nodes} nodes x {e.devices_per_node} = {e.devices} devices (--nodes {e.nodes} --tp {e.tp} "
            f"--ep {e.ep}: TP {e.tp} x DP {e.dp}, EP {e.ep}): weights {_g(wider.weights_bytes)} and a KV pool of "
            f"{_g(wc.pool_bytes)} per device, {_n(wc.sequences, 'sequence')} of --max-model-len {e.max_model_len:,} "
            f"per DP replica" + ("" if wider.runtime_refusal is None else "; planning only"), "    ")
    return out


def _splits(p) -> list[str]:
    """The weights per device by how tensors.yaml places them: the layout's arithmetic, summing to the total."""
    d, w = p.deployment, p.weights
    if d.classic:
        return []
    split, labels = w.by_split(), {
        "tp": f"cut TP {d.tp} ways", "replicated": "whole on every device",
        "experts": f"routed experts, {w.n_local} of {w.n_local * d.ep} (EP {d.ep})",
        "draft": "draft (mtp.*, every class)"}
    out = ["  by split (per device, data and scales; the rows sum to the total):"]
    for key, label in labels.items():
        out.append(f"    {label:<40}{_g(split[key]):>11}")
        classes = [f"{c} {b / GIB:.3f}" for s, c, b in w.split if s == key and key in ("tp", "replicated")]
        out += textwrap.wrap(", ".join(classes), 110, initial_indent="      ", subsequent_indent="      ")
    return out + [f"    {'total':<40}{_g(sum(split.values())):>11}"]


def _host(p) -> list[str]:
    """Tensors held in host memory instead of on the device (V4.1's Engram tables)."""
    out = []
    for h in p.host:
        d = p.deployment
        how = (f"row shards over the {d.devices} ranks, each in its rank's host"
               if h.placement == "sharded_per_rank" else "whole on every host")
        out += ["", f"host memory ({h.tensor_class}, off the device; {how}):"]
        out += _wrap(f"  {h.doc}", "    ")
        for t in h.tables:
            out.append(f"    {t.key:<30} {t.rows:>13,} rows x {t.row_bytes} B = {t.total / 1e9:7.2f} GB"
                       + (f"; {t.per_rank / GIB:.2f} GiB a rank" if t.per_rank else ""))
        out.append(f"  per host {_g(h.per_host)} ({h.per_host / 1e9:.2f} GB)" +
                   (f", per rank {_g(h.per_rank)}" if h.per_rank else "") + f"; all tables {_g(h.total)}")
        out += _wrap(f"  source: {h.source}", "    ")
    return out


def _kv(p) -> list[str]:
    lay = p.layout
    per, fixed = lay.per_token, lay.per_sequence
    from lib.planner.shared_kv_layout import SharedKVLayout

    if isinstance(p.layout, SharedKVLayout):
        head = (f"  per context position (KV-source layers only, an entry pool per compress ratio, {lay.block_tokens} "
                f"rows a block):")
    else:
        head = f"  per context position (entry block pools, a group per compress ratio, {lay.block_tokens} rows a block):"
    return [head,
            *(f"    {kind:<19} {per[kind]:>13,.0f} bytes  ({lay.held(kind)})" for kind in per),
            f"    {'total':<19} {lay.kv_bytes_per_token:>13,.0f} bytes per token",
            f"  fixed per sequence (ring slots; slack {lay.slack} = positions a step may leave uncommitted):",
            *(f"    {kind:<19} {fixed[kind]:>13,} bytes  ({lay.held(kind)})" for kind in fixed),
            f"    {'total':<19} {lay.kv_fixed_bytes_per_sequence:>13,} bytes per sequence "
            f"({lay.max_seqs} slots + 1 trash slot allocated)"]


def _capacity(p) -> list[str]:
    d, c = p.deployment, p.capacity
    why = {"blocks": "limited by the pool", "max_num_seqs": f"limited by --max-num-seqs {d.max_num_seqs}",
           "pool": "the pool holds not even the ring slots and one block"}[c.limited_by]
    per, total = ("", "") if d.dp == 1 else (" per DP replica", f", {p.sequences_total:,} in all")
    return [f"  KV capacity: engine num_blocks {c.num_blocks:,} of {p.layout.block_tokens} positions = {c.tokens:,} "
            f"context tokens{per}; pools allocated {_g(c.allocated_bytes)} of {_g(c.pool_bytes)}",
            *([] if d.dp == 1 else [f"  x {d.dp} DP replicas = {p.tokens_total:,} context tokens in all"]),
            f"  sequences of --max-model-len {d.max_model_len:,} held at once: {c.sequences:,}{per}{total} ({why}; "
            f"each provisioned for {c.sequence_length:,} positions)"
            + ("  ** not one sequence of --max-model-len fits **" if c.sequences == 0 else "")]


def _budget(p) -> str:
    d = p.deployment
    head = (f"memory: KV pool set to {_g(p.capacity.pool_bytes)} (--kv-cache-bytes)" if d.kv_cache_bytes is not None
            else f"memory: {d.memory_fraction:g} x {_g(p.device_memory)} = {_g(p.budget)} - weights "
                 f"{_g(p.weights_bytes)} - workspace {_g(p.workspace)} - reserve {_g(p.reserve)} = KV pool "
                 f"{_g(p.capacity.pool_bytes)}")
    return head + ("" if p.fits else "  ** DOES NOT FIT **")


def _step(name: str, s) -> str:
    return (f"  {name:<7} {s.bytes_read / 1e9:7.2f} GB read {s.memory_s * 1e3:8.1f} ms + {s.launches:>6,} launches "
            f"{s.launch_s * 1e3:8.1f} ms + {s.collectives:>4} collectives {s.collective_s * 1e3:6.1f} ms "
            f"= {s.seconds * 1e3:8.1f} ms")


def _speed(p) -> list[str]:
    s, dev = p.speed, p.device
    if s is None:
        return [f"decode step: not predicted ({p.no_speed})"]
    mode = (f"captured: {dev.graph_launch_s.value * 1e6:g} us a kernel in a replayed graph" if p.graph_mode
            else f"eager: {dev.launch_latency_s.value * 1e6:g} us a launch")
    out = [f"decode step at context {s.context:,}, one sequence (bytes / bandwidth + launches x latency + collectives; "
           f"{mode}):",
           _step("plain", s.plain) + f"  -> {1 / s.plain.seconds:.2f} tok/s"]
    if s.verify is not None:
        out += [_step("verify", s.verify), _step("draft", s.draft),
                f"  DSpark: block {s.block}, acceptance {s.acceptance:g} -> {s.tokens_per_round:.2f} tokens per "
                f"{s.round_s * 1e3:.1f} ms round = {s.dspark_per_token_s * 1e3:.1f} ms per token -> "
                f"{1 / s.dspark_per_token_s:.2f} tok/s"]
    d = p.deployment
    if d.nodes > 1 and max(d.tp, d.ep) > d.devices_per_node:
        out.append(f"  collectives that cross nodes are priced at the profile's link bandwidth "
                   f"({dev.link_bandwidth_bytes_per_s.value / 1e9:g} GB/s, a figure inside a node; it has none between "
                   f"nodes): a lower bound on their time")
    return out + [_side_by_side(p)]


def _side_by_side(p) -> str:
    """Eager and captured predictions of the same step on one line (tok/s, plain | DSpark)."""
    def rate(sp):
        if sp is None:
            return "-"
        return f"{1 / sp.plain.seconds:.2f}" + (f" | DSpark {1 / sp.dspark_per_token_s:.2f}" if sp.verify else "")
    captured = rate(p.captured) if p.captured is not None else f"none ({p.device.no_graph})"
    return f"  tok/s eager {rate(p.eager)}; captured {captured}" + ("" if p.graph_mode else "  (--graph-mode: captured)")
