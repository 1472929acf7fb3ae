"""The loaded parameter tree: every spec tensor read exactly once (B06, B16: a loader that skips the
head or reads the embedding twice is refused), every block's tensors present, experts stacked in
order, embed and head shared with the drafter. Through `load_params` / `load_model` on the
session's `make_tiny` checkpoint (B21).
"""
import re

import pytest
import torch

from backends.cpu._generated.loader import converter_for
from lib.quant.reference_formats import decode
from lib.runtime.loaded_model import load_model
from lib.weights.checkpoint import Checkpoint, CheckpointError, LoadLedger
from lib.weights.params import load_params


# ------------------------------------------------------------------ B06 / B16: exactly once

class ForgetfulCheckpoint(Checkpoint):
    """A loader that 'knows' the head needs no reading and hands back a fake instead (B06)."""

    def read_parts(self, logical, ledger=None, index=None):
        if logical.entry.tensor_class == "head":
            return {p.role: torch.zeros(p.shape, dtype=torch.bfloat16) for p in logical.parts}
        return super().read_parts(logical, ledger, index)


class DraftEmbedCheckpoint(Checkpoint):
    """A loader whose drafter reads the target's embedding again for itself (B16)."""

    def read_parts(self, logical, ledger=None, index=None):
        if logical.key == "mtp.0.main_norm.weight":
            embed = next(t for t in self.logical if t.key == "embed.weight")
            super().read_parts(embed, ledger)
        return super().read_parts(logical, ledger, index)


@pytest.mark.parametrize("cls, line", [(ForgetfulCheckpoint, "head.weight: never loaded"),
                                       (DraftEmbedCheckpoint, "embed.weight: loaded 2 times")])
def test_load_params_proves_exactly_once(tiny_ckpt, cls, line):
    with pytest.raises(CheckpointError) as err:
        load_params(cls(tiny_ckpt), converter_for)
    assert str(err.value) == f"loader did not read every spec tensor exactly once:\n{line}"


def test_load_ledger_directly(tiny_ckpt):
    ckpt = Checkpoint(tiny_ckpt)
    by_key = {t.key: t for t in ckpt.logical}
    ledger = LoadLedger(ckpt.logical)
    for t in ckpt.logical:
        if t.key not in ("head.weight", "mtp.2.markov_head.markov_w1.weight"):
            ledger.mark(t)
    ledger.mark(by_key["layers.2.ffn.experts.7.w3.weight"])
    with pytest.raises(CheckpointError) as err:
        ledger.check()
    assert str(err.value).split("\n") == [
        "loader did not read every spec tensor exactly once:", "head.weight: never loaded",
        "mtp.2.markov_head.markov_w1.weight: never loaded", "layers.2.ffn.experts.7.w3.weight: loaded 2 times"]
    with pytest.raises(CheckpointError, match="loaded 2 times"):
        ledger.check(allowed_unread={"head.weight", "mtp.2.markov_head.markov_w1.weight"})


# ------------------------------------------------------------------ the loaded parameter tree

@pytest.fixture(scope="module")
def tiny_model(tiny_ckpt):
    return load_model(tiny_ckpt)


def test_params_hold_every_tensor_per_block(tiny_ckpt, tiny_model):
    params, ckpt = tiny_model.params, Checkpoint(tiny_ckpt)
    want: dict[str, set[str]] = {}
    for t in ckpt.logical:
        m = re.match(r"(layers\.\d+|mtp\.\d+)\.(.*)$", t.key)
        scope, rel = (m.group(1), m.group(2)) if m else ("model", t.key)
        want.setdefault(scope, set()).add(re.sub(r"experts\.\d+\.", "experts.", rel))
    assert set(params.model) == want["model"] == {"embed.weight", "head.weight", "norm.weight",
                                                  "hc_head_fn", "hc_head_base", "hc_head_scale"}
    assert len(params.layers) == 6 and len(params.drafter) == 3
    derived = {"ffn.experts.placement"}           # built by the loader (tensors.yaml `derived`)
    for i, block in enumerate(params.layers):
        assert set(block) == want[f"layers.{i}"] | derived, i
    for s, block in enumerate(params.drafter):
        assert set(block) == want[f"mtp.{s}"] | derived, s
    placement = params.layers[0]["ffn.experts.placement"]
    assert placement.ep_size == 1 and placement.ranks == (0,)
    assert placement.local_of.tolist() == [list(range(8))]
    assert "main_proj.weight" in params.drafter[0] and "main_proj.weight" not in params.drafter[1]
    assert params.drafter[2]["markov_head.markov_w1.weight"].shape == (1024, 16)
    assert "attn.indexer.wq_b.weight" in params.layers[2] and "attn.indexer.wq_b.weight" not in params.layers[3]


def test_params_experts_stacked_in_order(tiny_ckpt, tiny_model):
    ckpt = Checkpoint(tiny_ckpt)
    by_key = {t.key: t for t in ckpt.logical}
    for name, block in [("layers.3", tiny_model.params.layers[3]), ("mtp.1", tiny_model.params.drafter[1])]:
        assert block["ffn.experts.w1.weight"].shape == (8, 128, 256)
        assert block["ffn.experts.w3.weight"].shape == (8, 128, 256)
        assert block["ffn.experts.w2.weight"].shape == (8, 256, 128)
        for e in (0, 5, 7):
            t = by_key[f"{name}.ffn.experts.{e}.w2.weight"]
            assert torch.equal(block["ffn.experts.w2.weight"][e], decode(t.format, ckpt.read_parts(t), ckpt.config))


def test_params_share_embed_and_head_with_the_drafter(tiny_ckpt, tiny_model):
    params, ckpt = tiny_model.params, Checkpoint(tiny_ckpt)
    for key in ("embed.weight", "head.weight"):
        assert torch.equal(params.model[key], ckpt.read(key).float())
        assert all(key not in block for block in (*params.layers, *params.drafter))
    tensors = [v for block in (params.model, *params.layers, *params.drafter) for v in block.values()
               if isinstance(v, torch.Tensor)]
    assert all(bool(torch.isfinite(v).all()) for v in tensors if v.is_floating_point())   # nothing uninitialised
    assert params.layers[0]["ffn.gate.tid2eid"].dtype == torch.int64
