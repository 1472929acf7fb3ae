"""The README's two fresh-machine commands are the ones CI and the tests exercise."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.startswith("python3 -m venv")]


def test_ci_runs_the_readme_test_command():
    main_job, tests = _readme_commands()[:2]
    assert "pytest" in tests and "pytest" not in main_job
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_main_job_command_serves_the_embedded_checkpoint():
    main_job = _readme_commands()[0]
    assert main_job.endswith("python -m serve")     # no --model: the embedded tiny (tests/serve/test_serve_main.py runs it)
    assert "torch==2.13.0" in main_job
