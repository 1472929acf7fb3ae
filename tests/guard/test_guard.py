"""The capability guard (lib/guard/capability.py) on CPU: refusals with op, reason and source line, count mode,
launch counting per section, opaque device ops (registered torch ops: test ones under the overload "test"),
allow(), and the torch dispatch facts it relies on."""
import contextlib
import sys

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lib.guard.capability import (TOP, CapabilityGuard, Counts, GuardRules, GuardViolation, allow,
                                  rules_from_profile, section)
from lib.torch_ops.registry import device_op

BF16 = "no BF16 Cast/RmsNorm/index_copy_ (L02)"
P310 = GuardRules("p310", {torch.bfloat16: BF16, torch.float8_e4m3fn: "no FP8 execution (L01)"},
                  {"aten.index_put_": "L12: index_put fails on the AI-CPU"}, frozenset({"npu_fake", "npu_outer"}))
OPEN = GuardRules("open", {})   # lacks nothing, forbids nothing: only the built-in refusals apply
HERE = "tests/guard/test_guard.py"


def _here() -> int:
    return sys._getframe(1).f_lineno


def _no_modes() -> bool:
    return torch._C._len_torch_dispatch_stack() == 0 and torch._C._len_torch_function_stack() == 0


def test_bf16_creation_names_op_reason_and_this_line():
    with pytest.raises(GuardViolation) as err, CapabilityGuard(P310):
        line = _here() + 1
        torch.zeros(2, dtype=torch.bfloat16)
    assert str(err.value) == (f"p310 guard: aten.zeros.default returns bfloat16, which the device lacks ({BF16}) "
                              f"at {HERE}:{line} in test_bf16_creation_names_op_reason_and_this_line")
    assert isinstance(err.value, ValueError) and err.value.violation.kind == "dtype"


def test_op_on_a_lacked_dtype_made_outside_the_guard_raises():
    x, w = torch.ones(2, dtype=torch.bfloat16), torch.ones(2)
    with pytest.raises(GuardViolation, match=rf"aten\.add\.Tensor uses bfloat16, .* at {HERE}:{_here() + 2} "), \
            CapabilityGuard(P310):
        x + 1
    with pytest.raises(GuardViolation, match=r"aten\._to_copy\.default returns float8_e4m3fn, .*\(no FP8 execution"), \
            CapabilityGuard(P310):
        w.to(torch.float8_e4m3fn)


def _set_mask(x, m):
    x[m] = 0


HOST_SYNCS = {
    "item": (lambda x, m, i: x[0].item(), "Tensor.item"),
    "tolist": (lambda x, m, i: x.tolist(), "Tensor.tolist"),
    "bool": (lambda x, m, i: bool(m[0]), "Tensor.__bool__"),
    "int": (lambda x, m, i: int(i[0]), "Tensor.__int__"),
    "float": (lambda x, m, i: float(x[0]), "Tensor.__float__"),
    "index": (lambda x, m, i: [1, 2, 3][i[1]], "Tensor.__index__"),
    "numpy": (lambda x, m, i: x.numpy(), "Tensor.numpy"),
    "np.asarray": (lambda x, m, i: np.asarray(x), "Tensor.__array__"),
    "if any": (lambda x, m, i: 1 if m.any() else 0, "Tensor.__bool__"),
    "size from tensor": (lambda x, m, i: torch.zeros(i[1]), "aten._local_scalar_dense.default"),
    "equal": (lambda x, m, i: torch.equal(x, x), "aten.equal.default"),
    "one_hot": (lambda x, m, i: torch.nn.functional.one_hot(i, 4), "aten._local_scalar_dense.default"),
}
DATA_DEPENDENT = {
    "nonzero": (lambda x, m, i: torch.nonzero(m), "aten.nonzero.default"),
    "where(m)": (lambda x, m, i: torch.where(m), "aten.nonzero.default"),
    "x[mask]": (lambda x, m, i: x[m], "aten.index.Tensor"),
    "x[mask] = 0": (lambda x, m, i: _set_mask(x, m), "aten.index_put_.default"),
    "masked_select": (lambda x, m, i: x.masked_select(m), "aten.masked_select.default"),
    "unique": (lambda x, m, i: torch.unique(i), "aten._unique2.default"),
    "repeat_interleave": (lambda x, m, i: torch.repeat_interleave(i), "aten.repeat_interleave.Tensor"),
    "bincount": (lambda x, m, i: torch.bincount(i), "aten.bincount.default"),
}


