"""Token selection (lib/engine/sampling.py, lib/engine/stops.py): parameter ranges, the sampled distribution, exact
sampling, logprobs, lossless speculative verification (statistically, against the target distribution),
the 310P capability guard over the whole sampler (B20), and streaming stop strings."""
from __future__ import annotations

import math

import pytest
import torch

from lib.guard.capability import CapabilityGuard, GuardViolation, rules_from_profile
from lib.engine.sampling import (SamplingParams, Verdict, make_generator, prompt_logprobs, sample, target_probs,
                          token_logprobs, verify, verify_batch, verify_on_device)
from lib.engine.stops import StopChecker
from spec.profile import load_profile

P310 = rules_from_profile(load_profile("ascend310p"))
SAMPLED = SamplingParams(temperature=1.0)


def _counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(ids.flatten(), minlength=vocab).double()


def _chi_square_p(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """p-value of Pearson's chi-square over the cells the distribution allows (regularised upper gamma)."""
    expected = expected_probs.double().flatten() * observed.sum()
    observed = observed.flatten()
    allowed = expected > 0
    stat = ((observed - expected) ** 2 / expected.clamp_min(1e-300)).where(allowed, 0.0).sum()
    dof = int(allowed.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def _assert_same_distribution(observed: torch.Tensor, expected_probs: torch.Tensor, tv_bound: float):
    expected_probs = expected_probs.double()
    assert observed.flatten()[expected_probs.flatten() == 0].sum() == 0, "emitted a token the target excludes"
    tv = 0.5 * (observed / observed.sum() - expected_probs).abs().sum()
    assert tv < tv_bound, f"total variation {float(tv):.4f}"
    assert _chi_square_p(observed, expected_probs) > 1e-3


# --- parameters -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, accepted", [
    ("max_tokens", 0, ">= 1"),
    ("temperature", -0.1, "0 <= temperature <= 2"),
    ("temperature", 2.5, "0 <= temperature <= 2"),
    ("temperature", math.nan, "0 <= temperature <= 2"),
    ("top_p", 0.0, "0 < top_p <= 1"),
    ("top_p", 1.5, "0 < top_p <= 1"),
    ("top_k", -2, "-1 <= top_k <= 100"),
    ("top_k", 101, "-1 <= top_k <= 100"),
    ("logprobs", 21, "None or 0..20"),
    ("prompt_logprobs", -1, "None or 0..20"),
    ("stop_token_ids", (5, 100), "token ids in 0..99"),
    ("stop", ("",), "non-empty strings"),
])
def test_validate_names_the_field_and_its_range(field, value, accepted):
    with pytest.raises(ValueError) as err:
        SamplingParams(**{field: value}).validate(100)
    assert str(err.value).startswith(f"{field}=") and f"(accepted: {accepted}" in str(err.value)


def test_validate_accepts_the_edges_and_returns_the_params():
    for params in (SamplingParams(), SamplingParams(temperature=2.0, top_p=1e-9, top_k=-1, logprobs=20,
                                                    prompt_logprobs=0, max_tokens=1, stop=("x",)),
                   SamplingParams(top_k=100, stop_token_ids=(0, 99))):
        assert params.validate(100) is params


# --- the sampled distribution -----------------------------------------------------------------------------

def test_greedy_is_the_one_hot_of_argmax_with_ties_to_the_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.5, -1.0, 0.2, 0.7]])
    assert target_probs(logits, SamplingParams()).tolist() == [[0, 1, 0, 0], [0, 0, 0, 1]]
    # top_k=1 and a tiny top_p are greedy at any temperature, with the same tie rule (stable sort)
    for params in (SamplingParams(temperature=1.3, top_k=1), SamplingParams(temperature=0.7, top_p=1e-6)):
        assert target_probs(logits, params).tolist() == [[0, 1, 0, 0], [0, 0, 0, 1]]


