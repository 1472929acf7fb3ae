"""Op-level conformance: every graph op that reads no parameter (or only fp32 ones every backend holds
as the reference does), run on a device backend with the exact inputs the reference op saw, against the reference op's output (llama.cpp's
test-backend-ops idea). Weight-free ops must agree to the device dtype's rounding, so a wrong
combine or mixing rule shows up even where quantised weights make sub-layers noisy (B09 on 910).
"""
from __future__ import annotations


import torch

from lib.quant.reference_formats import resolve
from lib.records.step_rope import StepRope
from spec.graph import load_graph
from spec.profile import Profile, backend_names, load_profile
from spec.tables import load_tensor_table

# median per-token relative error allowed for a weight-free op, by compute dtype: a few units of
# the dtype's rounding (fp16 eps 4.9e-4, bf16 eps 3.9e-3), since inputs are rounded to it first
OP_TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
# share of top-k selections allowed to differ: near-tie choices flip when scores are computed from
# inputs rounded to the device dtype (bf16 keeps 8 mantissa bits, fp16 11)
SELECTION_MISMATCH = {torch.float32: 0.0, torch.float16: 0.05, torch.bfloat16: 0.10}


PARAM_REFS = ("p.", "first.", "last.")      # how a program binds a port to a parameter (spec/graph.py)
# parameter classes an op may read and still be checked op by op: the hyper-connection weights, held
# in fp32 (dense_f32) by every device backend, so the recorded call with them cast to fp32 is the
# device's own call (the attention sinks are fp32 too, but their ops read cached state: sub-layer checks)
EXACT_CLASSES = frozenset({"hc"})


def checked_ops() -> dict[str, frozenset[str]]:
    """The ops op-level conformance re-runs -> their ports bound to parameters: ops that read no
    parameter, and ops that read only EXACT_CLASSES ones (hc_pre's Sinkhorn is judged here: F01)."""
    graph, table = load_graph().graph, load_tensor_table()
    class_of = {e.key.replace("{expert}.", ""): e.tensor_class for e in table.entries}
    devices = [load_profile(b) for b in backend_names() if b != "cpu"]
    exact = {c for c in EXACT_CLASSES if all(p.runtime_format(c) == "dense_f32" for p in devices)}
    ports: dict[str, set[str]] = {op: set() for op in graph.ops}
    inexact = set()
    for prog in graph.programs.values():
        for step in prog.steps:
            for port, ref in (step.args.items() if step.op else ()):
                key = next((ref[len(pre):] for pre in PARAM_REFS if ref.startswith(pre)), None)
                if key is not None:
                    ports[step.op].add(port)
                    inexact |= {step.op} if class_of.get(key) not in exact else set()
    return {op: frozenset(p) for op, p in sorted(ports.items()) if op not in inexact}


def _cast(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, list):
        return [_cast(v, dtype) for v in value]
    return value


def _selection_mismatch(dev: torch.Tensor, ref: torch.Tensor) -> list[float]:
    """Per query row: 1.0 when the device selected a different set of entries."""
    return (dev.long().sort(-1).values != ref.long().sort(-1).values).any(-1).float().tolist()


def device_calls(calls, profile: Profile, fused: frozenset = frozenset(), rewritten: dict | None = None):
    """The recorded reference calls as the device makes them (prepare these outside the guard: the
    reference's fp64 parameters are cast here): (op, function, args, kwargs, reference output). An op
    a fused kernel of `fused` (the device model's cfg.fused) replaces runs as that kernel's lowering;
    `rewritten`: an injected bug's calls (codegen Rewrite.calls), so the op runs what the device runs."""
    dtype = getattr(torch, profile.compute_dtype)
    graph, params, rewritten = load_graph().graph, checked_ops(), rewritten or {}
    out = []
    for op, args, kwargs, ref_out in calls:
        kernel = profile.fused_of(op)
        if kernel is not None and kernel[0] in fused:
            call = rewritten.get(f"{op}@{kernel[0]}", kernel[1].call)
        else:
            call = rewritten.get(op, op_call(profile, op, graph))
        # activations in the device's dtype; parameters in fp32, as the device holds them; the step's
        # RoPE angles in fp32, as the device's rope_angles makes them
        ins = [_cast(a, torch.float32 if port in params[op] else dtype) for port, a in zip(graph.ops[op].inputs, args)]
        attrs = {k: v.to(torch.float32) if isinstance(v, StepRope) else v for k, v in kwargs.items()}
        out.append((op, resolve(call), ins, attrs, ref_out))
    return out


def op_call(profile: Profile, op: str, graph=None) -> str:
    """'module:function' the backend lowers `op` to (the reference where it runs the reference)."""
    graph = graph or load_graph().graph
    low = profile.lowering(op)
    return graph.ops[op].reference if low.impl == "reference" else low.call


def run_ops(prepared):
    """Device outputs of `device_calls` (run this under the guard)."""
    return [(op, fn(*args, **kwargs), ref_out) for op, fn, args, kwargs, ref_out in prepared]


def op_checks(results, profile: Profile, check_type):
    """One Check per op: median token error (or selection mismatch) within the dtype tolerance."""
    dtype = getattr(torch, profile.compute_dtype)
    tol, flips = OP_TOLERANCE[dtype], SELECTION_MISMATCH[dtype]
    per_op: dict[str, list[float]] = {}
    kinds: dict[str, str] = {}
    pairs = []
    for op, got, want in results:      # every tensor output of a tuple: hc_pre's u, post and comb
        if isinstance(want, tuple):
            pairs += [(op if i == 0 else f"{op} output {i}", g, w) for i, (g, w) in enumerate(zip(got, want))]
        else:
            pairs.append((op, got, want))
    for op, got, want in pairs:
        if not isinstance(want, torch.Tensor):
            continue
        if not want.is_floating_point():
            per_op.setdefault(op, []).extend(_selection_mismatch(got, want))
            kinds[op] = "selection"
            continue
        g, w = got.float().reshape(want.shape[0], -1), want.float().reshape(want.shape[0], -1)
        err = (g - w).norm(dim=-1) / w.norm(dim=-1).clamp_min(1e-12)
        err = torch.where(torch.isfinite(g).all(-1), err, float("inf"))
        per_op.setdefault(op, []).extend(err.tolist())
        kinds[op] = "error"
    checks = []
    for op, values in sorted(per_op.items()):
        v = torch.tensor(values)
        if kinds[op] == "selection":
            # at least one flip is always tolerated, so short runs are not judged on one near-tie
            differing, allowed = int(v.sum().item()), max(1, int(flips * len(v)))
            checks.append(check_type(f"op {op}: query rows selecting differently", f"{differing}/{len(v)}",
                                     f"<= {allowed} ({flips:.0%})", differing <= allowed))
        else:
            med = v.median().item()
            checks.append(check_type(f"op {op}: median token error ({len(values)} rows)", f"{med:.2e}",
                                     f"<= {tol:g}", med <= tol))
    return checks
