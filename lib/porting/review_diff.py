"""`dsv4gen diff`: review a port as tables, not as code.

Two backends: per graph op and per tensor class, how each lowers it (implementation, device ops,
runtime format; a fused kernel's lowering with the shapes that choose it) and which lessons each handles. Two spec versions: the unified diff of one
backend's generated code and plan, rendered from each.
"""
from __future__ import annotations

import difflib
from pathlib import Path

from codegen.build import render
from spec.fused import describe
from spec.graph import load_graph
from spec.profile import Profile, load_profile
from spec.tables import load_tensor_table


def _lowering_rows(profile: Profile) -> dict[str, str]:
    rows = {}
    for op in load_graph().graph.ops:
        entry = profile.ops.get(op)
        ways = entry.by_format.items() if entry is not None and entry.by_format else [("", profile.lowering(op))]
        for fmt, low in ways:
            call = low.call.split(":")[-1] if low.call else "reference"
            text = f"{low.impl} {call}" + (f" [{', '.join(low.device_ops)}]" if low.device_ops else "")
            text += f" ({', '.join(low.lessons)})" if low.lessons else ""
            rows[f"{op}" + (f" @{fmt}" if fmt else "")] = text
    for name, kernel in profile.fused.items():     # fused kernels, chosen by the checkpoint's shapes
        where = "; ".join(describe(lim) for lim in kernel.limits.values())
        for op, low in kernel.ops.items():
            devs = f" [{', '.join(low.device_ops)}]" if low.device_ops else ""
            rows[f"{op} ~fused {name}"] = f"{low.impl} {low.call.split(':')[-1]}{devs} where {where}"
    return rows


def _table(title: str, left: str, right: str, rows: list[tuple[str, str, str]]) -> list[str]:
    width = [max(len(r[i]) for r in rows + [(title, left, right)]) for i in range(3)]
    line = lambda a, b, c, mark=" ": f"{mark} {a.ljust(width[0])}  {b.ljust(width[1])}  {c}"  # noqa: E731
    out = [line(title, left, right), line("-" * width[0], "-" * width[1], "-" * width[2])]
    out += [line(a, b, c, "*" if b != c else " ") for a, b, c in rows]
    return out


def backend_diff(a: str, b: str) -> str:
    """Side-by-side lowering, runtime formats and lessons of two backends; '*' marks differences."""
    pa, pb = load_profile(a), load_profile(b)
    ra, rb = _lowering_rows(pa), _lowering_rows(pb)
    ops = sorted(set(ra) | set(rb))
    out = [f"dsv4gen diff: backend {a} vs {b}  (* = differs)", ""]
    out += _table("op", a, b, [(op, ra.get(op, "-"), rb.get(op, "-")) for op in ops])
    classes = load_tensor_table().classes
    out += [""] + _table("tensor class", a, b, [(c, pa.runtime_format(c), pb.runtime_format(c)) for c in classes])
    lessons = sorted(set(pa.lessons) | set(pb.lessons))
    rows = [(lid, "handled" if lid in pa.lessons else "-", "handled" if lid in pb.lessons else "-") for lid in lessons]
    out += [""] + _table("lesson", a, b, rows)
    out += ["", f"compute dtype: {a} {pa.compute_dtype}, {b} {pb.compute_dtype}",
            f"dtypes lacking: {a} {', '.join(pa.dtypes.lacks) or 'none'}; {b} {', '.join(pb.dtypes.lacks) or 'none'}"]
    return "\n".join(out) + "\n"


def spec_diff(old: Path, new: Path, backend: str) -> str:
    """Unified diff of the backend's generated files rendered from two spec folders."""
    before, after = render(backend, Path(old)), render(backend, Path(new))
    out = []
    for name in sorted(set(before) | set(after)):
        out += difflib.unified_diff(before.get(name, "").splitlines(keepends=True),
                                    after.get(name, "").splitlines(keepends=True),
                                    fromfile=f"{old}/{backend}/_generated/{name}",
                                    tofile=f"{new}/{backend}/_generated/{name}")
    return "".join(out) or f"no change to backend {backend}'s generated code or plan\n"