def test_rows_sum_to_one_under_every_filter():
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(0)) * 3
    for params in (SAMPLED, SamplingParams(temperature=0.3, top_k=7), SamplingParams(temperature=1.7, top_p=0.6),
                   SamplingParams(temperature=0.9, top_k=50, top_p=0.9), SamplingParams(top_k=300, temperature=1.0)):
        probs = target_probs(logits, params)
        assert probs.dtype == torch.float32 and probs.shape == logits.shape
        torch.testing.assert_close(probs.sum(-1), torch.ones(8))
        assert (probs >= 0).all()


def test_top_k_and_top_p_keep_the_expected_tokens():
    logits = torch.tensor([0.3, 0.1, 0.5, 0.1]).log().unsqueeze(0)  # probs at temperature 1
    torch.testing.assert_close(target_probs(logits, SamplingParams(temperature=1.0, top_k=2)),
                               torch.tensor([[0.375, 0.0, 0.625, 0.0]]))
    # nucleus: the smallest sorted prefix whose mass reaches top_p (0.5 | 0.5+0.3 | ...)
    torch.testing.assert_close(target_probs(logits, SamplingParams(temperature=1.0, top_p=0.45)),
                               torch.tensor([[0.0, 0.0, 1.0, 0.0]]))
    torch.testing.assert_close(target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7)),
                               torch.tensor([[0.375, 0.0, 0.625, 0.0]]))
    # exact boundary on uniform logits: mass 0.5 is reached by 2 tokens, so top_p=0.5 keeps 2, the lowest ids
    uniform = torch.zeros(1, 4)
    assert target_probs(uniform, SamplingParams(temperature=1.0, top_p=0.5)).tolist() == [[0.5, 0.5, 0.0, 0.0]]
    torch.testing.assert_close(target_probs(uniform, SamplingParams(temperature=0.5, top_k=3)),
                               torch.tensor([[1 / 3, 1 / 3, 1 / 3, 0.0]]))
    # top-k first, then top-p on the renormalised survivors: 0.625 >= 0.6 keeps one token
    torch.testing.assert_close(target_probs(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.6)),
                               torch.tensor([[0.0, 0.0, 1.0, 0.0]]))


def test_temperature_sharpens_below_one_and_flattens_above():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)) * 2

    def entropy(t):
        p = target_probs(logits, SamplingParams(temperature=t))
        return -(p * p.clamp_min(1e-30).log()).sum(-1)
    torch.testing.assert_close(target_probs(logits, SAMPLED), torch.softmax(logits, -1))
    cold, warm, hot = entropy(0.3), entropy(1.0), entropy(2.0)
    assert (cold < warm).all() and (warm < hot).all() and (hot < math.log(50)).all()


# --- sampling -----------------------------------------------------------------------------------------------

def test_sample_frequencies_match_the_probabilities():
    probs = torch.tensor([0.45, 0.25, 0.2, 0.1, 0.0])
    ids = sample(probs.expand(20000, 5), make_generator(1234, 0))
    assert ids.shape == (20000,) and ids.dtype == torch.int64
    _assert_same_distribution(_counts(ids, 5), probs, 0.01)


def test_sample_of_one_hot_rows_is_deterministic():
    probs = target_probs(torch.randn(64, 30, generator=torch.Generator().manual_seed(2)), SamplingParams())
    for seed in (0, 1, 2):
        assert sample(probs, make_generator(seed, 0)).tolist() == probs.argmax(-1).tolist()


def test_seeded_generators_reproduce_and_differ_by_seed_and_request():
    probs = torch.softmax(torch.randn(200, 40, generator=torch.Generator().manual_seed(3)), -1)

    def draw(seed, index):
        return sample(probs, make_generator(seed, index)).tolist()
    assert draw(7, 0) == draw(7, 0) and draw(7, 3) == draw(7, 3)
    assert len({tuple(draw(7, 0)), tuple(draw(8, 0)), tuple(draw(7, 1)), tuple(draw(-7, 0))}) == 4
    assert draw(None, 0) != draw(None, 0)  # fresh seeds: equal 200-token draws would be ~40^-100 unlikely
    assert make_generator(7, 0).initial_seed() == 7


# --- logprobs -----------------------------------------------------------------------------------------------

