"""The README's main job: `python -m serve` on the shipped trained tiny checkpoint, in a real subprocess, answers
the README's documented curl call; `dsv4gen serve` is the same server."""
from __future__ import annotations

import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

import lib.launcher.ranks
import lib.weights.tiny_checkpoint as tiny
from lib.cli.main import main as dsv4gen
from serve.cli import prepare

ROOT = Path(__file__).resolve().parents[2]


def _readme_curl() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()
             if line.startswith("curl ") and "/v1/chat/completions" in line]
    assert lines, "the README documents no curl call to /v1/chat/completions"
    return shlex.split(lines[0])


def test_python_m_serve_answers_the_readme_curl_call():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "serve", "--port", "0"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 300
        while "listening on" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert "listening on" in line, f"no 'listening on' line; exit {proc.poll()}: {proc.stderr.read()[-2000:]}"
        url = line.split("listening on ", 1)[1].split()[0]
        args = _readme_curl()
        readme_url = next(a for a in args if a.startswith("http"))
        body = json.loads(args[args.index("-d") + 1])
        headers = dict(h.split(": ", 1) for h in (args[i + 1] for i, a in enumerate(args) if a == "-H"))
        r = httpx.post(url + readme_url.split("8000", 1)[1], json=body, headers=headers, timeout=120)
        assert r.status_code == 200, r.text
        reply = r.json()
        assert reply["object"] == "chat.completion" and reply["model"] == "deepseek-v4-tiny"
        assert reply["choices"][0]["finish_reason"] == "stop"
        a, b = map(int, re.fullmatch(r"What is (\d+)\+(\d+)\?", body["messages"][-1]["content"]).groups())
        content = reply["choices"][0]["message"]["content"]
        assert content.startswith(f"{a}+{b}: ") and content.endswith(f"so {a}+{b}={a + b}")     # the shipped model answers
    finally:
        proc.send_signal(signal.SIGINT)             # uvicorn shuts down gracefully on Ctrl-C, then
        try:                                        # re-raises the signal: exit 0 or "killed by SIGINT"
            assert proc.wait(timeout=30) in (0, -signal.SIGINT)
        finally:
            proc.kill()


def test_dsv4gen_serve_is_the_same_server(capsys):
    with pytest.raises(SystemExit) as done:
        dsv4gen(["serve", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--backend", "--host", "--port", "--served-model-name", "--max-model-len",
                 "--max-num-seqs", "--max-num-batched-tokens", "--speculative", "--api-key", "--expert-mode"):
        assert flag in out


def test_bad_flags_fail_with_a_clear_message(tmp_path, capsys):
    assert dsv4gen(["serve", "--model", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err


def test_with_no_model_it_serves_the_shipped_trained_checkpoint(monkeypatch):
    class Loading(Exception):
        pass

    seen = []

    def launch(spec):                                 # stop where loading starts: the messages are written
        seen.append(spec)
        raise Loading
    monkeypatch.setattr(lib.launcher.ranks, "launch", launch)
    out = io.StringIO()
    with pytest.raises(Loading):
        prepare(["--port", "0"], out=out)
    path = tiny.shipped_trained()
    assert tiny.trained_on_task_mix(path) and "dsv4gen train-tiny" in (path / tiny.TRAINING_RECORD).read_text()
    lines = out.getvalue().splitlines()
    assert lines[0] == f"using the shipped trained tiny checkpoint {path}" and lines[1].startswith(f"loading {path} ")
    assert not any("making" in line for line in lines) and len(seen) == 1


def test_a_missing_shipped_checkpoint_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny, "SHIPPED_TRAINED", tmp_path / "trained_tiny")
    with pytest.raises(FileNotFoundError, match="trained_tiny.*--model DIR"):
        prepare(["--port", "0"], out=io.StringIO())
