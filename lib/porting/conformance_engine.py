"""Conformance of what serving adds to the forward: the DSpark draft block and the engine loop.

Draft: the reference's draft blocks are re-run on the device from the reference's own context
features (so only the drafter is judged), every Markov step teacher-forced to the reference's draft
token. The logits each draft is chosen from must be finite, within the logit budget and, wherever
the reference's margin exceeds that budget, pick the reference's token (a few near-tie routing flips
aside, see OUTLIER_SHARE). On a backend with a preconverted expert mode the drafter is checked in
that mode: the target's experts come from converted shards and the drafter's from the checkpoint,
which is where a global "already converted" flag broke it (B17).

Engine: the engine itself (DSpark speculative decoding, greedy, logprobs and prompt logprobs) runs
under the capability guard. It reads accepted counts and tokens on the host by design, so host
syncs are not judged here; forbidden ops, data-dependent ops and lacked dtypes are (logprobs
assembled with a boolean mask killed the field engine under speculative decoding, B20). Greedy
tokens with DSpark must equal those without it: verification is lossless.
"""
from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from lib.engine import drafting as dspark
from lib.engine.llm_engine import Engine, EngineConfig
from lib.engine.sampling import SamplingParams, token_logprobs
from lib.guard.capability import CapabilityGuard, rules_from_profile
from lib.records.batch import make_batch
from lib.runtime.loaded_model import Model, load_model
from lib.runtime.paged_cache import PagedCache
from lib.runtime.paged_step import prefill_logits
from lib.weights import expert_conversion as preconvert
from lib.weights.params import LoadOptions
from spec.config import load_config_json
from spec.profile import Profile
from spec.schedule import drafter_kind

DRAFT_BLOCKS = 16       # draft blocks compared, anchored across the second half of the reference run
# A draft is an outlier when its logits move more than OUTLIER_FACTOR x the logit budget, or when it is
# decisive and picks another token. A near-tie MoE routing choice in a drafter stage flips under the
# device's dtype (router score gaps of 1e-4..1e-2 measured) and moves that draft's logits by several
# units: 3 of 80 drafts on the tiny model on 310P. A real bug moves most drafts (B17: all non-finite).
OUTLIER_FACTOR, OUTLIER_SHARE = 4.0, 0.10
ENGINE_TOKENS = 4       # per request: enough for several verification rounds, cheap under the guard


class DraftReference(NamedTuple):
    """The cpu reference's greedy draft blocks after committed lengths `starts`."""
    starts: list[int]
    anchors: list[int]          # the token at position L of each block (drafting continues after it)
    hidden: torch.Tensor        # [n, k*d] fp32 context features of the committed positions
    tokens: torch.Tensor        # [S, gamma] greedy drafts
    logits: torch.Tensor        # [S, gamma, V] the Markov-head logits each draft was chosen from


