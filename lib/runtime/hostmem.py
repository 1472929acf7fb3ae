"""Keep freed host memory in the process instead of handing it back to the OS after every op.

glibc serves each allocation above its mmap threshold (128 KiB, raised dynamically up to 32 MiB)
with a fresh mmap and unmaps it on free, and trims the heap top above 128 KiB. A prefill chunk
makes large short-lived tensors (an [n, heads, keys] block of logits, the indexer's tiles, a
chunk's expert rows), so every op page-faults its output in afresh: measured on this 2-core
machine, a 1K-32K prefill series of the `cpu` backend spent 50 s in the kernel against 97 s of
user time, and the fault cost grew with the context (`dsv4gen bench` scaling rows). With the
threshold and trim point above the largest tensor, freed blocks stay in the heap and are reused:
0.5 s in the kernel for the same series. The process keeps its peak heap (what torch's own
caching allocator does on a device).

MKL's own memory manager ("fast MM") keeps a buffer for every GEMM size it has served and never
frees them: a long prefill, whose indexer blocks take a new shape as the context grows, added
about 1 MiB of host memory per 4,096 positions (more than the paged state itself holds for the
`scaling` checkpoint), measured with mallinfo2 over a 24K prefill; with MKL_DISABLE_FAST_MM=1 the
heap stays flat and MKL's buffers come from (and return to) the heap above. MKL reads the variable
when it loads, so it must be set before torch is imported.

Process-wide, so only the command-line entry points call it (the server, `dsv4gen`), never a
library import. A no-op where the C library is not glibc.

The decode-state pools are the other way round: long-lived, sized by the context, and written a
block at a time. `mapped_zeros` gives each its own anonymous mapping instead of a place in that
heap, as a device allocates its KV cache apart from its activations: the kernel hands out zero
pages as rows are first written, so resident memory follows the state actually held, and the
heap's layout (where a chunk's temporaries fit) is the same whatever the pools' sizes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import os
import sys

M_TRIM_THRESHOLD = -1       # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
KEEP_BELOW = 1 << 30        # allocations under 1 GiB come from (and return to) the heap


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds and turn MKL's buffer cache off; True if the C library
    took both settings and torch (with its MKL) was not yet imported. Call it first thing."""
    late = "torch" in sys.modules
    if not late:
        os.environ.setdefault("MKL_DISABLE_FAST_MM", "1")
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):            # no C library found, or one without mallopt (musl, macOS)
        return False
    if mallopt is None:
        return False
    took = bool(mallopt(M_MMAP_THRESHOLD, KEEP_BELOW)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP_BELOW))
    return took and not late


def mapped_zeros(shape: tuple[int, ...], dtype, device=None):
    """A zero tensor of `shape` in an anonymous mapping of its own on the host (pages resident
    once written; unmapped when the tensor goes), or torch.zeros on any other device."""
    import torch

    size = math.prod(shape) * dtype.itemsize
    if size == 0 or (device is not None and torch.device(device).type != "cpu"):
        return torch.zeros(shape, dtype=dtype, device=device)
    # the tensor's storage keeps the mapping alive (torch.frombuffer holds the buffer object)
    return torch.frombuffer(mmap.mmap(-1, size), dtype=dtype).view(shape)
