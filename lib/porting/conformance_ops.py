"""Op-level conformance: every graph op that reads no parameter, run on a device backend with the
exact inputs the reference op saw, against the reference op's output (llama.cpp's
test-backend-ops idea). Weight-free ops must agree to the device dtype's rounding, so a wrong
combine or mixing rule shows up even where quantised weights make sub-layers noisy (B09 on 910).
"""
from __future__ import annotations


import torch

from lib.quant.reference_formats import resolve
from spec.graph import load_graph
from spec.profile import Profile

# median per-token relative error allowed for a weight-free op, by compute dtype: a few units of
# the dtype's rounding (fp16 eps 4.9e-4, bf16 eps 3.9e-3), since inputs are rounded to it first
OP_TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
# share of top-k selections allowed to differ: near-tie choices flip when scores are computed from
# inputs rounded to the device dtype (bf16 keeps 8 mantissa bits, fp16 11)
SELECTION_MISMATCH = {torch.float32: 0.0, torch.float16: 0.05, torch.bfloat16: 0.10}


def weight_free_ops() -> list[str]:
    """Ops none of whose ports is ever bound to a parameter in any program."""
    graph = load_graph().graph
    with_params = {s.op for p in graph.programs.values() for s in p.steps
                   if s.op and any(v.startswith("p.") for v in s.args.values())}
    return sorted(op for op in graph.ops if op not in with_params)


def _cast(value, dtype):
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, list):
        return [_cast(v, dtype) for v in value]
    return value


def _selection_mismatch(dev: torch.Tensor, ref: torch.Tensor) -> list[float]:
    """Per query row: 1.0 when the device selected a different set of entries."""
    return (dev.long().sort(-1).values != ref.long().sort(-1).values).any(-1).float().tolist()


def run_ops(calls, profile: Profile):
    """Device outputs for the recorded reference calls (run these under the guard)."""
    dtype = getattr(torch, profile.compute_dtype)
    out = []
    for op, args, kwargs, ref_out in calls:
        low = profile.lowering(op)
        fn = resolve(load_graph().graph.ops[op].reference if low.impl == "reference" else low.call)
        out.append((op, fn(*_cast(list(args), dtype), **_cast(kwargs, dtype)), ref_out))
    return out


def op_checks(results, profile: Profile, check_type):
    """One Check per op: median token error (or selection mismatch) within the dtype tolerance."""
    dtype = getattr(torch, profile.compute_dtype)
    tol, flips = OP_TOLERANCE[dtype], SELECTION_MISMATCH[dtype]
    per_op: dict[str, list[float]] = {}
    kinds: dict[str, str] = {}
    for op, got, want in results:
        if isinstance(want, tuple):
            got, want = got[0], want[0]
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