def test_token_logprobs_rank_and_top_alternatives():
    logits = torch.tensor([[2.0, 2.0, 1.0, -1.0], [0.0, 3.0, 1.0, 2.0]])
    out = token_logprobs(logits, torch.tensor([1, 0]), top=3)
    logp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprob, torch.stack([logp[0, 1], logp[1, 0]]))
    assert out.rank.tolist() == [1, 4]  # a tie with a better id does not worsen the rank
    assert out.top_ids[1].tolist() == [1, 3, 2] and set(out.top_ids[0].tolist()) == {0, 1, 2}
    torch.testing.assert_close(out.top_logprobs, logp.sort(-1, descending=True).values[:, :3])
    assert token_logprobs(logits, torch.tensor([0, 0]), top=0).top_ids.shape == (2, 0)


def test_token_logprobs_are_the_raw_model_distribution_whatever_the_sampling():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(4))
    ids = sample(target_probs(logits, SamplingParams(temperature=0.2, top_k=3)), make_generator(0, 0))
    out = token_logprobs(logits, ids, top=20)
    torch.testing.assert_close(out.logprob, torch.log_softmax(logits, -1).gather(-1, ids[:, None]).squeeze(-1))
    brute = [1 + sorted(row.tolist(), reverse=True).index(row[i].item()) for row, i in zip(logits, ids.tolist())]
    assert out.rank.tolist() == brute


def test_prompt_logprobs_score_each_token_with_the_previous_row():
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(5))
    ids = torch.tensor([3, 1, 4, 1])
    got = prompt_logprobs(logits, ids)
    logp = torch.log_softmax(logits, -1)
    assert got[0] is None and got[1:] == pytest.approx([logp[0, 1].item(), logp[1, 4].item(), logp[2, 1].item()])
    assert prompt_logprobs(logits[:1], ids[:1]) == [None]


# --- speculative verification -------------------------------------------------------------------------------

def test_greedy_verify_accepts_matching_drafts_and_adds_the_bonus():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(6))
    best = logits.argmax(-1)
    g = make_generator(0, 0)
    assert verify(logits, best[:3], None, SamplingParams(), g) == Verdict(3, best.tolist())
    wrong = (best[:3] + 1) % 30
    assert verify(logits, wrong, None, SamplingParams(), g) == Verdict(0, [int(best[0])])
    half = torch.stack([best[0], wrong[1], best[2]])
    assert verify(logits, half, None, SamplingParams(), g) == Verdict(1, best[:2].tolist())
    assert verify(logits[:1], best[:0], None, SamplingParams(), g) == Verdict(0, [int(best[0])])


def test_verify_refuses_mismatched_shapes():
    g = make_generator(0, 0)
    with pytest.raises(ValueError, match=r"target_logits has shape \(1, 2, 5\) for draft_ids of shape \(1, 2\) "
                                         r"\(need one row per draft \+ 1\)"):
        verify(torch.zeros(2, 5), torch.tensor([0, 1]), None, SamplingParams(), g)
    with pytest.raises(ValueError, match=r"draft_probs has shape \(1, 2, 4\), expected \(1, 2, 5\)"):
        verify(torch.zeros(3, 5), torch.tensor([0, 1]), torch.zeros(2, 4), SAMPLED, g)


