"""Every device op is a registered torch op `dsv4gen::<op>.<backend>` whose schema is the recorded one, and
whose fake kernel agrees with its CPU kernel on the calls a real prefill and decode step make (the tiny
checkpoint through load_model and the paged step, B21); the guard counts each call as one launch."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import backends.ascend310p.device_ops as p310
import backends.ascend910.device_ops as p910
import backends.hip936.device_ops as hip
from lib.emulation.registered import schema_of
from lib.emulation.relaxed import relaxed_widths
from lib.guard.capability import DEVICE_OP_NAMESPACE, CapabilityGuard, rules_from_profile
from lib.records.batch import make_batch
from lib.runtime.loaded_model import load_model
from lib.runtime.paged_cache import PagedCache
from lib.runtime.paged_step import paged_step
from lib.torch_ops.registry import registered
from lib.torch_ops.schemas import parse_schema
from spec.profile import load_profile

MODULES = {"ascend310p": p310, "ascend910": p910, "hip936": hip}
OPS = [(b, op) for b, m in MODULES.items() for op in m.DEVICE_OPS]


@pytest.mark.parametrize("backend, op", OPS, ids=[f"{b}.{op}" for b, op in OPS])
def test_registered_schema_is_the_recorded_one(backend, op):
    overload = getattr(getattr(torch.ops.dsv4gen, op), backend)
    live, recorded = parse_schema(str(overload._schema), "registered"), schema_of(op)
    assert live.name == f"{op}.{backend}"            # parse_schema drops the dsv4gen:: namespace
    assert live.params == recorded.params and live.returns == recorded.returns
    entry = getattr(MODULES[backend], op)
    assert entry.op is overload and registered()[f"{op}.{backend}"] is entry


def test_nothing_else_is_registered():
    assert set(registered()) >= {f"{op}.{b}" for b, op in OPS}
    assert {k for k in registered() if not k.endswith(".test")} == {f"{op}.{b}" for b, op in OPS}


class _Calls(TorchDispatchMode):
    """Records every device-op call (inputs cloned before it runs: some ops write in place)."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == DEVICE_OP_NAMESPACE:
            clone = lambda v: v.clone() if isinstance(v, torch.Tensor) else (
                [clone(t) for t in v] if isinstance(v, (list, tuple)) else v)
            self.calls.setdefault(func, (tuple(clone(a) for a in args), {k: clone(v) for k, v in kwargs.items()}))
        return func(*args, **kwargs)


def _step_calls(backend: str, ckpt) -> dict:
    # widths relaxed: the tiny checkpoint then runs the fused kernels the profile would choose for Flash
    with relaxed_widths():
        return _calls_of_a_step(backend, ckpt)


def _calls_of_a_step(backend: str, ckpt) -> dict:
    model = load_model(ckpt, backend, progress=False)
    store = PagedCache.for_lengths(model, [12])
    store.add(0)
    with _Calls() as rec:
        paged_step(model, make_batch([list(range(20, 31))], [0]), store, [0])
        paged_step(model, make_batch([[7]], [11], last_only=True), store, [0])
    return rec.calls


