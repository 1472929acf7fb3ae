"""The package layering of lib/__init__.py holds, and an upward import is refused.

`lint-imports` (import-linter) checks the [tool.importlinter] contracts of pyproject.toml on the real
tree, as .ci/run does; in a copy of the tracked sources one added upward import makes it fail naming
the broken contract and the import. The layout checks: no flat modules in lib/, a docstring in every
lib package's __init__.py, and no hand-written source module over 400 lines.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).parent / "lint-imports"
PACKAGES = ("spec", "codegen", "backends", "lib", "serve")  # the importable source packages (root_packages)
MAX_LINES = 400
LAYERS = "layers: spec -> records / weights -> backends -> runtime -> engine -> evaluation -> tools and training -> serve -> bench -> cli"
FORBIDDEN = "the generated code and the backends never reach the engine, the server or the tools"


def _need_lint():
    if not LINT.is_file():
        pytest.skip(f"import-linter is not installed ({LINT} missing): pip install -e '.[test]'")


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    """lint-imports in `cwd`, analysing the packages found first on PYTHONPATH = cwd. A wide console keeps
    each contract name and import on one line; no cache, so nothing is written into the tree."""
    env = {**os.environ, "PYTHONPATH": str(cwd), "COLUMNS": "300", "NO_COLOR": "1"}
    return subprocess.run([str(LINT), "--no-cache", "--no-logo"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _source_files() -> list[str]:
    """Tracked (and new, not ignored) files of the source packages and pyproject.toml, relative to ROOT."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
                              *PACKAGES, "pyproject.toml"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout, cannot list the tracked files: {e}")
    return sorted({f for f in out.decode().split("\0") if f and (ROOT / f).is_file()})  # skip deleted files


def _copy_sources(dest: Path) -> Path:
    for rel in _source_files():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, dest / rel)
    return dest


def test_contracts_are_the_ones_these_tests_name():
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    names = [line.split("=", 1)[1].strip().strip('"') for line in text.splitlines() if line.startswith("name = ")
             and text.index("[tool.importlinter]") < text.index(line)]
    assert names == [LAYERS, FORBIDDEN]


def test_lint_imports_passes_on_the_real_tree():
    _need_lint()
    r = _lint(ROOT)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"lint-imports failed on the tree (rc {r.returncode}):\n{out}"
    assert f"{LAYERS} KEPT" in out and f"{FORBIDDEN} KEPT" in out, out


@pytest.mark.parametrize("module, line, contracts, refusal", [
    # the engine reaching up to the server: the layers contract
    ("lib/engine/stops.py", "import serve.app  # upward", [LAYERS], "lib.engine is not allowed to import serve"),
    # a backend composite reaching the engine: both contracts
    ("backends/common/dense.py", "import lib.engine.llm_engine  # upward", [LAYERS, FORBIDDEN],
     "backends is not allowed to import lib.engine"),
])
def test_an_upward_import_is_refused(tmp_path, module, line, contracts, refusal):
    _need_lint()
    copy = _copy_sources(tmp_path / "tree")
    path = copy / module
    text = path.read_text(encoding="utf-8")
    path.write_text(text + ("" if text.endswith("\n") else "\n") + line + "\n", encoding="utf-8")
    lineno = len(path.read_text(encoding="utf-8").splitlines())
    importer = module.removesuffix(".py").replace("/", ".")
    imported = line.split()[1]

    r = _lint(copy)
    out = r.stdout + r.stderr
    assert r.returncode != 0, f"lint-imports accepted {importer} -> {imported}:\n{out}"
    # it analysed the copy: the import exists only there, and it is named with its line
    assert f"- {importer} -> {imported} (l.{lineno})" in out, out
    for name in contracts:
        assert f"{name} BROKEN" in out, out
    if FORBIDDEN not in contracts:
        assert f"{FORBIDDEN} KEPT" in out, out
    assert refusal in out, out


def test_lib_is_packages_with_documented_inits_and_modules_stay_small():
    lib = ROOT / "lib"
    flat = sorted(p.name for p in lib.glob("*.py") if p.name != "__init__.py")
    assert not flat, f"flat modules in lib/ (move each into the lib/<concern>/ package it belongs to): {flat}"
    packages = sorted(p for p in lib.iterdir() if p.is_dir() and p.name != "__pycache__" and not p.name.startswith("."))
    assert packages, "lib/ holds no packages"
    undocumented = []
    for pkg in packages:
        init = pkg / "__init__.py"
        if not init.is_file():
            undocumented.append(f"lib/{pkg.name}/: no __init__.py")
        elif not (ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or "").strip():
            undocumented.append(f"lib/{pkg.name}/__init__.py: no docstring")
    assert not undocumented, "\n".join(undocumented)
    assert (ast.get_docstring(ast.parse((lib / "__init__.py").read_text(encoding="utf-8"))) or "").strip()

    long = []
    for rel in _source_files():
        parts = Path(rel).parts
        if not rel.endswith(".py") or (parts[0] == "backends" and "_generated" in parts):
            continue
        n = len((ROOT / rel).read_text(encoding="utf-8").splitlines())
        if n > MAX_LINES:
            long.append(f"{rel}: {n} lines")
    assert not long, f"hand-written modules over {MAX_LINES} lines (split them by concern):\n" + "\n".join(long)
