"""keep_freed_memory turns MKL's buffer cache off only when it runs before torch is imported, and says so.

Each case runs in a fresh interpreter: the settings are process-wide and MKL reads its variable once."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


def _run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MKL_DISABLE_FAST_MM"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout


def test_before_torch_it_takes_every_setting():
    out = _run("from lib.runtime.hostmem import keep_freed_memory; import os\n"
               "ok = keep_freed_memory(); import torch; print(ok, os.environ.get('MKL_DISABLE_FAST_MM'))")
    assert out.split() == ["True", "1"]


def test_after_torch_it_reports_being_late_and_leaves_mkl_alone():
    out = _run("import torch, os; from lib.runtime.hostmem import keep_freed_memory\n"
               "print(keep_freed_memory(), os.environ.get('MKL_DISABLE_FAST_MM'))")
    assert out.split() == ["False", "None"]


def test_the_entry_points_call_it_before_torch():
    # the server's and dsv4gen's mains import nothing that loads torch before the call
    for module in ("serve.cli", "lib.cli.main", "lib.bench.long_context"):
        assert _run(f"import sys, {module}; print('torch' in sys.modules)").strip() == "False", module
