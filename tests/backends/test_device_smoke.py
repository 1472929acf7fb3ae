"""Device smoke tests: each device backend's ops and its generated model on the real device.

One test per device backend (`-m npu`: ascend310p, ascend910; `-m dcu`: hip936). Where the device is
absent the test is skipped and says why (`-ra` prints it). Where it is present, the backend's device ops
(backends/<name>/device_ops.py) run on device tensors, so they reach the real torch_npu / ROCm kernels,
and are compared with the CPU emulation (lib/emulation/npu_ops.py) on the same inputs; then the default
tiny checkpoint is loaded for the backend, moved to the device and run through one prefill step, and its
logits must be finite, of the right shape, on the device and close to the emulated CPU run.

The runtime loads parameters on the CPU (`load_model` has no device argument), so this test moves the
parameter tree, the RoPE tables, the batch and the cache to the device itself.
"""
from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch

import backends.ascend310p.device_ops as p310
import backends.ascend910.device_ops as p910
import backends.hip936.device_ops as hip
from lib.emulation import npu_ops as emu
from lib.records.batch import make_batch
from lib.runtime.loaded_model import load_model
from lib.runtime.paged_cache import PagedCache
from lib.runtime.paged_step import paged_step

F16, BF16, I8, I64 = torch.float16, torch.bfloat16, torch.int8, torch.int64
PROMPT = 7  # prefill tokens of the end-to-end step


# ---- is the device here? ------------------------------------------------------------------------------
def _npu_device(model: str) -> str:
    """'npu:0' when torch_npu imports and sees an Ascend `model` (310P / 910) NPU, else skip saying why."""
    if importlib.util.find_spec("torch_npu") is None:
        pytest.skip("no Ascend NPU: torch_npu is not installed (pip install -e '.[ascend]' on a CANN machine)")
    try:
        import torch_npu  # noqa: F401 - registers torch.npu
    except Exception as e:  # noqa: BLE001 - without CANN the import fails in many ways
        pytest.skip(f"no Ascend NPU: torch_npu does not import ({type(e).__name__}: {e})")
    if not torch.npu.is_available():
        pytest.skip("no Ascend NPU: torch_npu imports but torch.npu.is_available() is False")
    try:
        name = str(torch.npu.get_device_name(0))
    except Exception:  # noqa: BLE001 - cannot tell the model: run anyway
        name = ""
    if name and model not in name.upper():
        pytest.skip(f"the NPU is {name!r}, not an Ascend {model}")
    assert emu.real_npu_op("npu_rms_norm") is not None, "an NPU is present but the shims would not reach torch_npu"
    return "npu:0"


def _dcu_device() -> str:
    """'cuda:0' when a ROCm torch sees a gfx936 DCU, else skip saying why."""
    if getattr(torch.version, "hip", None) is None:
        pytest.skip(f"no Hygon DCU: torch {torch.__version__} is not a ROCm build (torch.version.hip is None)")
    if not torch.cuda.is_available():
        pytest.skip(f"no Hygon DCU: ROCm torch (HIP {torch.version.hip}) sees no device "
                    "(torch.cuda.is_available() is False)")
    if not hip.real_gfx936():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        pytest.skip(f"the ROCm device is {props.name!r} ({getattr(props, 'gcnArchName', '?')}), not a gfx936 DCU")
    return "cuda:0"


# ---- helpers --------------------------------------------------------------------------------------------
def _to(x, device):
    """Tensors anywhere in a tree of NamedTuples, tuples, lists and dicts moved to `device` (strides kept)."""
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_to(v, device) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


