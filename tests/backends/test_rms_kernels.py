"""Every RMS of the device composites (the main norms, the per-head q norm, the compressed entry's norm,
the hyper-connection mixing norm) is one device kernel: `npu_rms_norm` on the Ascend backends,
`_fused_rms_norm` on hip936. Each gives what the fp32 composite (backends/common/dense.py:rms) gives and
counts as one launch under the capability guard. CPU only: the emulations."""
import pytest
import torch

import backends.hip936.device_ops as hip
from backends.ascend310p import lowerings as l310
from backends.ascend910 import lowerings as l910
from backends.common import dense, hc
from backends.hip936 import lowerings as lhip
from lib.guard.capability import CapabilityGuard, rules_from_profile
from spec.profile import load_profile

BACKENDS = {"ascend310p": (l310, torch.float16), "ascend910": (l910, torch.bfloat16), "hip936": (lhip, torch.bfloat16)}


def _x(*shape, dtype, seed=0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_each_rms_is_the_composite_in_one_launch(backend):
    low, dt = BACKENDS[backend]
    cases = [(_x(5, 64, dtype=dt), None), (_x(5, 64, dtype=torch.float32, seed=1), _x(64, dtype=dt, seed=2).float()),
             (_x(5, 4, 32, dtype=dt, seed=3), None)]
    guard = CapabilityGuard(rules_from_profile(load_profile(backend)), mode="raise")
    for i, (x, w) in enumerate(cases):
        want = dense.rms(x, w, 1e-6)
        low._rms(x, w, 1e-6)              # the first call of a width makes its unit gamma (dense.unit_weight), once
        with guard, guard.section(f"case {i}"):
            got = low._rms(x, w, 1e-6)
        assert got.dtype == x.dtype and torch.equal(got, want), (backend, x.shape, x.dtype)
        assert guard.report().sections[f"case {i}"].ops == 1       # one kernel, whatever the case
    q = _x(3, 4 * 16, dtype=dt, seed=4)
    assert torch.equal(low.head_rms_norm(q, 4, 1e-6), dense.head_rms_norm(q, 4, 1e-6))


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_hc_mixing_through_the_kernel_is_the_composites(backend):
    low, dt = BACKENDS[backend]
    x, fn = _x(3, 4, 32, dtype=torch.float32, seed=5), _x(24, 128, dtype=torch.float32, seed=6) / 10
    base, scale = _x(24, dtype=torch.float32, seed=7), torch.tensor([0.5, 0.7, 0.9])
    want = hc.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6, dtype=dt)
    got = low.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_hip_main_norm_normalises_an_fp32_input_before_rounding():
    w = _x(64, dtype=torch.bfloat16, seed=8)
    for x in (_x(4, 64, dtype=torch.bfloat16, seed=9), _x(4, 64, dtype=torch.float32, seed=10)):
        assert torch.equal(lhip.rms_norm(x, w, 1e-6), dense.rms_norm(x, w, 1e-6))


def test_hip_fused_rms_norm_emulation_checks_what_it_relies_on():
    x = _x(2, 8, dtype=torch.bfloat16)
    y, rstd = hip._fused_rms_norm(x, [8], None, None)          # eps None: the input dtype's epsilon
    assert rstd.dtype == torch.float32 and rstd.shape == (2, 1)
    assert torch.equal(y, dense.rms(x, None, torch.finfo(torch.bfloat16).eps))
    with pytest.raises(RuntimeError, match="must have input's dtype"):
        hip._fused_rms_norm(x, [8], torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="trailing shape"):
        hip._fused_rms_norm(x, [4], None, 1e-6)
