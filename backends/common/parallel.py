"""The tensor-parallel collectives as graph ops (spec/graph.yaml `tp_sum`, `tp_gather`).

Device-agnostic: they hand the tensor to lib.distributed.process_group, which is the identity in a single process
(group None) and torch.distributed (gloo on CPU, HCCL / RCCL on devices) otherwise.
"""
from __future__ import annotations

import torch

from lib.distributed import process_group as parallel


def tp_sum(x: torch.Tensor, *, group) -> torch.Tensor:
    """All-reduce of this rank's partial sum (row-parallel projection, vocab-split embedding)."""
    return parallel.all_reduce(x, group)


def tp_gather(x: torch.Tensor, *, group) -> torch.Tensor:
    """Every rank's slice of the last dim, concatenated in rank order (vocab-split LM head)."""
    return parallel.all_gather(x, group, dim=-1)
