"""Speculation that pays or steps aside: whether the engine drafts this step, and how many drafts each request
verifies. Every decision here only changes speed: verification keeps the target's distribution whatever is drafted,
so greedy output is identical with any policy.

- The gate (engine-wide): drafting stays on while a decode step that drafts emits tokens faster than a plain one,
  as measured on this engine's own decode-only steps at the current batch size (seconds per emitted token: for the
  running mode the ratio of exponential averages of a step's seconds and of its tokens, for the other a probe's own
  measurement; the model, the device and the batch decide, not a constant). The mode that measured slower is tried
  again after a backoff that doubles each time it loses again (BACKOFF .. MAX_BACKOFF steps, times how many times
  slower it was), so a drafter that starts paying (text that turns predictable) is found again, and a plain step now
  and then keeps the comparison honest; a probe that would overturn the choice is taken twice before it does.
- The length (per request): drafts are verified up to the last position whose survival (the chance that it and
  every draft before it are accepted) is estimated at MIN_SURVIVAL or more. The estimate is the drafter's confidence
  head (prefix products of sigmoid(c_k): DSV4-REFERENCE §5.2, trained to predict exactly this) once its predictions
  for this request score no worse (Brier, over TRUST_ROUNDS rounds or more) than the request's own running
  acceptance per position, else that running acceptance (Laplace-smoothed counts); both are weighted towards the
  last ~10 rounds, as a conversation's predictability changes, and an untrained or miscalibrated head is not
  followed. A request's counts are taken together with the acceptance per position of the requests that finished
  before it (PRIOR_ROUNDS rounds' worth of it, fading as the request's own rounds add up): on a predictable
  workload a new request's first rounds verify full blocks, not the two drafts a coin-flip prior allows, which a
  short reply would otherwise spend most of its rounds growing out of. A block the estimate ends before its first
  draft is a plain decode row; a request whose running acceptance says its first drafts do not survive stops
  drafting, and tries a full block again after a backoff of its own.

Must not know: scheduling internals, sampling, the model's numerics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

BACKOFF = 16           # steps before the losing mode (or a request that stopped drafting) is tried again
MAX_BACKOFF = 128
MIN_SURVIVAL = 0.15    # verify a draft position only if it is estimated to survive this often
EMA = 0.3              # weight of the newest step in each mode's seconds per token
TRUST_ROUNDS = 3       # verified rounds of a request before its confidence head may be followed
RECENT = 0.9           # each round, a request's earlier counts and scores are weighted down by this: recent rounds rule
PRIOR_ROUNDS = 4.0     # rounds' worth of the engine's acceptance a new request's estimate starts from
FINISHED_RECENT = 0.9  # each finished request weighs the earlier ones' counts down by this: recent requests rule


@dataclass
class _Acceptance:
    """One request's record of its verified draft positions."""
    tried: list[float]           # per position: rounds that verified it with every draft before it accepted
    accepted: list[float]        # per position: of those, the rounds that accepted it (both weighted by RECENT)
    rounds: int = 0
    head_brier: float = 0.0      # summed squared error of the head's survival estimates
    rate_brier: float = 0.0      # the same for the running-acceptance estimates
    paused: int = 0              # steps left before a full block is tried again
    backoff: int = BACKOFF

    def survival(self, prior: list[float | None]) -> list[float]:
        """[gamma] running estimate that positions 1..j all survive: products of the conditional acceptance rates,
        Laplace-smoothed (a position never tried counts as a coin flip, so a block grows past where it was cut
        once the positions before it prove reliable), with `prior` (the engine's rate per position, None where
        no request has tried it) counted as PRIOR_ROUNDS rounds that fade like the request's own."""
        w = PRIOR_ROUNDS * RECENT ** self.rounds
        return _prefix_products((a + 1.0) / (t + 2.0) if p is None else (a + w * p + 1.0) / (t + w + 2.0)
                                for t, a, p in zip(self.tried, self.accepted, prior))


def _prefix_products(values) -> list[float]:
    out, running = [], 1.0
    for v in values:
        running *= v
        out.append(running)
    return out


def _head_survival(confidence: list[float]) -> list[float]:
    """The confidence head's survival estimates: prefix products of sigmoid(c_k)."""
    return _prefix_products(0.5 * (1.0 + math.tanh(0.5 * c)) for c in confidence)     # sigmoid, for any c


