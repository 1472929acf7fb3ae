"""The product says what is true now: no development history and no paths of one machine.

Scans the repository's text files (tracked, plus new files git does not ignore) for wording that
narrates how the project got here (numbered work stops, helper ids) and for absolute paths of a
particular machine inside string literals of code and config. The patterns are assembled at run
time so this file does not match itself.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

_STOP, _HELPER = "st" + "op", "hel" + "per"
HISTORY = re.compile(
    rf"\b{_STOP}s? [0-9]+(-[0-9]+)?\b"        # a numbered stop, or a range of them
    rf"|\bthis {_STOP}\b|\bsince {_STOP}\b"
    rf"|\b{_HELPER}-[0-9]+\b",
    re.IGNORECASE)

# Absolute paths of one machine: a string literal (either quote) that starts at one of these roots.
_ROOTS = "|".join(("wo" + "rk", "ro" + "ot", "ho" + "me", "o" + "pt"))
LITERAL_PATH = re.compile(rf"""["'](/(?:{_ROOTS})/)""")
# shell scripts also name paths unquoted (`cd /...`, `X=/...`)
SHELL_PATH = re.compile(rf"""(?:^|[\s"'=:])(/(?:{_ROOTS})/)""")
CODE_SUFFIXES = (".py", ".toml", ".cfg")


def _files() -> list[Path]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    proc = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                          cwd=ROOT, capture_output=True)
    if proc.returncode != 0:
        pytest.skip("not a git checkout: " + proc.stderr.decode(errors="replace").strip())
    names = sorted({n for n in proc.stdout.decode().split("\0") if n})
    return [ROOT / n for n in names if (ROOT / n).is_file()]


def _text(path: Path) -> str | None:
    data = path.read_bytes()
    if b"\0" in data:
        return None                                  # binary (images, weights)
    return data.decode("utf-8", errors="replace")


def _hits(paths, pattern: re.Pattern) -> list[str]:
    hits = []
    for path in paths:
        text = _text(path)
        if text is None:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:160]}")
    return hits


def test_no_development_history_in_the_product():
    hits = _hits(_files(), HISTORY)
    assert not hits, ("development history (say what is true now instead):\n" + "\n".join(hits))


def test_no_absolute_paths_of_this_machine_in_code_or_config():
    files = _files()
    code = [p for p in files if p.suffix in CODE_SUFFIXES]
    ci = [p for p in files if p.relative_to(ROOT).parts[0] == ".ci"]
    hits = _hits(code, LITERAL_PATH) + _hits(ci, SHELL_PATH)
    assert not hits, ("absolute paths of one machine (derive them from __file__, sys.executable or "
                      "the environment):\n" + "\n".join(hits))
