import pytest

from lib.weights.tiny_checkpoint import make_tiny


@pytest.fixture(scope="session")
def long_tiny(tmp_path_factory):
    """The tiny-long preset: Flash's window 128 and compress ratios 4 / 128 (the fused compressor's and attention's),
    top-k 64 (padded to the attention kernel's 512), at tiny widths."""
    return make_tiny(tmp_path_factory.mktemp("tiny-long") / "ckpt", preset="tiny-long")
