"""Capability guard: run code under a backend's rules and refuse what its device cannot do.

Every aten op and Python-level host sync inside `with CapabilityGuard(rules):` is checked (lacked dtypes,
forbidden ops, data-dependent shapes, host syncs) and counted per section; an op of the `dsv4gen`
torch.library namespace (a registered device op, lib/torch_ops/registry.py) is one opaque kernel. It knows no backend by name: everything backend-specific arrives in `GuardRules`, built from a profile."""
from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from types import MappingProxyType
from typing import Mapping, NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves

# What a dispatch mode sees on CPU in torch 2.13 (probed; tests/guard/test_guard.py pins each fact):
# - `.item()`, `int/float/bool(t)`, `t.__index__()`, `torch.zeros(t)` reach aten._local_scalar_dense, but
#   `.tolist()` dispatches nothing and `.numpy()` only aten.detach: hence a TorchFunctionMode as well.
#   F.one_hot decomposes into aminmax + two _local_scalar_dense (a range check), so it shows as host syncs.
# - `x[mask]` is aten.index.Tensor with a bool index (CPU runs no nonzero first); `x[mask] = v` is
#   aten.index_put_ with a bool index; one-argument `torch.where(m)` is aten.nonzero; unique is _unique2.
# - A no-op `.to(dtype)` / `.float()` / `.cpu()` returns before dispatch: every aten._to_copy seen copies.

TOP = "(top)"  # the section of ops issued outside any `section()`
# The torch.library namespace of the device ops: one of its ops is one device kernel, checked at its boundary
# only (its CPU emulation stands in for the kernel; the dispatcher hides the ops inside it from the modes).
DEVICE_OP_NAMESPACE = "dsv4gen"
HOST_SYNC = "the host waits for the device queue and graph capture breaks; 310P is launch-bound, PORTING-LESSONS §C"
DATA_DEPENDENT = "L12: shape depends on values, a dynamic-shape AI-CPU op; use where(m, a, b), masked_fill, topk"
# aten ops that hand a device value to the host (torch's data_dependent_output tag, plus the bool results).
HOST_SYNC_OPS = frozenset({"_local_scalar_dense", "item", "equal", "allclose", "is_nonzero"})
# Python-level syncs; on CPU some never reach aten (tolist, numpy), so they are caught one level up.
PY_SYNCS = MappingProxyType({getattr(torch.Tensor, n): f"Tensor.{n}" for n in (
    "item", "tolist", "numpy", "__array__", "__bool__", "__int__", "__float__", "__index__", "__complex__")})
# Indexing ops that are fixed-shape with integer indices but data-dependent with a mask (L12).
MASK_INDEXED = frozenset({"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"})
# Launch rule: an aten op is one kernel launch unless it only relabels memory or allocates. Not counted: ops
# whose schema returns an alias without writing (`OpOverload.is_view`: view, select, slice, t, permute, expand,
# unbind, split, detach, alias, lift_fresh, as_strided ...) when the result does alias an input, Tag.inplace_view
# (t_, unsqueeze_ ...), reshape's `_unsafe_view` (its clone counts), empty* (the allocator launches nothing), size
# queries, and host syncs. An alias-schema op whose result is new memory copied (`to` changing the dtype,
# `contiguous` or `reshape` of a strided tensor, as they reach the modes under inference_mode): one launch.
NO_KERNEL = frozenset({"_unsafe_view", "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                       "new_empty_strided", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"})
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


class GuardRules(NamedTuple):
    name: str                                          # backend name; prefixes every message
    lacks: Mapping[torch.dtype, str]                   # dtype -> why the device lacks it (lesson id)
    forbidden: Mapping[str, str] = MappingProxyType({})  # "aten.x.overload", "aten.x", "x" or a device op -> why
    device_ops: frozenset[str] | None = None           # device ops the backend has; None accepts any


class Violation(NamedTuple):
    kind: str      # "dtype" | "forbidden" | "data-dependent" | "host-sync" | "device-op"
    op: str        # "aten.nonzero.default", "Tensor.tolist" or "device op npu_x"
    reason: str
    where: str     # "path:line in function": innermost frame outside torch and this module
    message: str


class Counts(NamedTuple):
    ops: int                    # kernel launches (see the launch rule above)
    syncs: int                  # host syncs, allowed ones included
    launches: Mapping[str, int]  # op -> launches


class Allowance(NamedTuple):
    reason: str
    where: str
    suppressed: tuple[Violation, ...]


class GuardReport(NamedTuple):
    sections: dict[str, Counts]   # in order of first use; nested sections are joined with "/"
    total: Counts
    violations: tuple[Violation, ...]
    allowed: tuple[Allowance, ...]


class GuardViolation(ValueError):
    def __init__(self, violation: Violation):
        super().__init__(violation.message)
        self.violation = violation


