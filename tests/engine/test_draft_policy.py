"""Adaptive drafting (lib/engine/draft_policy.py): the gate follows measured speed, a request verifies only the
drafts it is estimated to keep, and the engine's output is the plain greedy output whatever the policy decides.

The gate is driven here with stated step timings (the engine feeds it wall-clock ones); the engine tests hold the
gate open so their drafting does not depend on this machine's speed."""
from __future__ import annotations

import pytest
import torch

import lib.engine.drafting as dspark
from lib.engine import draft_policy as dp
from lib.engine.draft_policy import DraftPolicy
from lib.engine.greedy import greedy
from lib.engine.llm_engine import Engine, EngineConfig
from lib.engine.sampling import SamplingParams
from lib.runtime.loaded_model import load_model
from lib.weights.tiny_checkpoint import embedded_tiny
from tests.helpers import prompt_ids


def _steps(policy: DraftPolicy, n: int, draft_s: float, plain_s: float) -> str:
    """Run n decode steps of one token each, drafting ones taking draft_s and plain ones plain_s: the modes chosen."""
    chosen = ""
    for _ in range(n):
        drafted = policy.draft_this_step()
        policy.step_done(drafted, draft_s if drafted else plain_s, 1, requests=1)
        chosen += "D" if drafted else "p"
    return chosen


def test_the_gate_measures_both_modes_then_keeps_the_faster_and_probes_the_other_with_growing_backoff():
    policy = DraftPolicy(gamma=5)
    chosen = _steps(policy, 110, draft_s=2.0, plain_s=1.0)      # drafting costs twice a plain step per token
    # measured once each, then probed after BACKOFF steps times 2 (it was twice as slow), then after twice that
    assert chosen.startswith("Dp" + "p" * 2 * dp.BACKOFF + "D")
    probes = [i for i, c in enumerate(chosen) if c == "D"]
    assert [b - a for a, b in zip(probes, probes[1:])] == [2 * dp.BACKOFF + 2, 4 * dp.BACKOFF + 1]
    assert policy.drafting is False
    # the drafter starts paying: the next probe finds it faster and the gate opens; plain is then the probed mode
    chosen = _steps(policy, 200, draft_s=0.4, plain_s=1.0)
    opened = chosen.index("D")
    assert policy.drafting is True and opened <= dp.MAX_BACKOFF and chosen[opened:].count("p") <= 4
    assert _steps(DraftPolicy(gamma=5, adaptive=False), 20, 2.0, 1.0) == "D" * 20   # not adaptive: always drafts


def test_one_lucky_probe_does_not_switch_the_gate_two_winning_ones_do():
    policy = DraftPolicy(gamma=5)
    chosen = _steps(policy, 2 + 2 * dp.BACKOFF, draft_s=2.0, plain_s=1.0)     # plain chosen, drafting probed next
    assert chosen.endswith("p") and policy.drafting is False and policy.draft_this_step() is True
    policy.step_done(True, 1.0, 2, requests=1)          # a probe whose drafts were accepted by chance: 0.5 s a token
    assert policy.drafting is False and policy.draft_this_step() is True              # taken once more first
    policy.step_done(True, 2.4, 1, requests=1)          # the drafter's usual: together 3.4 s for 3 tokens, plain 1.0
    assert policy.drafting is False and policy.draft_this_step() is False
    assert _steps(policy, 2 * 4 * dp.BACKOFF, draft_s=2.0, plain_s=1.0).count("D") == 1      # backed off further
    chosen = _steps(policy, 4 * dp.MAX_BACKOFF, draft_s=0.4, plain_s=1.0)    # the drafter starts paying
    assert policy.drafting is True and chosen[chosen.index("D"):].startswith("DD")


def test_the_gate_rates_a_mode_by_its_seconds_over_its_tokens_not_by_an_average_of_each_steps_rate():
    policy, chosen, drafting_steps = DraftPolicy(gamma=5), "", 0
    for _ in range(200):
        drafted = policy.draft_this_step()
        tokens = (5 if drafting_steps % 2 == 0 else 1) if drafted else 1     # drafts accepted every other step
        drafting_steps += drafted
        policy.step_done(drafted, 2.0 if drafted else 1.0, tokens, requests=1)
        chosen += "D" if drafted else "p"
    # drafting emits 6 tokens in 4 s, 0.67 s a token against plain's 1 s; the average of its steps' rates (0.4 and
    # 2.0 s a token, about 1.2 s however they are weighted in turn) would rate it slower and close the gate
    assert policy.drafting is True and chosen.count("p") <= 3


