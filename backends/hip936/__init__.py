"""Hygon DCU gfx936 (BW1000) backend: device op in `device_ops.py` (ROCm torch._int_mm, or the CPU emulation)."""
