"""Backend profiles: every lesson that concerns a backend is in its profile, every lowering names
an implementation with the op's port signature, and every device op exists with its schema."""
from __future__ import annotations

import importlib
import inspect

import pytest
import torch
import yaml

from codegen.lower import Rewrite
from lib.porting.rendering import rendered
from lib.quant.reference_formats import resolve
from lib.guard.capability import CapabilityGuard, GuardViolation, rules_from_profile
from lib.emulation.registered import schema_of
from lib.torch_ops.schemas import check_signature
from spec.graph import load_graph, program_ops
from spec.profile import backend_names, load_profile
from spec.tables import SPEC_DIR

LESSONS = yaml.safe_load((SPEC_DIR.parent / "data" / "porting-lessons.yaml").read_text())["lessons"]
DEVICES = [b for b in backend_names() if b != "cpu"]


@pytest.mark.parametrize("backend", DEVICES)
def test_every_lesson_of_the_backend_is_in_its_profile(backend):
    wanted = {lid for lid, lesson in LESSONS.items() if backend in lesson["backends"]}
    have = set(load_profile(backend).lessons)
    assert wanted and wanted <= have, f"{backend} profile misses {sorted(wanted - have)}"
    assert have <= set(LESSONS)


@pytest.mark.parametrize("backend", backend_names())
def test_every_lowering_has_the_op_port_signature(backend):
    profile, graph = load_profile(backend), load_graph().graph
    for name in sorted(program_ops(graph)):
        op = graph.ops[name]
        entry = profile.ops.get(name)
        lowerings = list(entry.by_format.values()) if entry is not None and entry.by_format else [profile.lowering(name)]
        for low in lowerings:
            fn = resolve(op.reference if low.impl == "reference" else low.call)
            params = list(inspect.signature(fn).parameters)
            assert params[: len(op.inputs)] == list(op.inputs), f"{backend} {name}: {low.call}"
            assert set(op.attrs) <= set(params[len(op.inputs):]), f"{backend} {name}: {low.call}"


@pytest.mark.parametrize("backend", DEVICES)
def test_device_ops_exist_with_their_recorded_schema(backend):
    profile = load_profile(backend)
    device = importlib.import_module(f"backends.{backend}.device_ops")
    assert set(profile.device_ops) == set(device.DEVICE_OPS)
    for name in profile.device_ops:
        # torch_npu's schema, vllm-ascend's for its DeepSeek-V4 custom ops, the installed torch's for hip936's aten kernels
        assert check_signature(getattr(device, name), schema_of(name)) == []
    for low in (l for e in profile.ops.values() for l in (e.by_format.values() if e.by_format else [e.single()])):
        assert set(low.device_ops) <= set(profile.device_ops)


def bf16_hc_post(y, x, post, comb):
    """A lowering of `hc_post` that slips into bf16 (rendered into the 310P code below)."""
    from backends.common import hc

    return hc.hc_post(y.to(torch.bfloat16), x, post, comb)


def test_310p_guard_catches_a_lowering_that_reaches_bf16(tmp_path):
    """The 310P generated code runs clean under its guard; a composite that slips into bf16 is named."""
    from lib.runtime.loaded_model import load_model
    from lib.runtime.paged_step import prefill_logits
    from lib.weights.tiny_checkpoint import make_tiny

    tiny = make_tiny(tmp_path / "ckpt")
    model = load_model(tiny, "ascend310p")
    rules = rules_from_profile(load_profile("ascend310p"))
    with CapabilityGuard(rules):
        prefill_logits(model, [20, 21, 22])
    with rendered("ascend310p", Rewrite(calls={"hc_post": "tests.spec.test_profiles:bf16_hc_post"}), "test") as code:
        slipped = load_model(tiny, "ascend310p", code=code)
        with pytest.raises(GuardViolation, match=r"bfloat16.*test_profiles.py:\d+"):
            with CapabilityGuard(rules):
                prefill_logits(slipped, [20, 21, 22])
