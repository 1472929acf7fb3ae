"""Hygon DCU gfx936 (BW1000) backend: device op in `device.py` (ROCm torch._int_mm, or the CPU emulation)."""
