"""The device composites' Sinkhorn (backends/common/hc.py: on the logs, one log_softmax per step, the eps frame
restored once per pair) against the reference's division chain (backends/cpu/ops/hc.py) in fp64, and the reference's
hand-written backward, which training differentiates through, against autograd's of that chain."""
from __future__ import annotations

import pytest
import torch

from backends.common import hc as composite
from backends.cpu.ops import hc as reference


def _reference_fp64(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    return reference.sinkhorn(logits.double(), iters, eps)


@pytest.mark.parametrize("scale", [0.1, 1.0, 5.0, 20.0, 200.0])
def test_log_domain_sinkhorn_is_the_reference_within_fp32_rounding(scale):
    """At large logit scales some columns hold only ~eps mass, where the + eps of each denominator decides the
    result (a log_softmax without the restored frame is off by ~1e-2 there); the composite stays within the
    error of the reference's own chain run in fp32."""
    torch.manual_seed(0)
    logits = torch.randn(4096, 4, 4) * scale
    want = _reference_fp64(logits, 20, 1e-6)
    got = composite._sinkhorn(torch.softmax(logits, dim=-1), 20, 1e-6).double()
    fp32_chain = reference.sinkhorn(logits, 20, 1e-6).double()
    chain_err = (fp32_chain - want).abs().max().item()
    assert (got - want).abs().max().item() <= max(4 * chain_err, 1e-6)
    assert ((got - want).abs() / want).max().item() < 1e-4


def test_one_iteration_is_the_column_step_alone():
    logits = torch.tensor([[[3.0, -1.0], [0.5, 2.0]]])
    probs = torch.softmax(logits, dim=-1) + 1e-6
    want = probs / (probs.sum(dim=-2, keepdim=True) + 1e-6)
    assert torch.allclose(composite._sinkhorn(torch.softmax(logits, dim=-1), 1, 1e-6), want, rtol=1e-6, atol=0)


def test_the_eps_frame_sums_to_one_along_its_last_row():
    """The last row must survive a row step unchanged: its entries sum to one."""
    frame, log_frame, edge = composite._eps_frame(4, 1e-6, torch.device("cpu"))
    assert abs(frame[4].double().sum().item() - 1.0) < 1e-7
    assert torch.allclose(log_frame.exp(), frame)
    assert edge.sum().item() == 9 and edge[4].all() and edge[:, 4].all()


def _division_chain(c0: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """§3.3 step 8 written as the plain chain, every division differentiated by autograd."""
    c = torch.softmax(c0, dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


@pytest.mark.parametrize("iters", [1, 2, 20])
def test_the_reference_sinkhorn_trains_through_its_own_backward(iters):
    """Training differentiates the reference's Sinkhorn through a hand-written backward: the same values as the
    chain, with or without gradients, and the chain's gradient (fp64: to rounding; and torch's numerical check)."""
    torch.manual_seed(1)
    logits = torch.randn(32, 4, 4, dtype=torch.float64) * 3
    mine, chain = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    out, want = reference.sinkhorn(mine, iters, 1e-6), _division_chain(chain, iters, 1e-6)
    assert torch.equal(out, want) and torch.equal(reference.sinkhorn(logits, iters, 1e-6), want.detach())
    weights = torch.randn_like(want)
    (out * weights).sum().backward()
    (want * weights).sum().backward()
    assert torch.allclose(mine.grad, chain.grad, rtol=1e-12, atol=1e-14)
    small = torch.randn(3, 4, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: reference.sinkhorn(t, iters, 1e-6), (small,))
