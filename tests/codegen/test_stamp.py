"""The generated code's stamp covers the code generator: a one-character codegen change is stale.

In a copy of the tracked tree, `dsv4gen build --check` passes; after a one-character change to a
template or to codegen/lower.py that leaves the rendered code itself unchanged, it fails naming every
stale file and the command that fixes it; `dsv4gen build` rewrites only the stamps; --check passes again.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("spec", "codegen", "backends", "lib", "serve")


def _copy_tree(dest: Path) -> Path:
    """Tracked (and new, not ignored) files of the source packages and pyproject.toml, as in the working tree."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--",
                              *PACKAGES, "pyproject.toml"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"not a git checkout, cannot list the tracked files: {e}")
    for rel in sorted({f for f in out.decode().split("\0") if f}):
        if (ROOT / rel).is_file():  # a tracked file deleted in the working tree is not copied
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    return dest


def _run(copy: Path, *args: str) -> subprocess.CompletedProcess:
    """python <args> in the copy, importing the copy's packages (PYTHONPATH first, before the editable install)."""
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, *args], cwd=copy, env=env, capture_output=True, text=True, timeout=600)


def _dsv4gen(copy: Path, *args: str) -> subprocess.CompletedProcess:
    return _run(copy, "-m", "lib.cli.main", *args)


def _generated(copy: Path) -> dict[str, list[str]]:
    return {p.relative_to(copy).as_posix(): p.read_text(encoding="utf-8").splitlines()
            for p in sorted(copy.glob("backends/*/_generated/*")) if p.is_file()}


def _edit_template(path: Path) -> str:
    """One character the renderer drops: inside a Jinja comment when the template has one, else a space
    before a line's block tag (lstrip_blocks strips it)."""
    text = path.read_text(encoding="utf-8")
    if (m := re.search(r"\{#.*?([A-Za-z]).*?#\}", text, flags=re.S)):
        i = m.start(1)
        new, what = text[:i] + text[i].swapcase() + text[i + 1:], f"a letter inside the Jinja comment at {i}"
    else:
        m = re.search(r"^\{%", text, flags=re.M)
        assert m, f"{path}: no Jinja comment and no line starting with a block tag"
        new, what = text[:m.start()] + " " + text[m.start():], f"a space before the block tag at {m.start()}"
    path.write_text(new, encoding="utf-8")
    return what


def _edit_python_comment(path: Path) -> str:
    """Swap the case of one letter of the first full-line comment."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    for n, line in enumerate(lines):
        if (m := re.match(r"\s*#\s*([A-Za-z])", line)):
            i = m.start(1)
            lines[n] = line[:i] + line[i].swapcase() + line[i + 1:]
            path.write_text("".join(lines), encoding="utf-8")
            return f"line {n + 1}"
    raise AssertionError(f"{path}: no full-line comment to change")


@pytest.mark.parametrize("source, edit", [
    ("codegen/templates/model.py.j2", _edit_template),
    ("codegen/lower.py", _edit_python_comment),
], ids=["template", "lower"])
def test_one_character_codegen_change_is_stale_until_rebuilt(tmp_path, source, edit):
    copy = _copy_tree(tmp_path / "tree")
    where = _run(copy, "-c", "import codegen.build, lib.cli.main; print(codegen.build.__file__); "
                       "print(lib.cli.main.__file__)")
    assert where.returncode == 0, where.stderr
    assert all(Path(f).resolve().is_relative_to(copy.resolve()) for f in where.stdout.split()), where.stdout

    first = _dsv4gen(copy, "build", "--check")
    assert first.returncode == 0, f"the copied tree is stale before any change:\n{first.stdout}{first.stderr}"
    before = _generated(copy)
    assert before, "no generated files were copied"

    what = edit(copy / source)
    stale = _dsv4gen(copy, "build", "--check")
    assert stale.returncode != 0, f"--check passed after changing {what} of {source}:\n{stale.stdout}"
    names = re.findall(r"^(.*): stale$", stale.stderr, flags=re.M)
    # every generated file's stamp hashes the generator, so every one of them is stale (and named in the copy)
    assert sorted(Path(n).resolve().relative_to(copy.resolve()).as_posix() for n in names) == sorted(before), \
        stale.stderr
    for backend in {Path(n).parts[1] for n in before}:
        assert f"run: dsv4gen build --backend {backend}" in stale.stderr, stale.stderr

    built = _dsv4gen(copy, "build")
    assert built.returncode == 0, built.stderr
    after = _generated(copy)
    assert sorted(after) == sorted(before)
    for name, lines in after.items():
        old = before[name]
        # only the stamp changed: the edit left the rendered code as it was
        assert lines[1:] == old[1:], f"{name}: the change to {source} altered more than the stamp"
        assert "@generated" in lines[0] and lines[0] != old[0], f"{name}: stamp not renewed: {lines[0]}"

    again = _dsv4gen(copy, "build", "--check")
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("generated code is up to date") == len({Path(n).parts[1] for n in before})
