"""MTP speculative decoding (lib/engine/mtp_drafting.py) on a V4-Pro-shaped tiny checkpoint: the drafter
the engine runs incrementally (its window ring written as requests commit, chained steps over speculative
rows) proposes exactly what the MTP layer gives when evaluated from scratch on the same history, and the
refusals name what was asked and what the checkpoint carries. Losslessness on every backend:
tests/engine_invariance.py (run by tests/engine/test_engine.py); conformance's engine stage on any backend."""
from __future__ import annotations

import pytest
import torch

from lib.engine.llm_engine import Engine, EngineConfig
from lib.engine import mtp_drafting as mtp
from lib.engine.sampling import SamplingParams
from lib.runtime.loaded_model import load_model
from lib.runtime.paged_cache import PagedCache
from lib.runtime.paged_step import prefill_logits
from lib.weights.tiny_checkpoint import embedded_tiny, make_tiny
from tests.helpers import prompt_ids


@pytest.fixture(scope="module")
def pro(tmp_path_factory):
    return load_model(make_tiny(tmp_path_factory.mktemp("pro") / "ckpt", variant="pro-tiny"), "cpu")


def _greedy(logits: torch.Tensor, k: int):
    return logits.argmax(-1), None


def _from_scratch(model, tokens: list[int], drafts: int) -> tuple[list[int], list[float]]:
    """The MTP chain after `tokens` (committed ones and the anchor) in a fresh cache: every position's
    target state from one prefill, the layer's ring built in one pass over the whole history."""
    _, states = prefill_logits(model, tokens[:-1], with_hidden=True)
    store = PagedCache.for_lengths(model, [len(tokens) + drafts], slack=1 + drafts, rings=True)
    store.add(0)
    block = mtp.propose(model, store, [0], [mtp.MTPContext(0, states, tokens[1:])], drafts, _greedy)
    return block.tokens[0].tolist(), block.confidence[0].tolist()


@pytest.mark.parametrize("drafts", [1, 3])
def test_engine_drafts_equal_the_layer_from_scratch(pro, drafts):
    seen = []

    def watched(model, requests, store, choose):
        block = engine._mtp_drafter(model, requests, store, choose)
        seen.extend((list(r.tokens), block.tokens[i].tolist(), block.confidence[i].tolist()) for i, r in enumerate(requests))
        return block

    engine = Engine(pro, EngineConfig(max_num_seqs=4, speculative="mtp", num_speculative_tokens=drafts,
                                      adaptive_drafting=False), drafter=watched)
    prompts = [prompt_ids(n, 1024, seed=n) for n in (5, 23, 40)]      # windows of 16: short, crossing, long
    engine.generate(prompts, SamplingParams(max_tokens=20))
    assert len(seen) > 12
    for tokens, got, confidence in seen[::5]:
        want, want_confidence = _from_scratch(pro, tokens, drafts)
        assert got == want
        assert torch.allclose(torch.tensor(confidence), torch.tensor(want_confidence), atol=1e-5)


def test_mtp_output_is_plain_output(pro):
    prompts = [prompt_ids(n, 1024, seed=n) for n in (9, 30)]
    params = SamplingParams(max_tokens=24)
    plain = [r.output for r in Engine(pro, EngineConfig(speculative="none")).generate(prompts, params)]
    for mode in ("auto", "mtp", "deepseek_mtp"):
        engine = Engine(pro, EngineConfig(speculative=mode, num_speculative_tokens=2, adaptive_drafting=False))
        assert engine.method == "mtp" and engine.gamma == 2
        assert [r.output for r in engine.generate(prompts, params)] == plain
        assert sum(engine.drafted) > 0


def test_refusals_name_the_drafter(pro):
    with pytest.raises(ValueError, match=r"--speculative dspark, but the checkpoint carries a one-layer MTP drafter "
                                         r"\(mtp.0\); use --speculative mtp or none"):
        Engine(pro, EngineConfig(speculative="dspark"))
    flash = load_model(embedded_tiny(), "cpu")
    with pytest.raises(ValueError, match=r"--speculative mtp, but the checkpoint carries a DSpark drafter"):
        Engine(flash, EngineConfig(speculative="mtp"))
    with pytest.raises(ValueError, match="proposes a block of 5"):
        Engine(flash, EngineConfig(speculative="dspark", num_speculative_tokens=6))
    with pytest.raises(ValueError, match="must be at least 1"):
        Engine(pro, EngineConfig(speculative="mtp", num_speculative_tokens=0))
    with pytest.raises(ValueError, match="speculative mode 'eagle' is not one of auto, dspark, mtp, none"):
        Engine(pro, EngineConfig(speculative="eagle"))
    assert Engine(pro, EngineConfig(speculative="none")).method is None
