"""`dsv4gen build`: render a backend's `_generated/` folder from spec + profile, and check it.

Output is deterministic and stamped with a hash of every spec and profile file it came from and of
the code generator itself (this package's Python and templates, so a codegen change is stale too);
files are rewritten only when their content changes, and `--check` reports stale, missing or
extra files with the one command that fixes them.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import jinja2

from codegen.lower import Rewrite, lower
from spec.config import RankConfig
from spec.fused import describe, unmet
from spec.graph import GRAPH_PATH, load_graph
from spec.profile import load_profile, load_runtime_formats, profile_path
from spec.state import as_python, load_state
from spec.tables import SPEC_DIR, load_tensor_table
from spec.variants import variant_config, variants

TEMPLATES = Path(__file__).resolve().parent / "templates"
SPEC_FILES = (GRAPH_PATH, SPEC_DIR / "tensors.yaml", SPEC_DIR / "quant.yaml", SPEC_DIR / "runtime.yaml",
              SPEC_DIR / "state.yaml")


CODEGEN_DIR = Path(__file__).resolve().parent


def codegen_files() -> list[Path]:
    """The generator's own sources: lowering, this builder and every template."""
    return sorted(p for p in CODEGEN_DIR.rglob("*") if p.is_file() and p.suffix in (".py", ".j2"))


def spec_hash(backend: str, spec_dir: Path = SPEC_DIR) -> str:
    h = hashlib.sha256()
    # the model variants too: PLAN.md says which fused kernels each one's shapes choose
    models = sorted((Path(spec_dir) / "models").glob("*.yaml"))
    sources = (*(Path(spec_dir) / f.name for f in SPEC_FILES), *models, profile_path(backend), *codegen_files())
    for path in sources:
        name = path.relative_to(CODEGEN_DIR.parent) if path.is_relative_to(CODEGEN_DIR) else Path(path.name)
        h.update(name.as_posix().encode() + b"\0" + path.read_bytes())
    return "sha256:" + h.hexdigest()[:16]


def _env() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
                              autoescape=False)


def render(backend: str, spec_dir: Path = SPEC_DIR, rewrite: Rewrite = Rewrite()) -> dict[str, str]:
    """File name -> content of the backend's generated folder (from another spec folder for
    `dsv4gen diff --spec`; with a `rewrite` for a temporary package, see `render_into`)."""
    spec_dir = Path(spec_dir)
    profile = load_profile(backend)
    table = load_tensor_table(spec_dir / "tensors.yaml", spec_dir / "quant.yaml")
    lowered = lower(load_graph(spec_dir / "graph.yaml"), profile, table, rewrite)
    runtime = load_runtime_formats(spec_dir / "runtime.yaml").formats
    formats = {**{cls: profile.runtime_format(cls) for cls in table.classes}, **rewrite.runtime_formats}
    expert_modes = {**profile.expert_modes, **rewrite.expert_modes}
    used = sorted(set(formats.values()) | set(expert_modes.values()))
    converters = {**{f: runtime[f].convert for f in used if f in runtime}, **rewrite.converters}
    by_impl: dict[str, int] = {}
    for op in lowered.ops:
        by_impl[op.impl] = by_impl.get(op.impl, 0) + 1
    ctx = {
        "backend": backend,
        "spec_hash": spec_hash(backend, spec_dir),
        "profile_doc": profile.doc,
        "compute_dtype": profile.compute_dtype,
        "cache": profile.cache,
        "ep_dispatch": profile.ep_dispatch.mode,
        "state": [_state_line(d) for d in load_state(spec_dir / "state.yaml")],
        "imports": lowered.imports,
        "functions": lowered.functions,
        "dispatch": lowered.dispatch,
        "ops": lowered.ops,
        "lowering_summary": ", ".join(f"{n} {impl}" for impl, n in sorted(by_impl.items())),
        "runtime_formats": sorted(formats.items()),
        "converters": [(f, converters[f]) for f in used],
        "tensors": [{"cls": cls, "fmt": fmt, "conv": converters[fmt],
                     "patterns": ", ".join(dict.fromkeys(f"`{e.key}`" for e in table.entries if e.tensor_class == cls))}
                    for cls, fmt in sorted(formats.items())],
        "lessons": sorted(profile.lessons.items()),
        "expert_modes": sorted(expert_modes.items()),
        "merged": [(*m.keys, m.layout) for m in profile.merged_weights.values()]
                  + [(*pair.keys, "stacked") for pair in profile.shared_inputs.values() if pair.one_gemm],
        "pairing": [{"kind": kind, "name": name, "reason": entry.reason, "source": entry.source,
                     "params": " + ".join(f"`{k}`" for k in getattr(entry, "keys", None) or (entry.key,))}
                    for kind, table_ in (("one weight (merged_weights)", profile.merged_weights),
                                         ("one input, one call (shared_inputs)", profile.shared_inputs),
                                         ("norm and quantisation, one call (quantised_norms)",
                                          profile.quantised_norms))
                    for name, entry in table_.items()],
        "record": bool(rewrite.record_ops) or rewrite.record_dispatch,
        "record_dispatch": rewrite.record_dispatch,
        "timed": bool(rewrite.time_ops),
        "fused": _fused_rows(profile),
        "fused_limits": {name: [_limit_line(lim) for lim in k.limits.values()] for name, k in profile.fused.items()},
    }
    env = _env()
    return {
        "__init__.py": env.get_template("init.py.j2").render(ctx),
        "model.py": env.get_template("model.py.j2").render(ctx),
        "loader.py": env.get_template("loader.py.j2").render(ctx),
        "PLAN.md": env.get_template("plan.md.j2").render(ctx),
    }


