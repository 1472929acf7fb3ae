"""Shared fixtures: one default tiny checkpoint per session, made the way users make it (B21)."""
import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """The default `make_tiny` checkpoint. Read-only: copy it (shutil.copytree) before corrupting."""
    from lib.weights.tiny_checkpoint import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="session")
def v41_tiny_ckpt(tmp_path_factory):
    """`make-tiny --variant v41-tiny`: a random DeepSeek-V4.1 checkpoint in the release format. Read-only."""
    from lib.weights.tiny_checkpoint import make_tiny

    return make_tiny(tmp_path_factory.mktemp("v41") / "tiny", variant="v41-tiny")