def rules_from_profile(profile) -> GuardRules:
    """The guard's inputs from a `spec.profile.Profile`: lacked dtypes, forbidden ops, device ops."""
    bad = [n for n in profile.dtypes.lacks if not isinstance(getattr(torch, n, None), torch.dtype)]
    if bad:
        raise ValueError(f"backend '{profile.name}': dtypes.lacks names {bad}, which are not torch dtypes")
    lacks = {getattr(torch, n): why for n, why in profile.dtypes.lacks.items()}
    return GuardRules(profile.name, MappingProxyType(lacks), MappingProxyType(dict(profile.forbidden_ops)),
                      frozenset(profile.device_ops))


def _where() -> str:
    # Module names, not paths, decide what to skip: robust to symlinks and editable installs. A module
    # that only forwards calls (the registered device ops' entry points) says so with GUARD_TRANSPARENT.
    f = sys._getframe(1)
    while f.f_back is not None and (f.f_globals.get("__name__", "").partition(".")[0] == "torch"
                                    or f.f_globals.get("__name__") in (__name__, "contextlib")
                                    or f.f_globals.get("GUARD_TRANSPARENT", False)):
        f = f.f_back
    path = f.f_code.co_filename
    return f"{path[len(_REPO):] if path.startswith(_REPO) else path}:{f.f_lineno} in {f.f_code.co_name}"


def _data_dependent(func, args, kwargs) -> bool:
    packet = func.overloadpacket.__name__
    if packet in MASK_INDEXED:
        # a dispatch mode gets `indices` positionally, as a list of optional tensors
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if func is torch.ops.aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    # torch's own tag covers nonzero, masked_select, _unique*, unique_dim/_consecutive, bincount.
    return torch.Tag.dynamic_output_shape in func.tags


def _aliases(out, inputs) -> bool:
    """Whether every tensor `out` holds shares memory with one of the input tensors (a view, not a copy); an empty
    result copies nothing (and its storage pointer, 0, says nothing)."""
    bases = {t.untyped_storage().data_ptr() for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)}
    return all(t.numel() == 0 or t.untyped_storage().data_ptr() in bases
               for t in tree_leaves(out) if isinstance(t, torch.Tensor))


