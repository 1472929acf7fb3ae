"""The README's two fresh-machine commands are the ones CI and the tests exercise, and every shell
command the README and docs/*.md show is either run here or excluded with its reason."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _readme_commands() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [line for block in blocks for line in block.splitlines() if line.startswith("python3 -m venv")]


def test_ci_runs_the_readme_test_command():
    main_job, tests = _readme_commands()[:2]
    assert "pytest" in tests and "pytest" not in main_job
    assert tests in (ROOT / ".ci" / "run").read_text().splitlines()


def test_main_job_command_serves_the_shipped_checkpoint():
    main_job = _readme_commands()[0]
    assert main_job.endswith("python -m serve")     # no --model: the shipped trained tiny (tests/serve/test_serve_main.py)
    assert "torch==2.13.0" in main_job


# ---------------------------------------------------------------- every documented command

RUN = None      # a cheap command (a few seconds): test_cheap_doc_commands_run runs it
# Every command of a ```sh block, matched (after leading VAR=value assignments) against these in
# order; the first match decides. A reason instead of RUN excludes the command and says where it
# is covered. A command nothing matches fails test_every_doc_command_is_classified.
COMMANDS: list[tuple[str, str | None]] = [
    # the fresh-machine lines create a venv and install: CI runs the test line (.ci/run, checked
    # above); tests/serve/test_serve_main.py runs the server line's `python -m serve`
    (r"python3 -m venv ", "fresh-machine install: .ci/run and tests/serve/test_serve_main.py"),
    (r"pip install ", "installs packages from an index"),
    (r"curl ", "needs a second shell with a running server: tests/serve/test_serve_main.py sends the README's curl call"),
    (r"(python -m serve|dsv4gen serve)( |$)", "starts a server that runs until stopped: tests/serve/test_serve_main.py, "
                                             "tests/serve/test_serve_parallel.py"),
    (r"torchrun ", "one rank per device on several hosts: tests/launcher/test_torchrun.py runs two nodes on one host"),
    (r"dsv4gen conformance --list-injections$", RUN),
    (r"dsv4gen conformance ", "minutes per device backend: tests/porting/test_conformance.py, tests/launcher/test_parallel.py"),
    (r"dsv4gen bench( |$)", "a benchmark of many minutes: tests/bench/test_bench.py runs it small"),
    (r"python -m lib\.bench\.", "a benchmark of minutes: tests/bench/test_bench_engine.py, tests/bench/test_bench_serve.py"),
    (r"dsv4gen plan --ops", "counts launches of every layer kind under the guard (minutes): tests/planner/test_launches.py"),
    (r"dsv4gen run .*--(tp|ep|tensor-parallel-size|expert-parallel-size) ",
     "spawns one process per rank: tests/launcher/test_parallel.py"),
    (r"dsv4gen run .*--backend ", "a device emulation, tens of seconds: tests/engine/test_engine.py, tests/porting/test_conformance.py"),
    (r"dsv4gen convert ", "converts every routed expert or the whole checkpoint: tests/weights/test_preconvert.py, "
                          "tests/weights/test_msmodelslim.py"),
    (r"dsv4gen capture ", "exports the step per bucket (about a minute per backend): tests/runtime/test_step_graph.py"),
    (r"dsv4gen eval ", "runs held-out questions through the engine twice (about a minute): tests/evaluation/test_eval_command.py"),
    (r"dsv4gen train-tiny ", "trains for about an hour and a half: tests/training/test_train_tiny.py runs a few steps"),
    (r"python -m pytest .*-m slow", "the slow test matrix, an hour or more on 2 cores"),
    (r"lint-imports( |$)", "tests/test_layering.py runs it"),
    (r"dsv4gen inventory ", RUN),
    (r"dsv4gen make-tiny ", RUN),
    (r"dsv4gen build --check$", RUN),
    (r"dsv4gen diff ", RUN),
    (r"dsv4gen plan ", RUN),
    (r"dsv4gen logits ", RUN),
    (r"dsv4gen run ", RUN),
]
ENV_PREFIX = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)+")


def _doc_commands() -> list[tuple[str, str]]:
    """(document, command) for each line of every ```sh block: continuation lines joined, trailing
    `  # comments` and comment lines dropped."""
    found = []
    for path in DOCS:
        for block in re.findall(r"```sh\n(.*?)```", path.read_text(), flags=re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                line = re.sub(r"\s+#\s.*$", "", line).strip()
                if line and not line.startswith("#"):
                    found.append((path.relative_to(ROOT).as_posix(), line))
    return found


def _classify(command: str):
    bare = ENV_PREFIX.sub("", command)
    for pattern, reason in COMMANDS:
        if re.match(pattern, bare):
            return pattern, reason
    return None


def test_every_doc_command_is_classified():
    commands = _doc_commands()
    assert any(doc == "README.md" for doc, _ in commands)
    unknown = [f"{doc}: {cmd}" for doc, cmd in commands if _classify(cmd) is None]
    assert not unknown, "commands in no row of COMMANDS (add one: RUN if it takes seconds, else the reason):\n" + \
        "\n".join(unknown)
    for _, reason in COMMANDS:                       # the tests a reason names exist
        for named in re.findall(r"tests/[\w/]+\.py", reason or ""):
            assert (ROOT / named).is_file(), f"COMMANDS names {named}, which does not exist"


def _console_script() -> str:
    exe = Path(sys.executable).parent / "dsv4gen"
    if exe.is_file():
        return str(exe)
    found = shutil.which("dsv4gen")
    if found is None:
        pytest.skip("the dsv4gen console script is not installed (pip install -e .)")
    return found


def test_cheap_doc_commands_run(tmp_path):
    """The cheap commands, as a user types them: /tmp paths moved under tmp_path, one shared
    $DSV4GEN_CACHE, the console script next to this interpreter; every one exits 0."""
    exe = shlex.quote(_console_script())
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "DSV4GEN_CACHE": os.environ.get("DSV4GEN_CACHE") or str(tmp_path / "cache"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}     # two at a time on 2 cores
    commands = []
    for _, command in _doc_commands():
        if (hit := _classify(command)) is not None and hit[1] is RUN:
            command = re.sub(r"/tmp/([\w.-]+)", lambda m: str(tmp_path / m.group(1)), command)
            command = re.sub(r"^dsv4gen\b", exe, command)
            if command not in commands:
                commands.append(command)
    assert commands

    def run(command: str):
        proc = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=work, env=env, capture_output=True,
                              text=True, timeout=180)
        return command, proc

    makers = [c for c in commands if " make-tiny " in c]          # checkpoints the later commands read
    results = [run(c) for c in makers]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results += list(pool.map(run, [c for c in commands if c not in makers]))
    failed = [f"{c}\n  rc {p.returncode}: {(p.stderr or p.stdout)[-600:]}" for c, p in results if p.returncode != 0]
    assert not failed, "documented commands that fail:\n" + "\n".join(failed)
