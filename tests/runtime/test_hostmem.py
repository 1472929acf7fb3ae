"""keep_freed_memory turns MKL's buffer cache off only when it runs before torch is imported, and says so;
mapped_zeros (the paged cache's pools) holds pages only once they are written.

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


def test_mapped_pools_are_resident_only_where_written():
    # a 64 MiB pool costs nothing until written; writing half of it makes that half resident
    out = _run("import os, torch; from lib.runtime.hostmem import mapped_zeros\n"
               "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')\n"
               "before = rss(); pool = mapped_zeros((1024, 16384), torch.float32); made = rss()\n"
               "pool[:512] = 1.0; written = rss()\n"
               "print((made - before) >> 20, (written - made) >> 20, float(pool.sum()), int(pool[512:].count_nonzero()))")
    made, written, total, rest = out.split()
    assert int(made) < 4 and 30 <= int(written) <= 36 and float(total) == 512 * 16384 and rest == "0"


def test_paged_cache_pools_live_in_their_own_mappings():
    import torch

    from lib.runtime.hostmem import mapped_zeros
    assert mapped_zeros((2, 3), torch.bfloat16).dtype == torch.bfloat16
    assert mapped_zeros((4, 0), torch.float32).shape == (4, 0)
    assert mapped_zeros((2, 2), torch.float32, "meta").device.type == "meta"
    page = os.sysconf("SC_PAGE_SIZE")
    pool = mapped_zeros((3, 5), torch.float16)
    assert pool.data_ptr() % page == 0 and pool.is_contiguous() and pool.untyped_storage().nbytes() == 30
