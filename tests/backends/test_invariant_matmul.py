"""The emulation's batch-invariant products (lib/emulation/invariant_matmul.py): a row's value does not depend on
how many rows or items come with it, which is what lets a verify of six rows equal six one-row decodes and a TP
rank's heads equal one process's on the emulated devices."""
from __future__ import annotations

import pytest
import torch

from lib.emulation import invariant_matmul as invariant


@pytest.mark.parametrize("items,heads,k,n", [(5, 8, 64, 40), (1, 8, 64, 1), (3, 2, 64, 33), (4, 16, 32, 20),
                                             (2, 20, 16, 7), (96, 8, 64, 1)])
def test_a_head_row_is_the_same_whatever_heads_and_items_come_with_it(items, heads, k, n):
    gen = torch.Generator().manual_seed(items * 1000 + heads)
    a, b = torch.randn(items, heads, k, generator=gen), torch.randn(items, k, n, generator=gen)
    out = invariant.bmm(a, b)
    assert out.shape == (items, heads, n)
    assert torch.allclose(out, torch.bmm(a, b), atol=1e-4)                 # the product itself
    assert torch.equal(invariant.bmm(a[:, 1:3], b), out[:, 1:3])            # two heads, as a TP rank holds them
    assert torch.equal(invariant.bmm(a[-1:], b[-1:]), out[-1:])             # one token's item alone (a decode)
    assert torch.equal(invariant.bmm(a[:, :1], b), out[:, :1])              # a single head


def test_items_taken_a_group_at_a_time_give_the_same_rows(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(5, 20, 32, generator=gen), torch.randn(5, 32, 9, generator=gen)    # three blocks per item
    whole = invariant.bmm(a, b)
    monkeypatch.setattr(invariant, "COPY_BYTES", 1)                  # one item per group
    assert torch.equal(invariant.bmm(a, b), whole)


def test_a_strided_operand_gives_the_contiguous_ones_values():
    gen = torch.Generator().manual_seed(0)
    a, keys = torch.randn(6, 8, 64, generator=gen), torch.randn(6, 37, 64, generator=gen)
    assert torch.equal(invariant.bmm(a, keys.transpose(1, 2)), invariant.bmm(a, keys.transpose(1, 2).contiguous()))
    assert torch.equal(invariant.bmm(a[:1], keys[:1].transpose(1, 2)), invariant.bmm(a, keys.transpose(1, 2))[:1])


@pytest.mark.parametrize("k", [8, 16, 64, 100])
def test_a_row_is_the_same_at_every_place_in_a_block_for_every_narrow_width(k):
    # host BLAS kernels for narrow products can round a row by its place in the block (MKL's AVX2 path: N of 5-11)
    gen = torch.Generator().manual_seed(k)
    for n in range(1, 49):
        row, b = torch.randn(1, k, generator=gen), torch.randn(k, n, generator=gen)
        alone, alone_item = invariant.matmul(row, b)[0], invariant.bmm(row[None], b[None])[0, 0]
        for place in range(1, invariant.ROWS):
            a = torch.randn(invariant.ROWS, k, generator=gen)
            a[place] = row[0]
            assert torch.equal(invariant.matmul(a, b)[place], alone), (n, place)
            assert torch.equal(invariant.bmm(a[None], b[None])[0, place], alone_item), (n, place)


def test_no_rows_give_no_rows_of_the_asked_width():
    b = torch.randn(16, 7)                                            # a width that is padded for the product
    assert invariant.matmul(torch.zeros(0, 16), b).shape == (0, 7)
    assert invariant.bmm(torch.zeros(2, 0, 16), b.expand(2, 16, 7)).shape == (2, 0, 7)
