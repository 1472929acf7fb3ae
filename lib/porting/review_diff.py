"""`dsv4gen diff`: review a port as tables, not as code.

Two backends: per graph op and per tensor class, how each lowers it (implementation, device ops,
runtime format; a fused kernel's lowering with the shapes that choose it) and which lessons each handles. Two spec versions: what changed in the model variants
(added, removed, config keys and inventory totals; an added variant is compared with its nearest
variant of the old spec), then the unified diff of one backend's generated code and plan, rendered
from each.
"""
from __future__ import annotations

import difflib
import math
from pathlib import Path

from codegen.build import render
from spec.fused import describe
from spec.graph import load_graph, program_ops
from spec.profile import Profile, load_profile
from spec.config import ModelConfig
from spec.tables import expand, load_quant, load_tensor_table
from spec.variants import variant_config, variants
from spec.yamlio import SpecError


def _lowering_rows(profile: Profile) -> dict[str, str]:
    rows = {}
    for op in sorted(program_ops(load_graph().graph)):
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


def _show(value) -> str:
    return "-" if value is None else str(value).replace("'", "")


def config_rows(a: ModelConfig, b: ModelConfig) -> list[tuple[str, str, str]]:
    """(key, a's value, b's value) for every config key whose values differ ("-": absent)."""
    da, db = a.to_json_dict(), b.to_json_dict()
    return [(k, _show(da.get(k)), _show(db.get(k))) for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k)]


def _totals(cfg: ModelConfig, spec_dir: Path) -> str:
    quant = load_quant(spec_dir / "quant.yaml")
    parts = [p for t in expand(cfg, load_tensor_table(spec_dir / "tensors.yaml", spec_dir / "quant.yaml"), quant)
             for p in t.parts]
    size = sum(quant.dtypes[p.dtype].bytes * math.prod(p.shape) for p in parts)
    return f"{len(parts):,} tensors, {size:,} bytes"


def variant_diff(old: Path, new: Path) -> list[str]:
    """Model variants of two spec folders: added (against the old variant with the fewest differing
    config keys), removed, and changed ones, as config-key tables with inventory totals."""
    def configs(spec_dir: Path) -> dict[str, ModelConfig | str]:
        out = {}
        for name in variants(spec_dir / "models"):
            try:
                out[name] = variant_config(name, models_dir=spec_dir / "models")
            except SpecError as err:
                out[name] = f"unreadable here: {err}"
        return out

    before, after = configs(Path(old)), configs(Path(new))
    lines: list[str] = []
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name), after.get(name)
        if isinstance(a, str) or isinstance(b, str):
            lines += [f"variant {name}: {a if isinstance(a, str) else b}", ""]
            continue
        if b is None:
            lines += [f"variant {name}: removed", ""]
            continue
        base = name
        if a is None:
            readable = {n: c for n, c in before.items() if not isinstance(c, str)}
            if not readable:
                lines += [f"variant {name}: added", ""]
                continue
            base = min(readable, key=lambda n: (len(config_rows(readable[n], b)), n))
            a = readable[base]
        rows = config_rows(a, b)
        if not rows:
            continue
        title = (f"variant {name}: added; compared with {base} of the old spec" if base != name
                 else f"variant {name}: changed")
        lines += [f"{title} ({len(rows)} config keys differ)"]
        lines += _table("config key", base, name, rows)
        lines += [f"  inventory: {base} {_totals(a, Path(old))}; {name} {_totals(b, Path(new))}", ""]
    return lines


def spec_diff(old: Path, new: Path, backend: str) -> str:
    """What changed in the model variants, then the unified diff of the backend's generated files
    rendered from two spec folders."""
    before, after = render(backend, Path(old)), render(backend, Path(new))
    out = []
    for name in sorted(set(before) | set(after)):
        out += difflib.unified_diff(before.get(name, "").splitlines(keepends=True),
                                    after.get(name, "").splitlines(keepends=True),
                                    fromfile=f"{old}/{backend}/_generated/{name}",
                                    tofile=f"{new}/{backend}/_generated/{name}")
    models = "".join(line + "\n" for line in variant_diff(Path(old), Path(new)))
    return models + ("".join(out) or f"no change to backend {backend}'s generated code or plan\n")