def test_a_request_verifies_what_its_running_acceptance_says_survives_and_pauses_when_nothing_does():
    policy, head = DraftPolicy(gamma=5), [0.0] * 5
    assert policy.planned("r") == 5
    # a coin-flip prior: survival 0.5, 0.25, 0.125 ... -> the first two positions pass MIN_SURVIVAL
    assert policy.length("r", head, 5) == 2
    for _ in range(6):                                           # every verified draft accepted
        policy.verified("r", head, policy.length("r", head, 5), accepted=5)
    assert policy.length("r", head, 5) == 5                      # the block grew back to gamma as positions proved out
    assert policy.length("r", head, 3) == 3                      # never more than planned
    for _ in range(30):                                          # now every first draft rejected
        n = policy.length("r", head, 5)
        if n == 0:
            break
        policy.verified("r", head, n, accepted=0)
    assert n == 0 and policy.requests["r"].paused == dp.BACKOFF
    assert [policy.planned("r") for _ in range(dp.BACKOFF + 1)] == [0] * dp.BACKOFF + [5]   # then a full block again


def test_a_new_request_starts_from_what_the_engines_drafts_have_been_worth():
    policy, head = DraftPolicy(gamma=5), [0.0] * 5
    for _ in range(8):                                           # an earlier request whose drafts always survived
        policy.verified("a", head, policy.length("a", head, 5), accepted=5)
    assert policy.length("b", head, 5) == 2                      # while it runs, no other request's rounds count
    policy.forget("a")
    assert policy.length("c", head, 5) == 5                      # once it finished: a full block from the first round
    doubtful = DraftPolicy(gamma=5)
    for _ in range(8):                                           # an earlier request whose first draft never survived
        doubtful.verified("a", head, 1, accepted=0)
    doubtful.forget("a")
    assert doubtful.length("b", head, 5) == 1                    # the new request verifies a single draft
    for _ in range(12):                                          # and its own rounds outweigh the engine's in time
        doubtful.verified("b", head, doubtful.length("b", head, 5), accepted=5)
    assert doubtful.length("b", head, 5) == 5


def test_the_confidence_head_is_followed_once_it_predicts_this_request_better_than_its_running_acceptance():
    policy = DraftPolicy(gamma=5)
    sure, doubtful = [8.0] * 5, [8.0, 8.0, -8.0, -8.0, -8.0]
    for _ in range(dp.TRUST_ROUNDS - 1):
        policy.verified("r", sure, 2, accepted=2)
    assert policy.length("r", doubtful, 5) == 2 + 1              # not yet trusted: the running rates (plus one untried)
    policy.verified("r", sure, 2, accepted=2)
    assert policy.length("r", doubtful, 5) == 2                  # trusted: the head's sigmoid(-8) ends the block
    wrong = DraftPolicy(gamma=5)
    for _ in range(2 * dp.TRUST_ROUNDS):                         # a head that says "accept" and is always wrong
        wrong.verified("r", sure, 1, accepted=0)
    assert wrong.requests["r"].head_brier > wrong.requests["r"].rate_brier
    assert wrong.length("r", sure, 5) == 0                       # its running acceptance decides, not the head


@pytest.fixture(scope="module")
def cpu_model():
    return load_model(embedded_tiny(), "cpu")


def _gate_open(engine: Engine) -> Engine:
    engine.policy.draft_this_step = lambda: True                 # drafting never depends on this machine's timings
    return engine


@pytest.mark.parametrize("kind", ["oracle", "wrong"])
def test_an_adaptive_engine_is_lossless_drafts_full_blocks_that_survive_and_stops_drafting_ones_that_do_not(
        cpu_model, kind):
    prompt = prompt_ids(17, 1024, seed=31)
    target = prompt + list(greedy(cpu_model, prompt, 60))
    gamma = dspark.block_size(cpu_model)

    def drafter(model, requests, store, choose):
        starts = [r.computed for r in requests]
        rows = [target[s + 1: s + 1 + gamma] for s in starts]
        tokens = torch.tensor(rows if kind == "oracle" else [[(t + 1) % 1024 for t in r] for r in rows])
        return dspark.DraftBlock(tokens, None, torch.zeros(len(starts), gamma))

    engine = _gate_open(Engine(cpu_model, EngineConfig(max_num_seqs=2, speculative="dspark"), drafter=drafter))
    (req,) = engine.generate([prompt], SamplingParams(max_tokens=60))
    assert req.output == target[len(prompt):]
    rounds = req.drafted[0]
    if kind == "oracle":
        assert req.accepted == req.drafted and req.drafted[-1] >= rounds - 4    # full blocks after a short ramp
    else:
        assert req.accepted == [0] * gamma and 0 < rounds <= 10      # a few rounds, then paused and probed rarely
