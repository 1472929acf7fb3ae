"""Ascend 310P (Atlas 300I Duo) backend: device ops in `device_ops.py` (torch_npu, or the quirk-faithful CPU emulation)."""
