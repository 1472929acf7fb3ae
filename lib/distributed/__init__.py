"""Tensor and expert parallelism below the model: the process group, TP collectives, EP exchange.

Must not import weights, backends, the runtime or anything above them.
"""
