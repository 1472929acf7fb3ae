"""`dsv4gen conformance`: a device backend against the cpu reference, on CPU, before any hardware.

Everything runs through the real loaders and generated modules. The reference first runs alone
(a prompt, then greedy decode), recording every attention and MoE sub-layer call; then, with any
fault injection active, the device backend is loaded and checked under the capability guard:
each recorded sub-layer is re-run teacher-forced (same inputs) within the profile's budget, the
whole model is teacher-forced over the reference tokens (top-1 must agree wherever the reference
margin exceeds the logit budget), and runs are repeated, alone and batched, for determinism. The
device's whole-model runs go through the paged cache with its profile's block geometry, which
must restore the dense state bit for bit (a broken slot mapping shows there, B12-B14). Then the
serving side (lib/porting/conformance_engine.py): the engine under the guard, and the DSpark draft block
against the reference's (B17, B20).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from codegen.lower import Rewrite
from lib.console.stages import Stages
from lib.guard.capability import CapabilityGuard, rules_from_profile
from lib.porting.conformance_engine import (DraftReference, draft_checks, drafter_model, engine_checks,
                                            has_dspark_drafter, reference_draft)
from lib.porting.conformance_ops import op_checks, run_ops, weight_free_ops
from lib.porting.rendering import rendered
from lib.records.batch import make_batch
from lib.records.decode_state import CompressorState, LayerCache
from lib.runtime.loaded_model import Model, load_model, step
from lib.runtime.paged_cache import PagedCache, PagedSites
from lib.runtime.paged_step import paged_step
from lib.weights.params import LoadOptions
from spec.profile import load_profile


class Check(NamedTuple):
    name: str
    value: str
    budget: str
    passed: bool


class Report(NamedTuple):
    backend: str
    checks: tuple[Check, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def table(self) -> str:
        rows = [("check", "measured", "budget", "result")] + [
            (c.name, c.value, c.budget, "ok" if c.passed else "FAIL") for c in self.checks]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in rows)


def prompt_ids(n: int, vocab: int, seed: int = 7) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(16, vocab, (n,), generator=gen).tolist()   # ordinary tokens, no specials


def _to(value, dtype):
    """Reference state/activations -> the device's dtype (compressor buffers stay fp32)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, CompressorState):
        return value._replace(entries=value.entries.to(dtype))
    if isinstance(value, LayerCache):
        return LayerCache([_to(w, dtype) for w in value.window],
                          None if value.comp is None else [_to(c, dtype) for c in value.comp],
                          None if value.index is None else [_to(c, dtype) for c in value.index])
    return value


