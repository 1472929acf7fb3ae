"""Every device op is a torch.library op `dsv4gen::<name>.<chip>` with the schema the device stack
records for it (torch_npu's, vllm-ascend's, torch's own for `_int_mm`), one kernel and a fake one.

Why registered ops and not Python functions: a registered op is one node to the dispatcher, so the
capability guard counts it as one launch without looking inside, `torch.export` and graph capture
trace it as one opaque call (its fake kernel gives the output shapes and dtypes without running
the emulation), and the schema is checked by torch at every call, not only by a test.

The overload name is the chip: the same torch_npu op on 310P and 910 has one schema but device
quirks of its own (lib/emulation/npu_ops.py), so `torch.ops.dsv4gen.npu_rms_norm.ascend310p` and
`.ascend910` are two kernels of one op. The kernel is registered for CompositeExplicitAutograd (every
backend key): it calls the real torch_npu / ROCm op where the device stack is present, else the
CPU emulation; the fake kernel serves FakeTensor and meta tensors.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from lib.guard.capability import DEVICE_OP_NAMESPACE

GUARD_TRANSPARENT = True     # a guard report names the caller of an entry point, not this module
_LIBRARY = torch.library.Library(DEVICE_OP_NAMESPACE, "FRAGMENT")
_REGISTERED: dict[str, Callable] = {}          # "name.chip" -> the Python entry point


def qualified(name: str, chip: str) -> str:
    return f"{DEVICE_OP_NAMESPACE}::{name}.{chip}"


def registered() -> dict[str, Callable]:
    """Every op registered so far: "name.chip" -> its entry point (with `.op`, `.kernel`)."""
    return dict(_REGISTERED)


def device_op(chip: str, schema_text: str, fake: Callable) -> Callable[[Callable], Callable]:
    """Register the decorated kernel as `dsv4gen::<name>.<chip>` with `schema_text` (the recorded
    `name(params) -> returns`) and `fake`; return a Python function of the kernel's signature that
    calls the registered op (so every call goes through the dispatcher)."""
    name, params = schema_text.split("(", 1)
    name = name.split("::")[-1].strip()

    def wrap(kernel: Callable) -> Callable:
        key = f"{name}.{chip}"
        if key in _REGISTERED:
            raise ValueError(f"device op {qualified(name, chip)} is registered twice "
                             f"({_REGISTERED[key].kernel.__module__} and {kernel.__module__})")
        _LIBRARY.define(f"{key}({params}")
        _LIBRARY.impl(key, kernel, "CompositeExplicitAutograd")
        torch.library.register_fake(qualified(name, chip), fake, lib=_LIBRARY)
        op = getattr(getattr(getattr(torch.ops, DEVICE_OP_NAMESPACE), name), chip)

        @functools.wraps(kernel)
        def call(*args, **kwargs):
            return op(*args, **kwargs)

        call.op, call.kernel, call.device_op = op, kernel, name
        _REGISTERED[key] = call
        return call
    return wrap
