"""Hygon DCU gfx936 (BW1000) device ops: stock aten kernels of a ROCm torch, torch._int_mm and
aten._fused_rms_norm, with exactly torch's signatures, registered as the torch ops dsv4gen::<op>.hip936.
A ROCm torch that sees a gfx936 runs them for real; anywhere else a CPU emulation first applies the checks
the ROCm build makes (torch's CPU kernels skip them), so `_int_mm` with M <= 16 raises here as it does on
the DCU (L28).
Must not know the model, tensor names, the planner, or any other chip.
"""
from __future__ import annotations

from types import MappingProxyType

import torch

from lib.emulation import npu_ops as emu
from lib.emulation.registered import device_op

CHIP = "hip936"      # the overload name of its registered ops: torch.ops.dsv4gen.<op>.hip936

# op -> lessons (data/porting-lessons.yaml) whose device behaviour the emulation reproduces
DEVICE_OPS = MappingProxyType({"_int_mm": ("L28",), "_fused_rms_norm": ("L27",)})
INT_MM_MIN_ROWS = 17  # L28: self.size(0) must be > 16; pad to 17 and slice the product back


def real_gfx936() -> bool:
    """A ROCm torch that sees a gfx936 device (its arch name, or the device name, says gfx936)."""
    if not (getattr(torch.version, "hip", None) and torch.cuda.is_available()):
        return False
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return "gfx936" in f"{getattr(props, 'gcnArchName', '')} {props.name}"


@device_op("_int_mm", CHIP)
def _int_mm(self, mat2):
    """int8 [M, K] @ int8 [K, N] -> int32 [M, N], exact. On the real stack the tensors must already be on the
    DCU: CPU tensors would reach torch's CPU kernel, which has none of the quirks."""
    if real_gfx936():
        return torch._int_mm(self, mat2)
    _check_int_mm(self, mat2)
    # exact, as torch's CPU _int_mm is, and faster: 0.33 ms against its 1.9 ms for 64x256 @ 256x128 on an AMD EPYC
    return emu.int_matmul(self, mat2)


@device_op("_fused_rms_norm", CHIP)
def _fused_rms_norm(input, normalized_shape, weight, eps):  # noqa: A002 - torch's name
    """RMSNorm over the trailing `normalized_shape` dims as one kernel: (y in input's dtype, rstd fp32 with
    those dims kept as 1). torch >= 2.9 dispatches it to its CUDA kernel, which a ROCm build compiles
    (native_functions.yaml: `_fused_rms_norm` CUDA: _fused_rms_norm_cuda); the statistics and the product
    are in fp32 (the kernel's accumulate type for bf16 / fp16). The weight is given in input's dtype
    (the kernel reads gamma as the input's type; mixed dtypes are not relied on)."""
    if real_gfx936():
        return torch.ops.aten._fused_rms_norm(input, normalized_shape, weight, eps)
    dims = tuple(range(-len(normalized_shape), 0))
    if tuple(input.shape[input.dim() - len(normalized_shape):]) != tuple(normalized_shape):
        raise RuntimeError(f"_fused_rms_norm: normalized_shape {list(normalized_shape)} is not the trailing shape "
                           f"of input {tuple(input.shape)}")
    if weight is not None and (weight.dtype != input.dtype or tuple(weight.shape) != tuple(normalized_shape)):
        raise RuntimeError(f"_fused_rms_norm: weight {weight.dtype} {tuple(weight.shape)} must have input's dtype "
                           f"{input.dtype} and shape {list(normalized_shape)}")
    xf = input.float()
    rstd = torch.rsqrt(xf.square().mean(dims, keepdim=True) + (torch.finfo(input.dtype).eps if eps is None else eps))
    y = xf * rstd
    return (y if weight is None else y * weight.float()).to(input.dtype), rstd


def pad_rows_to(x: torch.Tensor, rows: int = INT_MM_MIN_ROWS, *, always: bool = False) -> torch.Tensor:
    """x [M, K] -> [max(M, rows), K] with zero rows appended (L28); `_int_mm(pad_rows_to(x), w)[:M]` is the
    unpadded product, because zero rows produce zero rows and touch nothing else. `always`: append (no
    rows, when M >= rows) even so, so the launches do not depend on M."""
    if x.shape[0] >= rows and not always:
        return x
    return torch.nn.functional.pad(x, (0, 0, 0, max(0, rows - x.shape[0])))       # zero rows, one kernel


def _check_int_mm(a: torch.Tensor, b: torch.Tensor) -> None:
    """torch's _int_mm_out_cuda checks (aten/src/ATen/native/cuda/Blas.cpp; hipified for ROCm), same messages."""
    def check(ok: bool, msg: str) -> None:
        if not ok:
            raise RuntimeError(msg)

    check(a.dim() == 2, f"Expected self to be of dimension 2 but got {a.dim()}")
    check(b.dim() == 2, f"Expected mat2 to be of dimension 2 but got {b.dim()}")
    check(a.size(0) > 16, f"self.size(0) needs to be greater than 16, but got {a.size(0)}")  # L28
    check(a.size(1) > 0 and a.size(1) % 8 == 0,
          f"self.size(1) needs to be greater than 0 and a multiple of 8, but got {a.size(1)}")
    check(a.size(1) == b.size(0), f"self.size(1) needs to match mat2.size(0) but got {a.size(1)} and {b.size(0)}")
    check(b.size(1) > 0 and b.size(1) % 8 == 0,
          f"mat2.size(1) needs to be greater than 0 and a multiple of 8, but got {b.size(1)}")
    check(a.dtype == torch.int8, f"Expected self dtype to be of type int8 but got {a.dtype}")
    check(b.dtype == torch.int8, f"Expected mat2 dtype to be of type int8 but got {b.dtype}")
