"""Ctrl-C in `dsv4gen`: one line, exit status 130, no traceback, from the process and from its worker ranks.

The console script runs as users run it (a subprocess in a session of its own, so the signal can go to
its whole process group the way a terminal's Ctrl-C does); it is interrupted after its first progress
line. In-process, a KeyboardInterrupt from any subcommand, or an error raised while one unwinds, is the
same one line, and main() leaves the caller's SIGINT handler as it found it.
"""
from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import lib.cli.inventory as inventory_cli
from lib.cli.main import main


def _console_script() -> str:
    exe = Path(sys.executable).parent / "dsv4gen"
    found = str(exe) if exe.is_file() else shutil.which("dsv4gen")
    if not found:
        pytest.skip("the dsv4gen console script is not installed (pip install -e .)")
    return found


class _Command:
    """The console script in its own session; stderr read line by line as it comes."""

    def __init__(self, args: list[str], cache: Path):
        env = {**os.environ, "DSV4GEN_CACHE": str(cache), "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([_console_script(), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                break
            self.err.append(line)
            if re.search(pattern, line):
                return line
        self.kill()
        pytest.fail(f"no stderr line matching {pattern!r}; stderr so far:\n{''.join(self.err)}")

    def interrupt_group(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)         # what a terminal's Ctrl-C does

    def finish(self, timeout: float = 60) -> tuple[int, str, str]:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running {timeout} s after Ctrl-C; stderr:\n{''.join(self.err)}")
        while (line := self.lines.get(timeout=10)) is not None:
            self.err.append(line)
        return self.proc.returncode, self.proc.stdout.read(), "".join(self.err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)

    def children(self) -> list[int]:
        """Live processes of the command's group other than itself (its worker ranks)."""
        out = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit() and int(d.name) != self.proc.pid:
                try:
                    stat = (d / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(stat[2]) == self.proc.pid and stat[0] != "Z":       # pgid; not a zombie
                    out.append(int(d.name))
        return out


def _assert_one_line(rc: int, err: str, command: str) -> None:
    assert rc == 130, f"exit status {rc}; stderr:\n{err}"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.endswith(f"dsv4gen {command}: interrupted\n"), err
    assert err.count("interrupted") == 1, err


def test_ctrl_c_during_conformance_is_one_line_and_status_130(tiny_ckpt, tmp_path):
    cmd = _Command(["conformance", "--backend", "hip936", "--model", str(tiny_ckpt), "--steps", "4"], tmp_path)
    first = cmd.wait_for(r"^\[conformance hip936\] ")
    assert re.fullmatch(r"\[conformance hip936\] 1/8 cpu reference \(24-token prompt \+ 4 greedy steps, .*\) \.\.\.\n",
                        first), first
    time.sleep(0.5)                                     # inside the stage, not at its first line
    cmd.interrupt_group()
    rc, out, err = cmd.finish()
    _assert_one_line(rc, err, "conformance")
    assert out == ""                                    # the report never started


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads the worker processes from /proc")
def test_ctrl_c_of_a_parallel_launch_leaves_no_worker_and_no_worker_traceback(tiny_ckpt, tmp_path):
    """TP=2: rank 1 is a process of its own; a terminal's Ctrl-C reaches it too, while both ranks decode."""
    cmd = _Command(["run", "--model", str(tiny_ckpt), "--prompt", "Hello", "--max-tokens", "4000", "--raw",
                    "--speculative", "none", "--tensor-parallel-size", "2"], tmp_path)
    cmd.wait_for(r"^\[run cpu\] loading .*TP=2 EP=1 in 2 processes \.\.\. \d+\.\d s$")   # both ranks loaded
    assert cmd.children(), "rank 1 is not running"
    time.sleep(1.0)                                     # decoding: every step's collectives on both ranks
    assert cmd.proc.poll() is None, "the run ended before it could be interrupted"
    cmd.interrupt_group()
    rc, _, err = cmd.finish()
    _assert_one_line(rc, err, "run")
    assert "leaked semaphore" not in err, err
    deadline = time.monotonic() + 10                    # multiprocessing's resource tracker leaves after it
    while cmd.children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not cmd.children(), "a worker rank outlived the interrupted command"


def test_keyboard_interrupt_in_any_subcommand_returns_130_in_process(monkeypatch, capsys):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(inventory_cli, "cmd_inventory", interrupted)
    before = signal.getsignal(signal.SIGINT)
    assert main(["inventory"]) == 130
    assert capsys.readouterr().err == "dsv4gen inventory: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is before            # the caller's handler is back


@pytest.mark.parametrize("error", [RuntimeError("Connection closed by peer"),    # a collective whose peers are gone
                                   ValueError("a bad state"), FileNotFoundError("gone")])    # what main() reports
def test_an_error_raised_while_an_interrupt_unwinds_is_still_the_interrupt(monkeypatch, capsys, error):
    def cleanup_fails(args):
        try:
            raise KeyboardInterrupt
        finally:
            raise error
    monkeypatch.setattr(inventory_cli, "cmd_inventory", cleanup_fails)
    assert main(["inventory"]) == 130
    assert capsys.readouterr().err == "dsv4gen inventory: interrupted\n"


def test_a_real_sigint_in_process_runs_the_cleanup_and_returns_130(monkeypatch, capsys):
    cleaned = []

    def long_command(args):
        try:
            signal.raise_signal(signal.SIGINT)
            time.sleep(5)
        finally:
            cleaned.append(True)
    monkeypatch.setattr(inventory_cli, "cmd_inventory", long_command)
    assert main(["inventory"]) == 130 and cleaned == [True]
    assert capsys.readouterr().err == "dsv4gen inventory: interrupted\n"


def test_a_sigint_the_subcommand_swallowed_is_still_reported(monkeypatch, capsys):
    def swallows(args):
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass
        return 0
    monkeypatch.setattr(inventory_cli, "cmd_inventory", swallows)
    assert main(["inventory"]) == 130
    assert capsys.readouterr().err == "dsv4gen inventory: interrupted\n"


def test_other_exits_pass_through(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["no-such-command"])
    assert exit_.value.code == 2
    assert "interrupted" not in capsys.readouterr().err
