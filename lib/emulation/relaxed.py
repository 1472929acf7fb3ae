"""Width limits of fused kernels, relaxed for the emulation only.

A fused kernel's shape limits (a hidden size in {4096, 7168}, 64 query heads, ...) hold for the
real checkpoints and fail for the tiny test ones. Conformance and the launch counter exercise the
fused path at tiny widths by relaxing exactly those limits marked `width` (the profile's `fused`
limits and the emulated kernels' own checks), inside `with relaxed_widths():`. Every other limit
(stream count, dtypes, iteration counts) still holds there, and outside the block nothing is relaxed:
a model that chose a fused kernel this way fails loudly when it runs at a tiny width outside it.
"""
from __future__ import annotations

import contextlib
import contextvars

_WIDTHS = contextvars.ContextVar("dsv4gen_relaxed_widths", default=False)


@contextlib.contextmanager
def relaxed_widths():
    token = _WIDTHS.set(True)
    try:
        yield
    finally:
        _WIDTHS.reset(token)


def widths_relaxed() -> bool:
    return _WIDTHS.get()