class CapabilityGuard:
    """`with CapabilityGuard(rules, mode="raise"|"count") as g:`; then `g.report()`."""

    def __init__(self, rules: GuardRules, mode: str = "raise"):
        if mode not in ("raise", "count"):
            raise ValueError(f"guard mode '{mode}' (accepted: raise, count)")
        self.rules, self.mode = rules, mode
        self._section = TOP  # nested sections are joined with "/"
        self._launches: dict[str, Counter] = {TOP: Counter()}
        self._syncs: Counter = Counter()
        self._violations: list[Violation] = []
        self._allowed: list[tuple[str, str, list[Violation]]] = []
        self._allow_stack: list[list[Violation]] = []
        self._quiet = 0  # > 0 inside a device op or a Python-level sync: the ops within are not inspected
        self._modes = (_PyLevel(), _Dispatch())  # entered in this order, left in reverse
        for mode in self._modes:
            mode.guard = self

    def __enter__(self) -> CapabilityGuard:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):  # popping a mode cannot fail, so no try/finally between them
            mode.__exit__(*exc)

    @contextlib.contextmanager
    def section(self, name: str):
        outer = self._section
        self._section = name if outer == TOP else f"{outer}/{name}"
        self._launches.setdefault(self._section, Counter())  # every section is a key, even one with no ops
        try:
            yield self
        finally:
            self._section = outer

    @contextlib.contextmanager
    def allow(self, reason: str):
        """Whitelist a region (host bookkeeping off the hot path): ops and syncs still count."""
        suppressed: list[Violation] = []
        self._allowed.append((reason, _where(), suppressed))
        self._allow_stack.append(suppressed)
        try:
            yield self
        finally:
            self._allow_stack.pop()

    def report(self) -> GuardReport:
        sections = {n: Counts(sum(c.values()), self._syncs[n], dict(c)) for n, c in self._launches.items()}
        launches = sum((Counter(c.launches) for c in sections.values()), Counter())
        total = Counts(sum(launches.values()), sum(self._syncs.values()), dict(launches))
        return GuardReport(sections, total, tuple(self._violations),
                           tuple(Allowance(r, w, tuple(s)) for r, w, s in self._allowed))

    def _flag(self, kind: str, op: str, reason: str, what: str) -> None:
        where = _where()
        v = Violation(kind, op, reason, where, f"{self.rules.name} guard: {op} {what} ({reason}) at {where}")
        if self._allow_stack:
            self._allow_stack[-1].append(v)
        else:
            self._violations.append(v)
            if self.mode == "raise":
                raise GuardViolation(v)

    def _sync(self, op: str) -> None:
        self._syncs[self._section] += 1
        self._flag("host-sync", op, HOST_SYNC, "is a host sync")

    def _check_dtypes(self, op: str, tree, verb: str) -> bool:
        lacks = self.rules.lacks
        if not lacks:  # most backends lack nothing: skip the flatten
            return False
        for t in tree_leaves(tree):
            if isinstance(t, torch.Tensor) and t.dtype in lacks:
                self._flag("dtype", op, lacks[t.dtype], f"{verb} {str(t.dtype)[6:]}, which the device lacks")
                return True
        return False

    def _forbidden(self, op: str, *names: str) -> None:
        why = next((self.rules.forbidden[n] for n in names if n in self.rules.forbidden), None)
        if why is not None:
            self._flag("forbidden", op, why, "is forbidden")

    def _on_aten(self, func, args, kwargs):
        if func.namespace == DEVICE_OP_NAMESPACE:
            return self._device_op(func, args, kwargs)
        op, packet = str(func), func.overloadpacket.__name__
        self._forbidden(op, op, f"{func.namespace}.{packet}", packet)
        if packet in HOST_SYNC_OPS:
            self._sync(op)
        elif not (func.is_view or packet in NO_KERNEL or torch.Tag.inplace_view in func.tags):
            self._launches[self._section][op] += 1
        if _data_dependent(func, args, kwargs):
            self._flag("data-dependent", op, DATA_DEPENDENT, "is data-dependent")
        bad_input = self._check_dtypes(op, (args, kwargs), "uses")
        out = func(*args, **kwargs)
        if func.is_view and packet not in HOST_SYNC_OPS and not _aliases(out, (args, kwargs)):
            self._launches[self._section][op] += 1      # a copy under an alias schema (to, contiguous, reshape)
        if not bad_input:  # creation ops and casts: zeros(dtype=bf16), _to_copy
            self._check_dtypes(op, out, "returns")
        return out

    def _device_op(self, func, args, kwargs):
        """A registered device op: one launch of its name, checked at its boundary (dtypes in and out)."""
        name = func.overloadpacket.__name__
        bad_input = self._enter_device_op(name, args, kwargs)
        self._quiet += 1     # the Python-level syncs of its CPU emulation are not the device's
        try:
            out = func(*args, **kwargs)
        finally:
            self._quiet -= 1
        if not bad_input:
            self._check_dtypes(f"device op {name}", out, "returns")
        return out

    def _enter_device_op(self, name: str, args, kwargs) -> bool:
        op = f"device op {name}"
        self._forbidden(op, name)
        if self.rules.device_ops is not None and name not in self.rules.device_ops:
            has = ", ".join(sorted(self.rules.device_ops)) or "none"
            self._flag("device-op", op, f"the profile's device_ops: {has}", "is not a device op of this backend")
        self._launches[self._section][name] += 1
        return self._check_dtypes(op, (args, kwargs), "gets")


class _Dispatch(TorchDispatchMode):
    guard: CapabilityGuard  # set by CapabilityGuard.__init__: torch's mode constructors take no arguments

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        g = self.guard  # quiet: inside a device op or a Python-level sync, already accounted for
        return func(*args, **(kwargs or {})) if g._quiet else g._on_aten(func, args, kwargs or {})


class _PyLevel(TorchFunctionMode):
    guard: CapabilityGuard

    def __torch_function__(self, func, types, args=(), kwargs=None):
        g, kwargs = self.guard, kwargs or {}
        name = None if g._quiet else PY_SYNCS.get(func)
        if name is None:
            return func(*args, **kwargs)
        g._sync(name)
        g._quiet += 1  # the aten._local_scalar_dense it issues is this same sync
        try:
            return func(*args, **kwargs)
        finally:
            g._quiet -= 1


def active_guards() -> list[CapabilityGuard]:
    """Guards in force, outermost first. They are found on torch's own thread-local mode stack, where they
    must be anyway: a module registry or ContextVar could only fall out of step with it."""
    return [m.guard for m in _get_current_dispatch_mode_stack() if isinstance(m, _Dispatch)]


@contextlib.contextmanager
def _in_every_guard(method: str, arg: str):
    with contextlib.ExitStack() as stack:
        for g in active_guards():
            stack.enter_context(getattr(g, method)(arg))
        yield


def section(name: str):
    """Attribute counts to `name` in every active guard (runtime code holds no guard); free without one."""
    return _in_every_guard("section", name)


# The section of a launch a step makes once and every layer of one shape then reuses (an attention kernel's
# tiling, vLLM's per-step attention metadata): nested in whichever layer first needs it, counted per step,
# never per layer (lib/planner/launch_counts.py).
ONCE_PER_STEP = "once per step"


def allow(reason: str):
    """Whitelist a region in every active guard (recorded in each report); free without one."""
    return _in_every_guard("allow", reason)
