"""Checkpoints and parameters: reading and validating, writing, TP slicing, loading into a
backend's runtime formats, expert preconversion, and the tiny checkpoint maker.

Must not import backends, the runtime, the engine or anything above them: the generated loaders
import this package.
"""
