"""`Stages`: a long command's stages announced on stderr as they start, closed with their elapsed seconds.

    stages = Stages("conformance hip936", total=9)
    with stages("teacher-forced decode (32 steps)"):
        ...

writes `[conformance hip936] 5/9 teacher-forced decode (32 steps) ...` when the stage starts and
`[conformance hip936] 5/9 teacher-forced decode (32 steps) ... 41.2 s` when it ends. On a terminal
the closing line overwrites the opening one (a carriage return: weight-loading bars in between stay
readable) when it fits the terminal's width; into a file or a pipe both lines are written, so a log
shows what was running when it stopped. Progress is for people: it goes to stderr, never into a command's stdout report.
"""
from __future__ import annotations

import contextlib
import shutil
import sys
import time
from typing import Iterator, TextIO


class Stages:
    """Numbered stages of one command (`total` may be set later, before the first stage; None: unnumbered)."""

    def __init__(self, label: str, total: int | None = None, stream: TextIO | None = None, enabled: bool = True):
        self.label, self.total, self.enabled = label, total, enabled
        self.count = 0                     # stages started so far
        self.started = time.perf_counter()
        self._stream = stream
        self._pending = False              # a terminal line written without its newline

    @classmethod
    def quiet(cls) -> Stages:
        """Writes nothing: the default of library functions, whose callers decide what a user sees."""
        return cls("", enabled=False)

    @property
    def stream(self) -> TextIO:
        return self._stream or sys.stderr  # looked up at each write: redirections and captures hold

    def _rewritable(self, line: str) -> bool:
        """A terminal wide enough that a carriage return goes back to the start of `line` once it is closed."""
        isatty = getattr(self.stream, "isatty", None)
        return bool(isatty and isatty()) and len(line) + len(" 9999.9 s") < shutil.get_terminal_size().columns

    def _write(self, text: str, newline: bool = True) -> None:
        out = self.stream
        if self._pending:                  # something else to say while a stage runs: end its line first
            out.write("\n")
            self._pending = False
        out.write(text + ("\n" if newline else ""))
        out.flush()

    def note(self, text: str) -> None:
        """One unnumbered line: what is reused, what was chosen."""
        if self.enabled:
            self._write(f"[{self.label}] {text}")

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.count += 1
        if not self.enabled:
            yield
            return
        number = f"{self.count}/{self.total} " if self.total else ""
        line = f"[{self.label}] {number}{name} ..."
        tty = self._rewritable(line)
        self._write(line, newline=not tty)
        self._pending = tty
        start = time.perf_counter()
        try:
            yield
        except BaseException:
            if self._pending:              # an error or Ctrl-C: its message starts on a line of its own
                self.stream.write("\n")
                self.stream.flush()
                self._pending = False
            raise
        closing = f"{line} {time.perf_counter() - start:.1f} s"
        if tty:                            # rewrite the whole line: a progress bar may have overwritten it
            self._pending = False
            self._write("\r" + closing)
        else:
            self._write(closing)

    def finish(self, text: str = "done") -> None:
        """`[label] done in 130.2 s`: the whole command's time."""
        self.note(f"{text} in {time.perf_counter() - self.started:.1f} s")