def _token_errors(dev: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-token relative error ||dev_t - ref_t|| / ||ref_t||; inf where the device gave NaN/inf."""
    dev, ref = dev.float().flatten(1), ref.float().flatten(1)
    err = (dev - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)
    return torch.where(torch.isfinite(dev).all(dim=-1), err, float("inf"))


def _teacher_forced(model: Model, prompt: list[int], tokens: list[int], copies: int = 1,
                    sites: PagedSites = PagedSites()) -> list[torch.Tensor]:
    """Logits [copies, V] after the prompt and after each forced token (the last-row logits), through
    the paged cache with the backend's block geometry: a prefill, then one position per step."""
    block = model.facts.block_tokens
    total = len(prompt) + len(tokens) - 1
    # pools sized to the run, so a slot that strays outside its sequence's blocks fails loudly (B12)
    store = PagedCache.for_model(model, num_blocks=copies * -(-total // block), max_seqs=copies, sites=sites)
    seqs = list(range(copies))
    for seq in seqs:
        store.add(seq)
    (logits,) = paged_step(model, make_batch([prompt] * copies, last_only=True), store, seqs)
    out, pos = [logits], len(prompt)
    for token in tokens[:-1]:
        (logits,) = paged_step(model, make_batch([[token]] * copies, [pos] * copies, last_only=True), store, seqs)
        out.append(logits)
        pos += 1
    return out


def _dense_teacher_forced(model: Model, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """The same run over the dense records step passes around: what the paged cache must restore."""
    logits, caches = step(model, make_batch([prompt], last_only=True), [model.new_cache()])
    out, pos = [logits], len(prompt)
    for token in tokens[:-1]:
        logits, caches = step(model, make_batch([[token]], [pos], last_only=True), caches)
        out.append(logits)
        pos += 1
    return out


class PagedRun(NamedTuple):
    logits: list[torch.Tensor] | None
    error: str | None


def _paged_run(model: Model, prompt: list[int], tokens: list[int], copies: int = 1,
               sites: PagedSites = PagedSites()) -> PagedRun:
    """A paged teacher-forced run; a slot mapping gone wrong can index outside its pool or block table
    (B12, B13), which is a finding of this report, not a crash of it."""
    try:
        return PagedRun(_teacher_forced(model, prompt, tokens, copies, sites), None)
    except (IndexError, RuntimeError) as err:
        return PagedRun(None, f"{type(err).__name__}: {err}")


def _device_sublayers(ref_calls, dev: Model) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Re-run every recorded reference sub-layer call on the device, teacher-forced."""
    gen, out = dev.module, []
    for table, kind, args, ref_out in ref_calls:
        layer = args[-3]
        dev_args = (dev.params.layers[layer.index], *(_to(a, dev.state_dtype) for a in args[1:-3]), layer,
                    dev.cfg, dev.rope)
        got = getattr(gen, table)[kind](*dev_args)
        got, want = (got[0], ref_out[0]) if table == "ATTENTION" else (got, ref_out)
        out.append((f"{'attention' if table == 'ATTENTION' else 'ffn'} {kind}", got, want))
    return out


# A sub-layer passes when its median per-token error is within budget and at most OUTLIER_SHARE of
# its tokens exceed OUTLIER_FACTOR x budget: near-tie top-k selections (router, indexer) may
# legitimately flip under the device's dtype for a few tokens (DSV4-REFERENCE §7.4.3), while a
# real bug moves most tokens.
OUTLIER_FACTOR, OUTLIER_SHARE = 4.0, 0.05


def _sublayer_checks(results, budgets: dict) -> list[Check]:
    errors: dict[str, list[torch.Tensor]] = {}
    for key, got, want in results:
        errors.setdefault(key, []).append(_token_errors(got, want))
    checks = []
    for key, errs in sorted(errors.items()):
        e = torch.cat(errs)
        budget = budgets[key.split()[0]].budget
        median = e.median().item()
        share = (e > OUTLIER_FACTOR * budget).float().mean().item()
        ok = median <= budget and share <= OUTLIER_SHARE
        checks.append(Check(f"{key}: median token error / outliers ({e.numel()} tokens)",
                            f"{median:.4f} / {share:.1%}", f"<= {budget} / <= {OUTLIER_SHARE:.0%}", ok))
    return checks


class ReferenceRun(NamedTuple):
    """What the cpu reference did: the data every device check compares against."""
    prompt: list[int]
    tokens: list[int]                  # greedy tokens; token s follows logits s
    logits: list[torch.Tensor]         # last-row logits after the prompt and after each token
    sublayer_calls: list               # recorded attention / MoE sub-layer calls
    op_calls: list                     # recorded weight-free op calls
    draft: DraftReference | None       # greedy draft blocks over prompt + tokens (None: no DSpark drafter)


def reference_run(model_path, steps: int = 32, prompt_len: int = 24) -> ReferenceRun:
    """The cpu reference's greedy run, from a rendering of its generated code that records every
    sub-layer call and every weight-free op call (codegen Rewrite record_*)."""
    recording = Rewrite(record_ops=tuple(weight_free_ops()), record_dispatch=True)
    with rendered("cpu", recording, "reference") as code:
        ref = load_model(model_path, "cpu", code=code)
        prompt = prompt_ids(prompt_len, ref.cfg.vocab_size)
        logits = _reference_greedy(ref, prompt, steps)
        recorded = list(code.model.RECORDED)
        tokens = [int(torch.argmax(x[-1])) for x in logits]
        draft = reference_draft(ref, prompt + tokens)
    calls = [(table, kind, args, out) for table, kind, args, _, out in recorded if table != "op"]
    op_calls = [(op, args, kwargs, out) for table, op, args, kwargs, out in recorded if table == "op"]
    return ReferenceRun(prompt, tokens, logits, calls, op_calls, draft)


def run(backend: str, model_path, steps: int = 32, prompt_len: int = 24, ep_sim: int = 2,
        inject: str | None = None, expert_mode: str | None = None, reference: ReferenceRun | None = None,
        stop_on_failure: bool = False, stages: Stages | None = None) -> Report:
    """All conformance checks of `backend`; `reference` may be reused across runs of one model.
    The checks run in stages, cheapest first (ops and sub-layers; the paged run against the dense
    one and the reference's logits; determinism and batch replicas; the engine and the drafter);
    with `stop_on_failure` the report ends after the first stage with a failing check, which is all
    an injected bug's detection needs. `stages` announces each stage as it runs (the command line's
    progress on stderr); by default nothing is written."""
    from lib.porting.faults import injection

    profile = load_profile(backend)
    budgets = profile.conformance
    stages = stages or Stages.quiet()
    if stages.enabled and stages.total is None:    # the device's seven stages, the reference's, the drafter's
        draft = reference.draft is not None if reference else has_dspark_drafter(model_path)
        stages.total = 7 + (reference is None) + draft
    if reference is None:
        with stages(f"cpu reference ({prompt_len}-token prompt + {steps} greedy steps, calls recorded)"):
            reference = reference_run(model_path, steps, prompt_len)
    prompt, tokens, ref_logits = reference.prompt, reference.tokens, reference.logits
    guard = CapabilityGuard(rules_from_profile(profile), mode="count")
    checks: list[Check] = []

    def done() -> bool:
        return stop_on_failure and not all(c.passed for c in checks)

    with injection(inject, backend) as fault:
        options = fault.options(LoadOptions(expert_mode=expert_mode, ep_size=ep_sim, ep_simulate=ep_sim > 1))
        with stages(f"loading the {backend} model" + (f" (experts {expert_mode})" if expert_mode else "")):
            dev = load_model(model_path, backend, options=options, code=fault.code)
        with guard:
            with stages(f"op checks ({len(reference.op_calls)} recorded weight-free op calls)"):
                op_results = run_ops(reference.op_calls, profile)
            with stages(f"sub-layer checks ({len(reference.sublayer_calls)} recorded attention / MoE calls)"):
                results = _device_sublayers(reference.sublayer_calls, dev)
        checks += op_checks(op_results, profile, Check)
        checks += _sublayer_checks(results, budgets)
        if done():
            return Report(backend, tuple(checks + [_guard_check(guard)]))
        with stages(f"paged teacher-forced decode ({len(tokens)} steps, under the guard)"), guard:
            first = _paged_run(dev, prompt, tokens, sites=fault.paged)
        with stages(f"dense teacher-forced decode ({len(tokens)} steps)"):
            dense = _dense_teacher_forced(dev, prompt, tokens)
        checks.append(_guard_check(guard))
        checks.append(_paged_check(first, dense))
        checks += _logit_checks(ref_logits, first.logits or dense, budgets["logits"].budget)
        if done():
            return Report(backend, tuple(checks))
        with stages(f"repeat determinism and 4x batch replicas ({len(tokens)} steps each)"):
            checks += _replica_checks(dev, prompt, tokens, first, fault.paged)
        if done():
            return Report(backend, tuple(checks))
        with stages("engine checks (logprobs under the guard, DSpark vs plain greedy)"):
            checks += engine_checks(dev, prompt, profile, Check, fault.logprob_scorer)
        if reference.draft is not None:
            with stages(f"draft checks ({len(reference.draft.starts)} DSpark draft blocks, teacher-forced)"):
                with drafter_model(model_path, backend, profile, dev, options, fault.code) as (drafting, mode):
                    checks += draft_checks(drafting, reference.draft, mode, budgets["logits"].budget, Check)
    return Report(backend, tuple(checks))


def _guard_check(guard: CapabilityGuard) -> Check:
    violations = guard.report().violations
    return Check("guard violations", str(len(violations)), "0", not violations)


def _replica_checks(dev: Model, prompt: list[int], tokens: list[int], first: PagedRun,
                    sites: PagedSites = PagedSites()) -> list[Check]:
    """The same run twice, and four replicas of the prompt in one batch: bit for bit the same."""
    names = ("repeat determinism", "4x batch replicas")
    if first.error is not None:
        return [Check(name, "not run: paged run failed", "identical", False) for name in names]
    second = _paged_run(dev, prompt, tokens, sites=sites)
    batched = _paged_run(dev, prompt, tokens, copies=4, sites=sites)
    if any(r.error is not None for r in (second, batched)):
        return [Check(name, "not run: paged run failed", "identical", False) for name in names]
    same = all(torch.equal(a, b) for a, b in zip(first.logits, second.logits))
    # four replicas of the prompt in one batch must agree with each other bit for bit (uninitialised
    # grouped-matmul rows made the field port's replicas diverge, B10)
    rows_agree = all(torch.equal(b[i], b[0]) for b in batched.logits for i in range(1, 4))
    return [Check(names[0], "identical" if same else "differs", "identical", same),
            Check(names[1], "identical" if rows_agree else "differ", "identical", rows_agree)]


def _paged_check(paged: PagedRun, dense: list[torch.Tensor]) -> Check:
    """The paged cache restores the dense state bit for bit, so the paged run's logits equal the dense
    run's exactly; a wrong slot mapping (B12, B13) or group (B14) reads other rows."""
    name = "paged cache vs dense state (teacher-forced logits)"
    if paged.error is not None:
        return Check(name, paged.error[:60], "identical", False)
    worst = max((p - d).abs().max().item() for p, d in zip(paged.logits, dense))
    same = all(torch.equal(p, d) for p, d in zip(paged.logits, dense))
    return Check(name, "identical" if same else f"max |delta| {worst:.3g}", "identical", same)


def _reference_greedy(ref: Model, prompt: list[int], steps: int) -> list[torch.Tensor]:
    caches = [ref.new_cache()]
    logits, caches = step(ref, make_batch([prompt], last_only=True), caches)
    out, pos = [logits], len(prompt)
    for _ in range(steps - 1):
        token = int(torch.argmax(logits[-1]))
        logits, caches = step(ref, make_batch([[token]], [pos], last_only=True), caches)
        out.append(logits)
        pos += 1
    return out


def _logit_checks(ref_logits, dev_logits, budget: float) -> list[Check]:
    qualifying = agree = 0
    worst = 0.0
    finite = True
    for r, d in zip(ref_logits, dev_logits):
        r, d = r[-1].float(), d[-1].float()
        finite &= bool(torch.isfinite(d).all())
        worst = max(worst, (r - d).abs().max().item()) if finite else float("inf")
        top2 = r.topk(2).values
        if (top2[0] - top2[1]).item() > budget:
            qualifying += 1
            agree += int(torch.argmax(d) == torch.argmax(r))
    return [Check("logits finite", str(finite), "True", finite),
            Check("max |delta logit|", f"{worst:.3f}", "reported", True),
            Check(f"top-1 agreement on decisive steps ({qualifying}/{len(ref_logits)} qualify)",
                  f"{agree}/{qualifying}", f"all (margin > {budget})", qualifying > 0 and agree == qualifying)]