def _inputs():
    return torch.tensor([1.0, -2.0, 3.0]), torch.tensor([True, False, True]), torch.tensor([0, 2, 1])


@pytest.mark.parametrize("case", HOST_SYNCS, ids=list(HOST_SYNCS))
def test_host_syncs_raise(case):
    fn, op = HOST_SYNCS[case]
    x, m, i = _inputs()
    with pytest.raises(GuardViolation) as err, CapabilityGuard(OPEN):
        fn(x, m, i)
    assert (err.value.violation.kind, err.value.violation.op) == ("host-sync", op)
    assert str(err.value).startswith(f"open guard: {op} is a host sync (")
    assert f" at {HERE}:" in str(err.value) and _no_modes()


@pytest.mark.parametrize("case", DATA_DEPENDENT, ids=list(DATA_DEPENDENT))
def test_data_dependent_ops_raise_citing_l12(case):
    fn, op = DATA_DEPENDENT[case]
    x, m, i = _inputs()
    where = rf"at {HERE}:\d+ in (<lambda>|_set_mask)$"
    with pytest.raises(GuardViolation, match=rf"^open guard: {op} is data-dependent \(L12: .* {where}"):
        with CapabilityGuard(OPEN):
            fn(x, m, i)


def test_fixed_shape_alternatives_pass():
    x, m, i = _inputs()
    with CapabilityGuard(P310, mode="count") as g:
        torch.where(m, x, torch.zeros_like(x)), torch.where(m, x, 0.0), x.masked_fill(~m, 0.0)
        torch.topk(x, 2), torch.argsort(x), torch.sort(x), x.gather(0, i), x.index_select(0, i)
        torch.zeros(3).scatter(0, i, x), torch.zeros(3).scatter_add(0, i, x), torch.zeros(3).index_add(0, i, x)
        torch.zeros(3).index_copy(0, i, x), x[i], torch.nonzero_static(m, size=3), i.repeat_interleave(2)
        torch.repeat_interleave(i, i, output_size=3), torch.zeros(5).index_put((i,), x)  # int index: fixed shape
    assert g.report().violations == ()


def test_forbidden_op_raises_with_the_profile_reason():
    x, _, i = _inputs()
    with pytest.raises(GuardViolation, match=r"^p310 guard: aten\.index_put_\.default is forbidden \(L12: index_put"):
        with CapabilityGuard(P310):
            x[i] = 0.0


def test_count_mode_collects_every_violation_in_order():
    x, m, i = _inputs()
    with CapabilityGuard(P310, mode="count") as g:
        first = _here() + 1
        x[0].item()
        torch.nonzero(m)
        x.to(torch.bfloat16)
        x.tolist()
        x[i] = 1.0
    got = [(v.kind, v.op, v.where) for v in g.report().violations]
    fn = "test_count_mode_collects_every_violation_in_order"
    assert got == [("host-sync", "Tensor.item", f"{HERE}:{first} in {fn}"),
                   ("data-dependent", "aten.nonzero.default", f"{HERE}:{first + 1} in {fn}"),
                   ("dtype", "aten._to_copy.default", f"{HERE}:{first + 2} in {fn}"),
                   ("host-sync", "Tensor.tolist", f"{HERE}:{first + 3} in {fn}"),
                   ("forbidden", "aten.index_put_.default", f"{HERE}:{first + 4} in {fn}")]
    assert g.report().total.syncs == 2


