"""Long commands say what they are doing: numbered stages on stderr, each closed with its elapsed seconds.

The `Stages` helper (lib/console/stages.py) on a pipe and on a terminal, the shrunk-Flash checkpoint of
`plan --ops` announced as made or reused, and `dsv4gen plan --ops` on the tiny checkpoint (seconds), whose
report on stdout is unchanged by its progress lines.
"""
from __future__ import annotations

import io
import json
import re

import pytest

from lib.cli.main import main
from lib.console.stages import Stages
from lib.planner import launch_counts

STAGE = r"\[(?P<label>[^\]]+)\] (?:(?P<n>\d+)/(?P<total>\d+) )?(?P<name>.+?) \.\.\.(?: (?P<s>\d+\.\d) s)?"


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_stages_on_a_pipe_open_and_close_each_stage_on_lines_of_their_own():
    out = io.StringIO()
    stages = Stages("conformance hip936", total=2, stream=out)
    with stages("op checks (12 recorded op calls)"):
        pass
    stages.note("reusing the checkpoint")
    with stages("teacher-forced decode (32 steps)"):
        pass
    stages.finish()
    lines = out.getvalue().splitlines()
    assert lines[0] == "[conformance hip936] 1/2 op checks (12 recorded op calls) ..."
    assert re.fullmatch(r"\[conformance hip936\] 1/2 op checks \(12 recorded op calls\) \.\.\. \d+\.\d s",
                        lines[1]), lines[1]
    assert lines[2] == "[conformance hip936] reusing the checkpoint"
    assert lines[3] == "[conformance hip936] 2/2 teacher-forced decode (32 steps) ..."
    assert re.fullmatch(r"\[conformance hip936\] 2/2 teacher-forced decode \(32 steps\) \.\.\. \d+\.\d s", lines[4])
    assert re.fullmatch(r"\[conformance hip936\] done in \d+\.\d s", lines[5]) and len(lines) == 6


def test_stages_on_a_terminal_rewrite_the_opening_line_and_end_it_on_an_error(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    out = _Tty()
    stages = Stages("plan --ops", stream=out)
    with stages("counting"):
        out.write("\rbar 50%")                       # a progress bar overwriting the line meanwhile
    with pytest.raises(KeyboardInterrupt), stages("making"):
        raise KeyboardInterrupt
    text = out.getvalue()
    assert re.fullmatch(r"\[plan --ops\] counting \.\.\.\rbar 50%\r\[plan --ops\] counting \.\.\. \d+\.\d s\n"
                        r"\[plan --ops\] making \.\.\.\n", text), repr(text)


def test_a_line_wider_than_the_terminal_is_not_rewritten(monkeypatch):
    monkeypatch.setenv("COLUMNS", "30")               # a carriage return would go back to its last row only
    out = _Tty()
    with Stages("conformance ascend310p", stream=out)("sub-layer checks (240 calls)"):
        pass
    first, second = out.getvalue().splitlines()
    assert first == "[conformance ascend310p] sub-layer checks (240 calls) ..." and second.startswith(first + " ")


def test_quiet_stages_write_nothing_and_library_calls_default_to_quiet(capsys):
    stages = Stages.quiet()
    with stages("anything"):
        stages.note("nothing")
    stages.finish()
    assert capsys.readouterr() == ("", "")


def test_the_shrunk_flash_checkpoint_is_announced_as_made_then_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("DSV4GEN_CACHE", str(tmp_path))
    made = []

    def fake_make_tiny(path, **kwargs):                # the real one takes minutes: stands in for it
        made.append(path)
        path.mkdir(parents=True)
        (path / "config.json").write_text(json.dumps({}))
        return path
    monkeypatch.setattr(launch_counts, "make_tiny", fake_make_tiny)
    out = io.StringIO()
    path = launch_counts.shrunk_flash(stages=Stages("plan --ops", stream=out))
    again = launch_counts.shrunk_flash(stages=Stages("plan --ops", stream=out))
    assert made == [path] and again == path and path.parent == tmp_path
    lines = out.getvalue().splitlines()
    what = "the shrunk-width Flash-0731 checkpoint (5 layers, 256 experts)"
    assert lines[0] == f"[plan --ops] making {what} in {path} (once; cached) ..."
    assert re.fullmatch(rf"\[plan --ops\] making {re.escape(what)} in {re.escape(str(path))} \(once; cached\) "
                        r"\.\.\. \d+\.\d s", lines[1])
    assert lines[2:] == [f"[plan --ops] reusing {what} in {path}"]


def test_plan_ops_announces_the_backend_it_counts_with_elapsed_time(tiny_ckpt, capsys):
    assert main(["plan", "--ops", "--backend", "cpu", "--model", str(tiny_ckpt)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("backend cpu: one decode step") and "[plan --ops]" not in out     # the report: stdout
    stages = [m.groupdict() for m in map(re.compile(STAGE).fullmatch, err.splitlines()) if m]
    assert [(s["n"], s["total"], s["s"] is None) for s in stages] == [("1", "1", True), ("1", "1", False)], err
    assert stages[0]["label"] == "plan --ops" and "on cpu" in stages[0]["name"] and str(tiny_ckpt) in stages[0]["name"]
    assert re.search(r"^\[plan --ops\] done in \d+\.\d s$", err, re.MULTILINE), err
