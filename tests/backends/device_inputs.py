"""Inputs of the device shim tests: seeded generators, random int8 tensors, the exact integer dot
product the quantised matmuls are checked against."""
import torch


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randint8(*shape, seed=0, lo=-127, hi=128):
    return torch.randint(lo, hi, shape, generator=gen(seed), dtype=torch.int8)


def dot(a_row, b_col) -> int:
    return sum(int(u) * int(v) for u, v in zip(a_row.tolist(), b_col.tolist()))