def _limit_line(limit) -> str:
    """One fused-kernel limit as a FusedLimit(...) expression of the generated package."""
    fields = {"key": limit.key, "reason": limit.reason, "source": limit.source}
    fields |= {k: getattr(limit, k) for k in ("one_of", "min", "max", "multiple_of", "width")
               if getattr(limit, k) not in ((), None, False)}
    return "FusedLimit(" + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ")"


def _fused_rows(profile) -> list[dict]:
    """Per fused kernel: its limits and, for every model variant of the spec (one rank), whether
    its shapes choose the kernel and, if not, the limits they fail."""
    rows = []
    for name, kernel in profile.fused.items():
        per_variant = []
        for variant in variants():
            failed = unmet(kernel.limits.values(), RankConfig.of(variant_config(variant)))
            per_variant.append((variant, "fused" if not failed else "composite: " + "; ".join(failed)))
        rows.append({"name": name, "kernel": kernel, "ops": ", ".join(f"`{op}`" for op in kernel.ops),
                     "limits": [(describe(lim), lim) for lim in kernel.limits.values()], "variants": per_variant})
    return rows


def _state_line(d) -> str:
    """One declared state item as a StateItem(...) expression of the generated package."""
    rows = "None" if d.rows is None else f"lambda cfg, ratio, slack: {as_python(d.rows)}"
    return (f"StateItem({d.name!r}, {d.kinds!r}, {d.lifetime!r}, {rows}, "
            f"lambda cfg, ratio, slack: {as_python(d.dim)}, {d.dtype!r}"
            f"{', slot0_unused=True' if d.slot0_unused else ''}{', sources_only=True' if d.sources_only else ''}),")


def render_into(backend: str, rewrite: Rewrite, folder: Path) -> Path:
    """Write the backend's generated files, rendered with `rewrite`, into a new folder (a temporary
    package: lib.runtime.loaded_model.generated_from imports it)."""
    folder.mkdir(parents=True, exist_ok=False)
    for name, content in render(backend, rewrite=rewrite).items():
        (folder / name).write_text(content, encoding="utf-8")
    return folder


def generated_dir(backend: str) -> Path:
    return profile_path(backend).parent / "_generated"


def diff(backend: str, out: Path | None = None) -> list[str]:
    """Names of generated files that are stale, missing or extra (empty: up to date)."""
    out = out or generated_dir(backend)
    files = render(backend)
    problems = []
    for name, content in files.items():
        path = out / name
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif path.read_text(encoding="utf-8") != content:
            problems.append(f"{path}: stale")
    if out.is_dir():
        extra = sorted(p.name for p in out.iterdir() if p.is_file() and p.name not in files)
        problems += [f"{out / name}: extra file" for name in extra]
    return problems


def build(backend: str, out: Path | None = None) -> list[str]:
    """Write the generated files that changed (atomically); returns what was written or removed."""
    out = out or generated_dir(backend)
    out.mkdir(parents=True, exist_ok=True)
    changed = []
    files = render(backend)
    for name, content in files.items():
        path = out / name
        if path.is_file() and path.read_text(encoding="utf-8") == content:
            continue
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(content)
        os.replace(tmp, path)
        changed.append(str(path))
    for path in sorted(out.iterdir()):
        if path.is_file() and path.name not in files:
            path.unlink()
            changed.append(f"{path} (removed)")
    return changed