def test_launches_per_section_are_exact_and_views_free():
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    with CapabilityGuard(OPEN) as g:
        y = torch.empty(4)  # allocation only
        with g.section("layers.3 (hca)"):
            y = x + 1
            y = y + w
            y = y + 2
            z = y @ w.T                             # permute (a view) + mm
            z.view(16), z[0], z[:, 1:], z.t(), z.detach(), z.reshape(2, 8), z.unsqueeze(0).expand(2, 4, 4)
            w.t_(), w.unsqueeze_(0)                 # in-place metadata changes
            with section("attn"):               # the module-level fan-out reaches this guard
                z.float()                           # a no-op cast dispatches nothing
                z.to(torch.float16)
        with g.section("layers.4 (csa)"):
            pass
    rep = g.report()
    assert rep.sections == {TOP: Counts(0, 0, {}),
                            "layers.3 (hca)": Counts(4, 0, {"aten.add.Tensor": 3, "aten.mm.default": 1}),
                            "layers.3 (hca)/attn": Counts(1, 0, {"aten._to_copy.default": 1}),
                            "layers.4 (csa)": Counts(0, 0, {})}
    assert rep.total == Counts(5, 0, {"aten.add.Tensor": 3, "aten.mm.default": 1, "aten._to_copy.default": 1})


def test_syncs_are_counted_per_section():
    x = torch.ones(3)
    with CapabilityGuard(OPEN, mode="count") as g:
        with g.section("sampler"):
            x.sum().item(), x.tolist(), int(x[0])
    assert g.report().sections["sampler"] == Counts(1, 3, {"aten.sum.default": 1})


@device_op("test", "npu_fake(Tensor x) -> Tensor", fake=lambda x: torch.empty_like(x))
def _fake_kernel(x):
    """CPU emulation full of things the device guard would refuse; the real device runs one kernel."""
    assert x.abs().sum().item() >= 0 and bool(torch.nonzero(x).numel() >= 0)
    return (x.to(torch.bfloat16) * 2).to(x.dtype)


@device_op("test", "npu_outer(Tensor x) -> Tensor", fake=lambda x: torch.empty_like(x))
def _outer_kernel(x):
    return _fake_kernel(x) + 1


def test_device_op_is_one_opaque_launch():
    x = torch.ones(3)
    with CapabilityGuard(P310) as g:
        y = _fake_kernel(x)
        z = _outer_kernel(y)                        # a device op inside a device op: still one launch
    assert torch.equal(z, torch.full((3,), 5.0))
    rep = g.report()
    assert rep.total == Counts(2, 0, {"npu_fake": 1, "npu_outer": 1}) and rep.violations == ()
    assert torch.equal(_fake_kernel(x), torch.full((3,), 2.0)) and _fake_kernel.device_op == "npu_fake"


def test_device_op_boundary_is_checked():
    x = torch.ones(3, dtype=torch.bfloat16)
    with pytest.raises(GuardViolation) as err, CapabilityGuard(P310):
        line = _here() + 1
        _fake_kernel(x)
    assert str(err.value) == (f"p310 guard: device op npu_fake gets bfloat16, which the device lacks ({BF16}) "
                              f"at {HERE}:{line} in test_device_op_boundary_is_checked")
    undeclared = P310._replace(device_ops=frozenset({"npu_outer"}))
    with pytest.raises(GuardViolation, match=r"device op npu_fake is not a device op of this backend \(the profile's "
                                             r"device_ops: npu_outer\)"), CapabilityGuard(undeclared):
        _fake_kernel(torch.ones(3))
    with pytest.raises(GuardViolation, match=r"device op npu_fake is forbidden \(L10: no fused op\)"), \
            CapabilityGuard(P310._replace(forbidden={"npu_fake": "L10: no fused op"})):
        _fake_kernel(torch.ones(3))


def test_allow_suppresses_and_records():
    x, m, _ = _inputs()
    with CapabilityGuard(OPEN) as g:
        line = _here() + 1
        with g.allow("host-side bookkeeping"):
            x[m], x.tolist()
        with allow("logging"):                      # module-level, fans out to every active guard
            pass
    rep = g.report()
    assert [(a.reason, a.where, [v.op for v in a.suppressed]) for a in rep.allowed] == [
        ("host-side bookkeeping", f"{HERE}:{line} in test_allow_suppresses_and_records",
         ["aten.index.Tensor", "Tensor.tolist"]),
        ("logging", f"{HERE}:{line + 2} in test_allow_suppresses_and_records", [])]
    assert rep.violations == () and rep.total == Counts(1, 1, {"aten.index.Tensor": 1})