# Target rows are context-independent but differ by position; the drafter is deliberately wrong, and puts
# mass on tokens the target forbids (d0 on 4 and 5, d1 on 3).
TARGET = torch.tensor([[0.30, 0.20, 0.10, 0.40, 0.00, 0.00],
                       [0.05, 0.45, 0.25, 0.00, 0.25, 0.00],
                       [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
                       [0.00, 0.00, 0.50, 0.50, 0.00, 0.00]])
DRAFT = torch.tensor([[0.10, 0.40, 0.10, 0.10, 0.20, 0.10],
                      [0.30, 0.10, 0.10, 0.30, 0.10, 0.10],
                      [0.60, 0.00, 0.00, 0.00, 0.00, 0.40]])


def _generate_two_tokens(trials: int, seed: int) -> torch.Tensor:
    """[trials, 2]: the first two tokens of sequences generated by rounds of 2 drafts + verification. Trials
    are independent sequences, batched; a second round (starting at position 1) supplies token 2 wherever
    the first round emitted only one token."""
    g, draws = make_generator(seed, 0), torch.Generator().manual_seed(seed + 1)
    logits = TARGET.log()  # log 0 = -inf: target_probs at temperature 1 gives TARGET back

    def round_at(position: int) -> list[Verdict]:
        draft_ids = torch.stack([torch.multinomial(DRAFT[position + k], trials, replacement=True, generator=draws)
                                 for k in range(2)], -1)                                  # [trials, 2]
        verdicts = verify_batch(logits[position:position + 3].expand(trials, 3, 6), draft_ids,
                                DRAFT[position:position + 2].expand(trials, 2, 6), SAMPLED, g)
        for verdict, drafted in zip(verdicts[:100], draft_ids[:100].tolist()):
            assert verdict.tokens[:verdict.accepted] == drafted[:verdict.accepted]
            assert len(verdict.tokens) == verdict.accepted + 1
        return verdicts
    first, second = round_at(0), round_at(1)
    return torch.tensor([(a.tokens + b.tokens)[:2] for a, b in zip(first, second)])


def test_verify_is_lossless_first_token_and_joint_of_two():
    tokens = _generate_two_tokens(20000, seed=11)
    _assert_same_distribution(_counts(tokens[:, 0], 6), TARGET[0], 0.02)
    joint = _counts(tokens[:, 0] * 6 + tokens[:, 1], 36)
    _assert_same_distribution(joint, torch.outer(TARGET[0], TARGET[1]).flatten(), 0.02)


def test_verify_with_filters_and_a_deterministic_drafter_matches_target_probs():
    # top-k/top-p/temperature apply to the target; a greedy drafter's distribution is its one-hot (None)
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(12)) * 1.5
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    # draft 0 is the target's favourite (accepted with probability p_t(x)), draft 1 one it filters out
    drafts = torch.stack([logits[0].argmax(), logits[1].argmin()])
    verdicts = verify_batch(logits.expand(20000, 3, 6), drafts.expand(20000, 2), None, params, make_generator(13, 0))
    first = torch.tensor([v.tokens[0] for v in verdicts])
    _assert_same_distribution(_counts(first, 6), target_probs(logits, params)[0], 0.02)
    assert all(v.accepted < 2 for v in verdicts)  # the filtered-out draft is never accepted


def test_verify_without_drafts_samples_row_zero_and_identical_distributions_always_accept():
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    assert verify(probs.log(), torch.zeros(0, dtype=torch.int64), torch.zeros(0, 4), SAMPLED,
                  make_generator(0, 0)) == Verdict(0, [2])
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(14))
    same = torch.softmax(logits[:3], -1)
    g = make_generator(15, 0)
    for _ in range(50):  # p_t == p_d: acceptance is min(1, 1), the residual is all zero and never used
        draft_ids = sample(same, g)
        assert verify(logits, draft_ids, same, SAMPLED, g).accepted == 3


# --- the 310P capability guard (B20) ------------------------------------------------------------------------

def _whole_sampler(g: torch.Generator) -> None:
    """Every entry point the engine calls: one prefill's prompt logprobs, then 3 verification rounds
    (sampled with every filter, greedy, and with no drafts) around plain sampling and token logprobs."""
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(16))
    params = SamplingParams(temperature=0.7, top_k=20, top_p=0.9)
    prompt_logprobs(logits, torch.tensor([5, 6, 7, 8]))
    ids = sample(target_probs(logits, params), g)
    sample(target_probs(logits, SamplingParams()), g)
    token_logprobs(logits, ids, 5)
    draft_probs = target_probs(logits[:3] * 0.5, params)
    verify(logits, sample(draft_probs, g), draft_probs, params, g)
    verify(logits, ids[:3], None, SamplingParams(), g)
    verify_batch(logits[:1].expand(2, 1, 64), ids[:2, None][:, :0], None, params, g)


