"""The trained tiny checkpoint shipped in the repository: what `python -m serve` and `dsv4gen eval` use without
--model, so first use does not train.

It is the `tiny` preset (every layer kind of Flash and the 3-stage DSpark drafter) trained on the task mix by
`dsv4gen train-tiny` (lib/training), in the official format (FP8 block weights, MXFP4 experts) with the task mix's
tokenizer; its training.json records the command and seed that reproduce it, the training time and the held-out
accuracy. Random checkpoints for tests and tools stay `make-tiny`'s (lib/weights/tiny_checkpoint.py).
"""
from __future__ import annotations

from pathlib import Path

SHIPPED_TINY = Path(__file__).resolve().parent / "shipped" / "deepseek-v4-tiny"
TRAINING_RECORD = "training.json"     # beside the weights of every checkpoint train-tiny writes


def shipped_tiny() -> Path:
    """The shipped trained checkpoint's folder; a clear error where an install left it out."""
    if not (SHIPPED_TINY / "config.json").exists() or not (SHIPPED_TINY / TRAINING_RECORD).exists():
        raise FileNotFoundError(f"the trained tiny checkpoint is missing from {SHIPPED_TINY} (an install without "
                                "the package data?); pass --model, or rebuild it with the command in the README")
    return SHIPPED_TINY
