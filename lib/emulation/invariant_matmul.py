"""Matmul whose result for a row does not depend on how many rows come with it (CPU emulation).

CPU BLAS picks kernels and blockings by shape: row 0 of A[:m] @ B changes with m (measured here:
fp32 with K=1024, N=24 differs between m = 3 and m = 43; a single row takes a gemv path that
differs from every m >= 2). A device gives a token the same answer in any batch only if its
kernels do; the emulation models such a device, because the engine's guarantees (a request's
tokens do not depend on its batch; DSpark's verify of six rows equals six one-row decodes) are
tested here and must not fail through an artefact of the host BLAS. So on CPU every product is
made of [ROWS, K] @ [K, N] products, the rows padded with zeros to a multiple of ROWS (and a narrow N
to a multiple of COLUMNS): one shape, so one kernel and one order of summation for a row wherever it
sits in a block and whatever rows come with it (checked here for fp32, bf16 and fp16 at every position
of a block). On a real device the plain matmul runs and batch invariance is the kernels' property.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes


# Columns are padded with zeros to a multiple of COLUMNS (above COLUMNS // 2 of them): host BLAS has kernels
# for narrow products whose result for a row depends on the row's place in the block (measured here: MKL's
# AVX2 path on an AMD EPYC, fp32, N of 5-7 and 9-11, at every K tried, rows 1-3 and 5-7 of a block differ from
# rows 0 and 4); with N a multiple of 8 no such dependence was found for N up to 140 and K 4-256, nor with
# N <= 4 (tests/backends/test_invariant_matmul.py checks every N up to 48).
COLUMNS = 8


def _wide_enough(b: torch.Tensor) -> torch.Tensor:
    """b [..., K, N] with N zero-padded to a multiple of COLUMNS where N > COLUMNS // 2."""
    n = b.shape[-1]
    if n <= COLUMNS // 2 or n % COLUMNS == 0:
        return b
    return torch.nn.functional.pad(b, (0, COLUMNS - n % COLUMNS))


# Rows per block. Making every row its own item of one bmm against the weight expanded
# per row would copy the weight once per row (aten::copy_ takes 65% of hip936's emulated prefill
# that way) and run bf16 per row 50-90x slower than this (a 512 x 1024 @ 1024 x 512 bf16 product: 727 ms
# against 14 ms). 8 rows cost a one-row decode product about what one row alone costs in bf16,
# twice in fp32.
ROWS = 8


def _under_guard() -> bool:
    """A dispatch mode is active and it is not torch.export tracing the step (lib/runtime/step_graph.py):
    an exported step records the blocks themselves, so that its replay computes what eager does."""
    return bool(torch._C._len_torch_dispatch_stack()) and not torch.compiler.is_exporting()


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., K] @ b [K, N] -> [..., N]."""
    if not a.is_cpu:
        return a @ b
    if _under_guard():
        # Under the capability guard (lib/guard/capability.py), which counts launches as the device would run
        # them: the device runs this product as one matmul, so one plain product is counted and
        # checked in its place, and the values come from the blocks, out of the guard's sight.
        a @ b
        with _disable_current_modes():
            return _blocks(a, b)
    return _blocks(a, b)


def group_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [G, M, K] @ b [G, K, N] -> [G, M, N], group g's rows exactly as `matmul(a[g], b[g])` makes them:
    one batched product on a device (one launch, as the guard counts it), each group's own blocks on CPU."""
    if not a.is_cpu:
        return torch.bmm(a, b)
    if _under_guard():
        torch.bmm(a, b)             # under the capability guard: the device runs one bmm (see matmul)
        with _disable_current_modes():
            return _groups(a, b)
    return _groups(a, b)


def _groups(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.stack([_blocks(a[g], b[g]) for g in range(a.shape[0])])


def _blocks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    lead, n = a.shape[:-1], b.shape[-1]
    b = _wide_enough(b)
    rows = a.reshape(-1, a.shape[-1]).contiguous()                          # [M, K], one layout for every call
    m = rows.shape[0]
    if m == 0:
        return a.new_zeros((*lead, n))
    if m % ROWS:
        rows = torch.cat([rows, rows.new_zeros(ROWS - m % ROWS, rows.shape[1])])
    out = torch.cat([torch.mm(rows[i:i + ROWS], b) for i in range(0, rows.shape[0], ROWS)])    # [M + pad, N + pad]
    return out[:m, :n].contiguous().reshape(*lead, n)


# Bytes of B's operand repeated per block of rows that one host bmm makes (more heads than ROWS: B's operand once
# per block): temporaries of changing sizes fragmented the host heap (peak resident memory of the ascend910
# emulation grew 376 MiB from 4K to 64K context, its live bytes flat). Items are independent products, so taking
# them a group at a time changes no value.
COPY_BYTES = 1 << 25


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] -> [B, M, N], where row m of item i does not depend on M either.

    Attention's heads are the M of a per-token product, and tensor parallelism changes how many
    heads a rank holds: measured here, one head's fp32 logits differ between M = 8 and M = 2 (one
    process vs TP=4), which flipped a greedy token on ascend910. On CPU each item's rows are padded
    with zeros to blocks of ROWS, each block its own batch item against the item's B operand: one
    shape, [ROWS, K] @ [K, N], whatever M is. A row's value depends neither on its place in the
    block nor on the other rows (checked here in fp32 for K 16-128 and N 1-257, N padded as
    `_wide_enough` does), nor on how many items come with it, except that a lone item with N = 1
    takes a gemv path: it is paired with a zero item. Making every row its own item instead would
    copy B's operand M times, the largest cost of a verify step of the ascend910 emulation at batch
    16 (a fifth of its time)."""
    if not a.is_cpu:
        return torch.bmm(a, b)
    if _under_guard():
        # under the capability guard: the device runs one bmm (see matmul)
        torch.bmm(a, b)
        with _disable_current_modes():
            return _row_blocks(a, b)
    return _row_blocks(a, b)


def _row_blocks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    batch, m, k = a.shape
    if batch * m == 0:
        return torch.bmm(a, b)
    wide = _wide_enough(b)
    if wide is not b:
        return _row_blocks(a, wide)[..., :b.shape[-1]].contiguous()
    blocks = -(-m // ROWS)
    if blocks * ROWS != m:
        a = torch.cat([a, a.new_zeros(batch, blocks * ROWS - m, k)], 1)
    items = a.reshape(batch * blocks, ROWS, k).contiguous()                            # [B*blocks, ROWS, K]
    # contiguous always: a strided operand is rounded differently by BLAS (one decoded token against a verify of
    # six broke otherwise)
    if blocks == 1:
        return _items(items, b.contiguous())[:, :m]
    group = max(1, COPY_BYTES // max(1, blocks * b.shape[1] * b.shape[2] * b.element_size()))
    out = []
    for lo in range(0, batch, group):
        bi = b[lo:lo + group]
        n = bi.shape[0]
        shared = bi.unsqueeze(1).expand(n, blocks, *b.shape[1:]).reshape(n * blocks, *b.shape[1:]).contiguous()
        out.append(_items(items[lo * blocks:(lo + n) * blocks], shared).reshape(n, blocks * ROWS, b.shape[-1]))
    return (out[0] if len(out) == 1 else torch.cat(out))[:, :m]


def _items(items: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """bmm of [n, ROWS, K] @ [n, K, N], a lone item paired with a zero one (see bmm)."""
    if items.shape[0] > 1:
        return torch.bmm(items, shared)
    return torch.bmm(torch.cat([items, torch.zeros_like(items)]), torch.cat([shared, torch.zeros_like(shared)]))[:1]
