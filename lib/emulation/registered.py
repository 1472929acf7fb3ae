"""`@device_op(name, chip)`: a device module's shim registered as the torch op `dsv4gen::<name>.<chip>`
with the recorded schema of `name` (torch_npu 2.14.0's, vllm-ascend's DeepSeek-V4 custom ops', or the installed
torch's for hip936's aten kernels) and
its fake kernel (lib/emulation/op_fakes.py). The schema comes from the record, never from the
Python signature, so a shim whose signature drifts from it fails when torch binds its arguments.
"""
from __future__ import annotations

import functools

from lib.emulation import op_fakes
from lib.torch_ops import registry
from lib.torch_ops.schemas import VLLM_ASCEND_FILE, aten_schema, load_schemas


@functools.lru_cache(maxsize=1)
def _schemas() -> dict:
    """vllm-ascend's DeepSeek-V4 custom ops, then torch_npu 2.14.0's schemas: a name in both
    (npu_lightning_indexer, the same arguments) is registered as torch_npu has it."""
    return {**load_schemas(VLLM_ASCEND_FILE), **load_schemas()}


def schema_of(name: str):
    """The recorded schema a device op is registered with; a name not recorded is a stock aten kernel (hip936's),
    whose schema is the installed torch's (an unknown name raises there, naming the torch version)."""
    recorded = _schemas()
    return recorded[name] if name in recorded else aten_schema(name)


def device_op(name: str, chip: str, soc: str | None = None):
    """Register the decorated shim as `name` on `chip` (a backend name); `soc`: the emulation's chip,
    for the fakes whose output shapes follow one of its quirks."""
    fake = op_fakes.FAKES[name]
    if name in op_fakes.NEEDS_SOC:
        fake = functools.partial(fake, soc=soc)
    return registry.device_op(chip, schema_of(name).text, fake)
