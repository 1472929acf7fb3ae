"""A backend's generated package rendered with a codegen Rewrite into a temporary folder, for the
duration of a block: how the porting tools run a variant of the generated code (a re-introduced
field bug, a recording of the reference's calls) without touching the checked-in one.
"""
from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

from codegen.build import render_into
from codegen.lower import Rewrite
from lib.runtime.loaded_model import generated_from


@contextlib.contextmanager
def rendered(backend: str, rewrite: Rewrite, label: str):
    """Yield the Generated package of `backend` rendered with `rewrite`; it is importable (under a
    name of its own) until the block ends, then forgotten."""
    with tempfile.TemporaryDirectory(prefix=f"dsv4gen-{label}-") as tmp:
        folder = render_into(backend, rewrite, Path(tmp) / "generated")
        name = "dsv4gen_rendered_" + "".join(c if c.isalnum() else "_" for c in Path(tmp).name)
        try:
            yield generated_from(folder, name)
        finally:
            for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[module]