@dataclass
class DraftPolicy:
    gamma: int
    adaptive: bool = True
    requests: dict = field(default_factory=dict)
    # "draft" / "plain" -> (seconds, tokens): exponential averages of a step's wall seconds and emitted tokens. Their
    # ratio is the mode's seconds per token; an average of each step's ratio would count a drafting step that emitted
    # one token as much as one that emitted six, and so rate a drafter that pays as slower than it is
    measured: dict = field(default_factory=dict)
    drafting: bool = True                            # the gate's current choice
    probe_in: int = 0                                # steps until the other mode is measured again
    backoff: int = BACKOFF
    bucket: int = 0                                  # the batch size range the measurements are of (bit length)
    confirming: tuple | None = None                  # a winning probe's (seconds, tokens), awaiting a second probe
    # the finished requests' counts together (weighted by FINISHED_RECENT), and their rate per position (None: never
    # tried), the prior of every request's estimate: it changes only when a request finishes
    tried: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)
    prior: list[float | None] = field(default_factory=list)

    def __post_init__(self):
        self.tried, self.accepted, self.prior = [0.0] * self.gamma, [0.0] * self.gamma, [None] * self.gamma

    # ---- the gate ------------------------------------------------------------------------------
    def draft_this_step(self) -> bool:
        """Whether decode requests may draft in the next step: the winning mode, or a probe of the other one
        (each mode is measured once before the first choice)."""
        if not self.adaptive:
            return True
        mine, other = ("draft", "plain") if self.drafting else ("plain", "draft")
        if mine not in self.measured:
            return self.drafting
        return not self.drafting if other not in self.measured or self.probe_in <= 0 else self.drafting

    def step_done(self, drafted: bool, seconds: float, tokens: int, requests: int) -> None:
        """Report a decode-only step: whether any request verified drafts in it, its wall time, the tokens it
        emitted and the requests it decoded. Both modes are compared at one batch size (within a factor of two):
        when the batch leaves that range, both are measured afresh."""
        if not self.adaptive or tokens <= 0:
            return
        if requests.bit_length() != self.bucket:
            self.bucket, self.measured, self.probe_in, self.confirming = requests.bit_length(), {}, 0, None
        mode, step = ("draft" if drafted else "plain"), (seconds, float(tokens))
        if drafted == self.drafting:             # the running mode: averages over its steps
            old = self.measured.get(mode)
            self.measured[mode] = step if old is None else tuple((1 - EMA) * o + EMA * n for o, n in zip(old, step))
            self.probe_in -= 1
            return
        measured_before = mode in self.measured  # this probe may overturn a choice made on both modes' measurements
        # a probe: things may have changed since the last one (a confirming probe: the two steps together)
        self.measured[mode] = step if self.confirming is None else tuple(map(sum, zip(self.confirming, step)))
        if self.measured.keys() < {"draft", "plain"}:
            return
        draft, plain = (s / t for s, t in (self.measured["draft"], self.measured["plain"]))   # a probe: choose again
        better = draft < plain
        # One step's tokens are luck as much as speed (a drafting step of a drafter that is seldom right emits two
        # tokens now and then, halving its time per token), and a switch on it lasts backoff steps: a probe that
        # would switch is taken once more first, probe_in staying spent, and the two decide together.
        if better != self.drafting and measured_before and self.confirming is None:
            self.confirming = step
            return
        self.confirming = None
        self.backoff = min(2 * self.backoff, MAX_BACKOFF) if better == self.drafting else BACKOFF
        # a mode that lost by a factor r waits r times as long: a probe costs about r plain steps
        lost_by = max(draft, plain) / min(draft, plain)
        self.drafting, self.probe_in = better, min(MAX_BACKOFF, round(self.backoff * lost_by))

    # ---- the length ----------------------------------------------------------------------------
    def planned(self, request_id: str) -> int:
        """Drafts to propose for a request this step (before its block exists): gamma, or 0 while it is paused."""
        if not self.adaptive:
            return self.gamma
        rec = self.requests.get(request_id)
        if rec is None or rec.paused <= 0:
            return self.gamma
        rec.paused -= 1
        return 0

    # The per-request bookkeeping below is host arithmetic on gamma floats: as tensor ops it cost more than the
    # verification it steers (a dozen dispatches per request per step, at batch 16 a few % of a decode step).
    def length(self, request_id: str, confidence: list[float], planned: int) -> int:
        """How many of the `planned` drafts to verify, given the block's confidence logits [gamma]."""
        if not self.adaptive or planned == 0:
            return planned
        rec = self._record(request_id)
        if rec.survival(self.prior)[0] < MIN_SURVIVAL:        # its drafts do not survive: plain rows for a while
            rec.paused, rec.backoff = rec.backoff, min(2 * rec.backoff, MAX_BACKOFF)
            return 0
        estimate = self._estimate(rec, confidence, self.prior)[:planned]
        return sum(e >= MIN_SURVIVAL for e in estimate)  # survival only falls along the block; 0: a plain row

    def verified(self, request_id: str, confidence: list[float], drafts: int, accepted: int) -> None:
        """Record a verified round: `drafts` positions verified, the first `accepted` of them accepted."""
        if not self.adaptive or drafts == 0:
            return
        rec = self._record(request_id)
        head = _head_survival(confidence[:drafts])
        rate = rec.survival(self.prior)[:drafts]
        outcome = [float(k < accepted) for k in range(drafts)]
        rec.head_brier = RECENT * rec.head_brier + sum((h - o) ** 2 for h, o in zip(head, outcome))
        rec.rate_brier = RECENT * rec.rate_brier + sum((r - o) ** 2 for r, o in zip(rate, outcome))
        rec.rounds += 1
        rec.tried = [RECENT * t for t in rec.tried]
        rec.accepted = [RECENT * a for a in rec.accepted]
        for k in range(min(accepted + 1, drafts)):     # the accepted prefix and the first rejected position
            rec.tried[k] += 1
            rec.accepted[k] += float(k < accepted)
        if accepted:
            rec.backoff = BACKOFF

    def forget(self, request_id: str) -> None:
        """The request is done: its counts join the finished requests' (a request's estimate never counts its own
        rounds twice)."""
        rec = self.requests.pop(request_id, None)
        if rec is None or not rec.rounds:
            return
        self.tried = [FINISHED_RECENT * e + t for e, t in zip(self.tried, rec.tried)]
        self.accepted = [FINISHED_RECENT * e + a for e, a in zip(self.accepted, rec.accepted)]
        self.prior = [a / t if t else None for t, a in zip(self.tried, self.accepted)]

    def _record(self, request_id: str) -> _Acceptance:
        if request_id not in self.requests:
            self.requests[request_id] = _Acceptance([0.0] * self.gamma, [0.0] * self.gamma)
        return self.requests[request_id]

    @staticmethod
    def _estimate(rec: _Acceptance, confidence: list[float], prior: list[float | None]) -> list[float]:
        if rec.rounds >= TRUST_ROUNDS and rec.head_brier <= rec.rate_brier:
            return _head_survival(confidence)
        return rec.survival(prior)