def test_no_mode_survives_exit_or_an_exception():
    with CapabilityGuard(OPEN):
        assert not _no_modes()
    assert _no_modes()
    with pytest.raises(GuardViolation), CapabilityGuard(OPEN):
        torch.ones(1).item()
    assert _no_modes()
    with pytest.raises(KeyError), CapabilityGuard(OPEN):
        raise KeyError("unrelated")
    assert _no_modes() and torch.ones(1).item() == 1.0 and torch.ones(1).tolist() == [1.0]
    assert torch.equal(_fake_kernel(torch.ones(1)), torch.full((1,), 2.0))    # free again


def test_nested_guards_each_see_everything_once():
    with CapabilityGuard(OPEN, mode="count") as outer:
        with CapabilityGuard(P310, mode="count") as inner:
            torch.ones(2) + 1, _fake_kernel(torch.ones(2)), torch.ones(2).tolist()
    for g in (outer, inner):
        assert g.report().total == Counts(5, 1, {"aten.ones.default": 3, "aten.add.Tensor": 1, "npu_fake": 1})
        assert [v.op for v in g.report().violations] == ["Tensor.tolist"]


def test_rules_from_profile():
    from spec.profile import DTypes, Lowering, Profile, RuntimeFormats

    def profile(lacks):
        return Profile(name="p310", doc="d", compute_dtype="float16", dtypes=DTypes(has=("float16",), lacks=lacks),
                       op_default=Lowering(impl="reference", reason="r"), runtime_formats=RuntimeFormats("dense_f16"),
                       forbidden_ops={"aten.nonzero": "L12: dynamic shape"})
    rules = rules_from_profile(profile({"bfloat16": BF16}))
    assert rules == GuardRules("p310", {torch.bfloat16: BF16}, {"aten.nonzero": "L12: dynamic shape"}, frozenset())
    with pytest.raises(ValueError, match=r"backend 'p310': dtypes.lacks names \['bfloat61'\], which are not torch"):
        rules_from_profile(profile({"bfloat61": "typo"}))
    with pytest.raises(ValueError, match=r"guard mode 'warn' \(accepted: raise, count\)"):
        CapabilityGuard(rules, mode="warn")


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fn, ops", [
    (lambda x, m, i: x.tolist(), []),                                   # why a TorchFunctionMode is needed
    (lambda x, m, i: x.numpy(), ["aten.detach.default"]),
    (lambda x, m, i: x[0].item(), ["aten.select.int", "aten._local_scalar_dense.default"]),
    (lambda x, m, i: x[m], ["aten.index.Tensor"]),                      # no nonzero first on CPU
    (lambda x, m, i: torch.where(m), ["aten.nonzero.default", "aten.unbind.int"]),
    (lambda x, m, i: x.float(), []),                                    # a no-op cast never dispatches
], ids=["tolist", "numpy", "item", "x[mask]", "where(m)", "noop cast"])
def test_torch_dispatch_facts_the_guard_relies_on(fn, ops):
    rec, inputs = _Record(), _inputs()
    with rec:
        fn(*inputs)
    assert rec.ops == ops


@pytest.mark.parametrize("inference", [False, True])
def test_a_view_schema_op_counts_a_launch_only_when_it_copies(inference):
    """Under inference_mode `to`, `contiguous` and `reshape` reach the guard undecomposed, with schemas that return
    a view: each is a kernel exactly when its result is new memory (a cast, a strided tensor made contiguous)."""
    x = torch.randn(4, 6)

    def launches(fn) -> int:
        guard = CapabilityGuard(OPEN, mode="count")
        with (torch.inference_mode() if inference else contextlib.nullcontext()), guard:
            fn()
        return guard.report().total.ops

    assert launches(lambda: x.to(torch.bfloat16)) == 1
    assert launches(lambda: x.t().contiguous()) == 1 and launches(lambda: x.t().reshape(-1)) == 1
    assert launches(lambda: x.to(torch.float32)) == 0 and launches(lambda: x.contiguous()) == 0
    assert launches(lambda: x.view(6, 4)) == 0 and launches(lambda: x.reshape(-1)) == 0