@contextlib.contextmanager
def _emulated():
    """The CPU emulation even where the real stack is present (the shims' own probes say no)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(emu, "real_npu_op", lambda name: None)
        mp.setattr(hip, "real_gfx936", lambda: False)
        yield


def _both(device: str, op, *args, **kwargs):
    """(device result moved back to the CPU, emulated result) of one shim; args are CPU tensors."""
    got = op(*_to(args, device), **_to(kwargs, device))
    dev_type = torch.device(device).type
    wrong = [tuple(t.shape) for t in _tensors(got) if t.device.type != dev_type]
    assert not wrong, f"{op.__name__}: outputs {wrong} are not on {device}"
    with _emulated():
        want = op(*args, **kwargs)
    return _to(got, "cpu"), want


def _close(got: torch.Tensor, want: torch.Tensor, rel: float, what: str) -> None:
    """Same shape and dtype, finite, and max |got - want| <= rel * max |want|."""
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{what}: device {tuple(got.shape)} {got.dtype}, emulation {tuple(want.shape)} {want.dtype}"
    g, w = got.float(), want.float()
    assert torch.isfinite(g).all(), f"{what}: non-finite values on the device"
    err, scale = (g - w).abs().max().item(), w.abs().max().item()
    assert err <= rel * max(scale, 1e-6), f"{what}: max |device - emulation| = {err:.4g} > {rel} x {scale:.4g}"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _int8(*shape, seed: int) -> torch.Tensor:
    return torch.randint(-127, 128, shape, generator=_gen(seed), dtype=I8)


def _scatter(device: str, module, dtype) -> None:
    x = torch.randn(4, 5, 16, generator=_gen(1)).to(dtype)
    idx, upd = torch.tensor([[0, 1], [3, 4], [2, 0]]), torch.randn(3, 16, generator=_gen(2)).to(dtype)
    got, want = _both(device, module.npu_scatter_nd_update_, x, idx, upd)
    assert torch.equal(got, want), "npu_scatter_nd_update_: device and emulation differ"


def _end_to_end(backend: str, device: str, ckpt) -> None:
    """One prefill step of the tiny checkpoint on the device, against the same step emulated on the CPU."""
    model = load_model(ckpt, backend=backend)
    vocab = model.cfg.vocab_size
    ids = torch.randint(16, vocab, (PROMPT,), generator=_gen(3)).tolist()
    with _emulated():
        store = PagedCache.for_lengths(model, [PROMPT])
        store.add(0)
        (want,) = paged_step(model, make_batch([ids]), store, [0])
    on_device = model._replace(params=_to(model.params, device), rope=_to(model.rope, device))
    store = PagedCache(model, 1, max_seqs=1, device=device)
    store.add(0)
    batch = make_batch([ids])
    (logits,) = paged_step(on_device, batch._replace(tokens=batch.tokens.to(device), positions=batch.positions.to(device)),
                           store, [0])
    assert logits.device.type == torch.device(device).type, f"logits on {logits.device}, not {device}"
    assert tuple(logits.shape) == (PROMPT, vocab), f"logits {tuple(logits.shape)}, expected {(PROMPT, vocab)}"
    assert torch.isfinite(logits).all(), f"{backend}: non-finite logits on {device}"
    assert store.length(0) == PROMPT
    got = logits.float().cpu()
    assert tuple(want.shape) == tuple(got.shape)
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.float().flatten(), dim=0).item()
    assert cos > 0.99, f"{backend}: device logits far from the emulated CPU run (cosine {cos:.4f})"


def _rms_norm(device, module, dtype, tol: float, seed: int) -> torch.Tensor:
    """npu_rms_norm on the device against the emulation; returns its input [6, 128] for the next ops."""
    x = torch.randn(6, 128, generator=_gen(seed)).to(dtype)
    gamma = (1 + 0.1 * torch.randn(128, generator=_gen(seed + 1))).to(dtype)
    (y, rstd), (y_ref, rstd_ref) = _both(device, module.npu_rms_norm, x, gamma, 1e-6)
    _close(y, y_ref, tol, "npu_rms_norm y")
    _close(rstd, rstd_ref, 1e-3, "npu_rms_norm rstd")
    return x


# ---- the backends -----------------------------------------------------------------------------------------
@pytest.mark.npu
def test_ascend310p_on_device(request):
    device = _npu_device("310P")
    x = _rms_norm(device, p310, F16, 1e-2, seed=10)

    w, ws = _int8(32, 128, seed=12), torch.rand(32, generator=_gen(13)) / 50 + 1e-3   # [N, K], [N]
    got, want = _both(device, p310.npu_quant_matmul_dequant, x, w, ws)
    _close(got, want, 2e-2, "npu_quant_matmul_dequant")

    q, s = _int8(3, 32, 128, seed=14), torch.rand(3, 32, generator=_gen(15)) / 50 + 1e-3  # [E, N, K], [E, N]
    group_list = torch.tensor([2, 4, 6], dtype=I64)                                     # cumulative, no tail (L05)
    got, want = _both(device, p310.npu_quant_grouped_matmul_dequant, x, q, s, group_list)
    _close(got, want, 2e-2, "npu_quant_grouped_matmul_dequant")

    _scatter(device, p310, F16)
    _end_to_end("ascend310p", device, request.getfixturevalue("tiny_ckpt"))


@pytest.mark.npu
def test_ascend910_on_device(request):
    device = _npu_device("910")
    x = _rms_norm(device, p910, BF16, 2e-2, seed=20)

    (xq, xs), (xq_ref, xs_ref) = _both(device, p910.npu_dynamic_quant, x)
    _close(xs, xs_ref, 1e-3, "npu_dynamic_quant scale")
    assert xq.dtype == xq_ref.dtype == I8 and xq.shape == xq_ref.shape
    assert (xq.int() - xq_ref.int()).abs().max().item() <= 1, "npu_dynamic_quant: int8 codes differ by more than 1"

    w, scale = _int8(32, 128, seed=22), torch.rand(32, generator=_gen(23)) / 50 + 1e-3  # W8A8 rows [N, K]
    got, want = _both(device, p910.npu_quant_matmul, xq_ref, w.t(), scale, pertoken_scale=xs_ref, output_dtype=BF16)
    _close(got, want, 1e-2, "npu_quant_matmul")

    heads = torch.randn(6, 1, 4, 64, generator=_gen(24)).to(BF16)                       # [T, 1, N, D]
    r1, r2 = (torch.randn(6, 1, 1, 32, generator=_gen(s)).to(BF16) for s in (25, 26))
    got, want = heads.to(device), heads.clone()                                         # rotated in place
    p910.inplace_partial_rotary_mul(got, r1.to(device), r2.to(device), "interleave", [32, 64])
    with _emulated():
        p910.inplace_partial_rotary_mul(want, r1, r2, "interleave", [32, 64])
    _close(got.cpu(), want, 2e-2, "inplace_partial_rotary_mul")

    _scatter(device, p910, BF16)
    _end_to_end("ascend910", device, request.getfixturevalue("tiny_ckpt"))


@pytest.mark.dcu
def test_hip936_on_device(request):
    device = _dcu_device()
    a, w = _int8(5, 64, seed=30), _int8(64, 32, seed=31)
    got, want = _both(device, hip._int_mm, hip.pad_rows_to(a), w)                     # rows padded to 17 (L28)
    assert got.dtype == torch.int32 and torch.equal(got, want), "_int_mm: device and emulation differ"
    assert torch.equal(got[:5], (a.to(I64) @ w.to(I64)).to(torch.int32)), "_int_mm: padded rows changed the product"
    with pytest.raises(RuntimeError, match="greater than 16"):                         # the quirk the emulation copies
        hip._int_mm(hip.pad_rows_to(a, 16).to(device), w.to(device))
    _end_to_end("hip936", device, request.getfixturevalue("tiny_ckpt"))