def test_the_sampler_passes_the_310p_guard_with_only_its_declared_syncs():
    with CapabilityGuard(P310, mode="raise") as guard:
        _whole_sampler(make_generator(0, 0))
    report = guard.report()
    assert report.violations == ()
    # the host reads are exactly the declared ones: one per prefill, one per verification round (batch)
    assert report.total.syncs == 4
    assert [a.reason.split(":")[0] for a in report.allowed] == [
        "prompt logprobs go to the host once, after prefill"] + ["speculative acceptance is decided on the host"] * 3
    for allowance in report.allowed:
        assert [(v.kind, v.op) for v in allowance.suppressed] == [("host-sync", "Tensor.tolist")]
    assert not {"aten.nonzero.default", "aten.index.Tensor", "aten.index_put_.default"} & set(report.total.launches)


def test_verify_on_device_has_no_host_sync_at_all():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(17))
    draft_probs = torch.softmax(logits[:3] * 0.3, -1)
    with CapabilityGuard(P310, mode="raise") as guard:
        accept, candidates = verify_on_device(logits, torch.tensor([1, 2, 3]), draft_probs, SAMPLED,
                                              make_generator(0, 0))
    assert guard.report().total.syncs == 0 and guard.report().allowed == ()
    assert accept.shape == (3,) and candidates.shape == (4,)


def _masked_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The B20 shape of bug: a nucleus filter written with a boolean-mask write."""
    ordered, order = probs.sort(-1, descending=True)
    ordered[ordered.cumsum(-1) - ordered >= top_p] = 0.0
    return torch.zeros_like(probs).scatter(-1, order, ordered)


@pytest.mark.parametrize("bad, flagged", [
    (lambda p: _masked_top_p(p, 0.5), {("forbidden", "aten.index_put_.default"),
                                       ("data-dependent", "aten.index_put_.default")}),
    (lambda p: p[p > 0.1], {("data-dependent", "aten.index.Tensor")}),
    (lambda p: torch.where(p > 0.1), {("forbidden", "aten.nonzero.default"),
                                      ("data-dependent", "aten.nonzero.default")}),
], ids=["mask write", "mask read", "where(mask)"])
def test_the_guard_catches_a_boolean_indexed_sampler(bad, flagged):
    probs = torch.softmax(torch.randn(2, 16, generator=torch.Generator().manual_seed(18)), -1)
    with pytest.raises(GuardViolation), CapabilityGuard(P310, mode="raise"):
        bad(probs)
    with CapabilityGuard(P310, mode="count") as guard:  # count mode: every refusal, not just the first
        bad(probs)
    assert {(v.kind, v.op) for v in guard.report().violations} == flagged


# --- stops --------------------------------------------------------------------------------------------------

def _stream(checker: StopChecker, pieces: list[str]) -> tuple[list[str], bool]:
    emitted = []
    for piece in pieces:
        text, stopped = checker.feed(piece)
        emitted.append(text)
        if stopped:
            return emitted, True
    return emitted + [checker.flush()], False


def test_a_stop_string_split_across_feeds_is_never_emitted():
    emitted, stopped = _stream(StopChecker(["</end>"]), ["Hello <", "/e", "nd> tail"])
    assert stopped and emitted == ["Hello ", "", ""] and "<" not in "".join(emitted)


def test_a_held_back_prefix_that_does_not_complete_is_released():
    emitted, stopped = _stream(StopChecker(["STOP"]), ["aST", "x ST", "O"])
    assert not stopped and emitted == ["a", "STx ", "", "STO"]


def test_the_earliest_stop_string_wins():
    checker = StopChecker(["world", "lo w", "o"])
    assert checker.feed("hello world") == ("hel", True)
    assert checker.feed("more") == ("", True) and checker.flush() == ""
    assert StopChecker(["cd", "abcdef"]).feed("xxabcdef") == ("xx", True)


def test_stop_token_ids_and_eos_unless_ignored():
    checker = StopChecker(stop_token_ids=[7], eos_ids=[1])
    assert [checker.check_token(t) for t in (7, 1, 5)] == [True, True, False]
    ignoring = StopChecker(stop_token_ids=[7], eos_ids=[1], ignore_eos=True)
    assert [ignoring.check_token(t) for t in (7, 1, 5)] == [True, False, False]
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        StopChecker([""])
    assert StopChecker().feed("anything") == ("anything", False)