def reference_draft(ref: Model, sequence: list[int]) -> DraftReference | None:
    """Draft blocks anchored in the second half of `sequence` (None: the checkpoint has no DSpark drafter)."""
    if drafter_kind(ref.cfg) != "dspark":
        return None
    n = len(sequence)
    starts = sorted(set(torch.linspace(n // 2, n - 1, DRAFT_BLOCKS).round().long().tolist()))
    _, hidden = prefill_logits(ref, sequence[:-1], with_hidden=True)
    anchors = [sequence[start] for start in starts]
    tokens, logits = _draft(ref, hidden, starts, anchors, forced=None)
    return DraftReference(starts, anchors, hidden, tokens, logits)


def has_dspark_drafter(model_path) -> bool:
    """Whether the checkpoint has a DSpark drafter, from its config.json alone (so conformance can count its
    stages before loading anything); a config that cannot be read counts as having one: loading reports it."""
    try:
        return drafter_kind(load_config_json(Path(model_path) / "config.json")[0]) == "dspark"
    except (ValueError, OSError):
        return True


def _draft(model: Model, hidden: torch.Tensor, starts: list[int], anchors: list[int], forced):
    """Greedy draft blocks from context features; `forced` [S, gamma] overrides each Markov choice.

    One sequence per block, committed to its start with its drafter rings written from `hidden`;
    the drafter reads only those rings, so the target's forward is not run for them: address()
    marks the positions written, which set_length requires before committing them."""
    window = model.cfg.sliding_window
    store = PagedCache.for_lengths(model, starts, rings=True)
    for seq, start in enumerate(starts):
        store.add(seq)
        store.ensure(seq, start)
        store.address(make_batch([[0] * start]), [seq])
        store.set_length(seq, start)
        lo = max(0, start - window)
        store.write_ring(seq, lo, dspark.context_rows(model, hidden[lo:start], torch.arange(lo, start)))
    chosen_from = []

    def choose(logits: torch.Tensor, k: int):
        chosen_from.append(logits)
        return (logits.argmax(-1) if forced is None else forced[:, k]), None

    block = dspark.propose(model, anchors, store, list(range(len(starts))), choose)
    return block.tokens, torch.stack(chosen_from, dim=1)


@contextlib.contextmanager
def drafter_model(model_path, backend: str, profile: Profile, dev: Model, options: LoadOptions, code=None):
    """(model, expert mode) whose drafter is checked: `dev`, except on a backend with a preconverted
    expert mode when no mode was asked for; then the checkpoint is converted into a scratch folder and
    loaded in that mode, the only one where the target's and the drafter's experts load differently."""
    if "preconverted" not in profile.expert_modes or options.expert_mode is not None:
        yield dev, options.expert_mode or "default"
        return
    with tempfile.TemporaryDirectory(prefix="dsv4gen-conformance-") as scratch:
        converted = preconvert.convert(model_path, backend, out=Path(scratch) / "converted", ep=options.ep_size)
        mode = options._replace(expert_mode="preconverted", preconverted=str(converted))
        yield load_model(model_path, backend, options=mode, code=code), "preconverted"


def draft_checks(dev: Model, reference: DraftReference, mode: str, budget: float, check_type) -> list:
    """The device's draft blocks, teacher-forced on the reference's drafts, against the reference's."""
    _, logits = _draft(dev, reference.hidden, reference.starts, reference.anchors, forced=reference.tokens)
    got, want = logits.float().flatten(0, 1), reference.logits.flatten(0, 1)          # [drafts, V]
    finite = bool(torch.isfinite(got).all())
    errors = torch.where(torch.isfinite(got).all(-1), (got - want).abs().amax(-1), float("inf"))
    median, share = errors.median().item(), (errors > OUTLIER_FACTOR * budget).float().mean().item()
    top2 = want.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > budget
    qualifying = int(decisive.sum())
    differ = int(((got.argmax(-1) != want.argmax(-1)) & decisive).sum())
    drafts = errors.numel()
    return [
        check_type(f"draft logits finite (expert mode {mode})", str(finite), "True", finite),
        check_type(f"draft logits: median max |delta| / outliers ({drafts} drafts)",
                   f"{median:.3f} / {share:.1%} (max {errors.max().item():.2f})",
                   f"<= {budget} / <= {OUTLIER_SHARE:.0%}", median <= budget and share <= OUTLIER_SHARE),
        check_type(f"draft top-1 agreement on decisive drafts ({qualifying}/{drafts} qualify)",
                   f"{qualifying - differ}/{qualifying}", f">= {1 - OUTLIER_SHARE:.0%} (margin > {budget})",
                   qualifying > 0 and differ <= OUTLIER_SHARE * qualifying)]


class EngineRun(NamedTuple):
    outputs: list[list[int]] | None
    accepted: int                   # drafts accepted over all requests
    logprobs: tuple[int, int]       # records: (generated tokens, prompt positions; the first holds None)
    error: str | None


def _engine_run(dev: Model, prompts: list[list[int]], speculative: str, scorer=token_logprobs) -> EngineRun:
    """Greedy generation with logprobs; an engine that breaks is a finding of the report, not a crash of it."""
    params = SamplingParams(max_tokens=ENGINE_TOKENS, logprobs=2, prompt_logprobs=1)
    try:
        config = EngineConfig(max_num_seqs=len(prompts), speculative=speculative, adaptive_drafting=False)  # verify every step
        engine = Engine(dev, config, logprob_scorer=scorer)
        done = engine.generate(prompts, params)
    except (IndexError, RuntimeError, ValueError) as err:
        return EngineRun(None, 0, (0, 0), f"{type(err).__name__}: {err}")
    records = (sum(len(r.logprobs) for r in done), sum(len(r.prompt_logprobs or ()) for r in done))
    return EngineRun([r.output for r in done], sum(sum(r.accepted) for r in done), records, None)


def engine_checks(dev: Model, prompt: list[int], profile: Profile, check_type, scorer=token_logprobs) -> list:
    """The engine under the guard (host syncs aside), its logprob records, and speculative (the checkpoint's
    DSpark or MTP drafter) == plain greedy."""
    prompts = [prompt, prompt[: len(prompt) // 2]]
    speculative = {"dspark": "dspark", "mtp": "mtp"}.get(drafter_kind(dev.cfg), "none")
    guard = CapabilityGuard(rules_from_profile(profile), mode="count")
    with guard:
        run = _engine_run(dev, prompts, speculative, scorer)
    bad = [v for v in guard.report().violations if v.kind != "host-sync"]
    first = f" (first: {bad[0].op} at {bad[0].where})" if bad else ""
    checks = [check_type(f"engine ({speculative}) under guard: forbidden / data-dependent / dtype ops",
                         f"{len(bad)}{first}", "0", not bad)]
    if run.error is not None:
        return checks + [check_type("engine run", run.error[:80], "completes", False)]
    want = (len(prompts) * ENGINE_TOKENS, sum(len(p) for p in prompts))
    checks.append(check_type("engine logprob records (tokens, prompt positions)", str(run.logprobs), str(want),
                             run.logprobs == want))
    if speculative != "none":
        plain = _engine_run(dev, prompts, "none", scorer)
        same = plain.outputs == run.outputs
        value = f"identical ({run.accepted} drafts accepted)" if same else (plain.error or "differs")[:80]
        checks.append(check_type(f"engine: {speculative} == plain greedy", value, "identical", same))
    return checks