def _i8(*shape, seed=0):
    return torch.randint(-127, 128, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


# inputs of the device ops the tiny checkpoint's steps do not call (other expert modes, in-place updates)
def _sas_inputs(metadata_only: bool = False):
    """npu_sparse_attn_sharedkv (and its tiling buffer) over one window block: a tiny model's window of 16 is not
    the kernel's 128, so no tiny step calls it."""
    cu, used = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([10], dtype=torch.int32)
    shape = {"cmp_ratio": 1, "ori_win_left": 127, "layout_q": "TND", "layout_kv": "PA_ND"}
    meta_args = ((4, 1, 512, cu, None, None, None, used), {"batch_size": 1, "cmp_topk": 0, "has_cmp_kv": False,
                                                          "device": "cpu", **shape})
    if metadata_only:
        return meta_args
    meta = p910.npu_sparse_attn_sharedkv_metadata(*meta_args[0], **meta_args[1])
    return ((torch.randn(2, 4, 512).bfloat16(),), {
        "ori_kv": torch.randn(1, 144, 1, 512).bfloat16(), "ori_block_table": torch.zeros(1, 1, dtype=torch.int32),
        "cu_seqlens_q": cu, "seqused_kv": used, "sinks": torch.zeros(4), "metadata": meta, "softmax_scale": 512 ** -0.5,
        **shape})


def _compressor_inputs():
    """compressor at ratio 4 with the overlap over two state blocks of 16 rows: a tiny model's ratio 8 is not one
    the kernel takes, so no tiny step calls it. Position 7 completes entry 1, position 5 none."""
    d, hid = 128, 1024
    return ((torch.randn(2, hid).bfloat16(), torch.randn(2 * d, hid).bfloat16(), torch.randn(2 * d, hid).bfloat16(),
             torch.zeros(3, 16, 4 * d), torch.zeros(4, 2 * d), torch.ones(d).bfloat16(), torch.zeros(2, 64).bfloat16(),
             torch.ones(2, 64).bfloat16(), torch.tensor([[1], [2]], dtype=torch.int32),
             torch.tensor([0, 1, 2], dtype=torch.int32), None, torch.tensor([7, 5], dtype=torch.int32), 64, 4, 2, 1e-6,
             2, 1), {})


NOT_IN_A_STEP = {
    "compressor": _compressor_inputs,
    "npu_sparse_attn_sharedkv": _sas_inputs,
    "npu_sparse_attn_sharedkv_metadata": lambda: _sas_inputs(metadata_only=True),
    "npu_scatter_nd_update_": lambda: ((torch.zeros(4, 8, dtype=torch.float16), torch.tensor([[1], [3]]),
                                        torch.ones(2, 8, dtype=torch.float16)), {}),
    "npu_quant_matmul": lambda: ((_i8(3, 32), _i8(32, 16, seed=1), torch.full((16,), 0.01)), {"output_dtype": 5}),
    "npu_grouped_matmul": lambda: (([torch.randn(6, 32).half()], [torch.randn(2, 32, 16).half()]),
                                   {"group_list": torch.tensor([3, 6]), "split_item": 2, "group_type": 0}),
    # ascend910 combines with npu_moe_finalize_routing on one EP rank; the unpermute serves its EP exchange
    "npu_moe_token_unpermute": lambda: ((torch.randn(4, 16).bfloat16(), torch.tensor([2, 0, 3, 1], dtype=torch.int32),
                                         torch.rand(2, 2).bfloat16()), {}),
}


@pytest.mark.parametrize("backend", list(MODULES))
def test_fake_kernels_match_the_cpu_kernels_on_a_real_step(backend, tiny_ckpt):
    calls = {op.overloadpacket.__name__: (op, inputs) for op, inputs in _step_calls(backend, tiny_ckpt).items()}
    assert calls, f"{backend}: a prefill and a decode step called no device op"
    for name in set(MODULES[backend].DEVICE_OPS) - set(calls):
        calls[name] = (getattr(MODULES[backend], name).op, NOT_IN_A_STEP[name]())
    assert set(calls) == set(MODULES[backend].DEVICE_OPS)          # every device op's fake kernel is checked
    with relaxed_widths():
        for name, (op, (args, kwargs)) in calls.items():
            torch.library.opcheck(op, args, kwargs, test_utils=("test_schema", "test_faketensor"))


def test_a_registered_op_is_one_launch_and_its_inside_is_not_inspected():
    # npu_rms_norm's emulation runs pow/mean/rsqrt/mul/to: under the guard it is one launch of its name
    x, g = torch.randn(4, 64, dtype=torch.float16), torch.ones(64, dtype=torch.float16)
    with CapabilityGuard(rules_from_profile(load_profile("ascend310p"))) as guard:
        y, rstd = p310.npu_rms_norm(x, g)
    assert guard.report().total.launches == {"npu_rms_norm": 1}
    assert y.dtype == torch.float16 and rstd.shape == (4, 1)
