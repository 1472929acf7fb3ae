"""Ascend 910B / 910C (Atlas A2 / A3) backend: device ops in `device_ops.py` (torch_npu, or the CPU emulation)."""
