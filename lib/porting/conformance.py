"""`dsv4gen conformance`: a device backend against the cpu reference, on CPU, before any hardware.

Everything runs through the real loaders and generated modules. The reference first runs alone
(a prompt, then greedy decode over its paged cache), recording every attention and MoE sub-layer
call with the pools it read, and every call of an op reading no parameter but fp32 hyper-connection
weights (conformance_ops.checked_ops); then, with any fault injection active,
the device backend is loaded and checked under the capability guard: each recorded sub-layer and op
is re-run teacher-forced (same inputs) within the profile's budget, and the whole model is
teacher-forced over the reference tokens through the paged cache with the device's block geometry
(top-1 must agree wherever the reference margin exceeds the logit budget). What only paged state
can get wrong is checked on that path (lib/porting/conformance_paged.py): its live rows at the end
against the reference's, the same run in another placement (the same logits bit for bit; B12-B14
read other rows there), four copies in one batch, and a rewound verify that must leave every live
row as it was. Then the serving
side (lib/porting/conformance_engine.py): the engine under the guard, and the DSpark draft block
against the reference's (B17, B20). Long-context conformance (`--context`) is
lib/porting/conformance_context.py.
"""
from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import torch

from codegen.lower import Rewrite
from lib.console.stages import Stages
from lib.emulation.relaxed import relaxed_widths
from lib.guard.capability import CapabilityGuard, rules_from_profile
from lib.porting.conformance_accuracy import accuracy_checks
from lib.porting.conformance_engine import (DraftReference, draft_checks, drafter_model, engine_checks,
                                            has_dspark_drafter, reference_draft)
from lib.porting.conformance_v41 import BLOCK_TABLE, block_calls, collapse_check, engram_ids_check
from lib.porting.conformance_ops import SELECTION_MISMATCH, checked_ops, device_calls, op_call, op_checks, run_ops
from lib.porting.conformance_paged import (SUBLAYER_TABLES, batch_checks, copy_pools, new_store, paged_run,
                                           placement_check, recording_step, state_check)
from lib.porting.rendering import rendered
from lib.quant.reference_formats import resolve
from lib.records.batch import make_batch
from lib.runtime.loaded_model import Model, load_model
from lib.weights.params import LoadOptions
from lib.weights.checkpoint import Checkpoint
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
    """Reference activations -> the device's dtype (records and non-float tensors pass as they are)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    return value


def _token_errors(dev: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-token relative error ||dev_t - ref_t|| / ||ref_t||; inf where the device gave NaN/inf."""
    dev, ref = dev.float().flatten(1), ref.float().flatten(1)
    err = (dev - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-12)
    return torch.where(torch.isfinite(dev).all(dim=-1), err, float("inf"))


def device_sublayers(ref_calls, dev: Model) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Re-run every recorded reference sub-layer call on the device, teacher-forced: the same
    inputs, an attention call over a copy of the pools it read in the device's state dtypes. An
    attention call that completes entries also yields them ("attention <kind> entries"): the rows
    its compressors wrote against the reference's (entries are written once, so the reference's
    pools still hold them), which judges the compressor where the attention's output dilutes it."""
    gen, out = dev.module, []
    angles_of = resolve(op_call(load_profile(dev.backend), "rope_angles"))
    for table, kind, args, ref_out in ref_calls:
        if table not in SUBLAYER_TABLES:           # a whole V4.1 block: judged by its sub-layers and the logits
            continue
        layer = args[-3]
        inputs = [_to(a, dev.state_dtype) for a in args[1:-3]]
        rope = dev.rope
        attention = SUBLAYER_TABLES[table] == "attention"
        if attention:               # (h, batch, cache, ...); the step's angles, made as the device makes them
            inputs[2] = copy_pools(inputs[2], dev.state, layer.attention, dev.state_dtype)
            rope = angles_of(inputs[1], tables=dev.rope)
        got = getattr(gen, table)[kind](dev.params.layers[layer.index], *inputs, layer, dev.cfg, rope)
        if not attention:
            out.append((f"ffn {kind}", got, ref_out))
            continue
        # V4.1's selecting layers (their own top-k over FP4-simulated queries and keys): a query whose selection
        # differs from the reference's is a near-tie the selection check judges (op shared_index_select)
        flipped = (got[1].long() != ref_out[1]).any(1) if layer.index_source and len(got) == 4 else None
        out.append((f"attention {kind}", got[0], ref_out[0], flipped))
        writes = inputs[1].state.writes.get(layer.ratio) if layer.kv_source else None     # V4.1: sources only write
        if writes is not None and writes.slots.numel():                 # the cache is the last value returned
            for mine, theirs in ((got[-1].comp, ref_out[-1].comp), (got[-1].index, ref_out[-1].index)):
                if mine is not None:
                    out.append((f"attention {kind} entries", mine.entries[writes.slots], theirs.entries[writes.slots]))
    return out


# A sub-layer passes when its median per-token error is within budget and at most OUTLIER_SHARE of
# its tokens exceed OUTLIER_FACTOR x budget: near-tie top-k selections (router, indexer) may
# legitimately flip under the device's dtype for a few tokens (DSV4-REFERENCE §7.4.3), while a
# real bug moves most tokens.
OUTLIER_FACTOR, OUTLIER_SHARE = 4.0, 0.05
# DeepSeek-V4.1 selects its compressed entries with FP4-simulated queries and keys (V41-REFERENCE §3.9): a rounding
# difference that carries a value across an FP4 step moves its scores by a whole step, so near-ties at the top-k
# flip far more often than under V4's indexer. Measured on `make-tiny --variant v41-tiny` (index_topk 4): the
# reference itself, fed its recorded attention inputs rounded to bf16, selects otherwise for 6 of 110 source-layer
# queries; the device backends for 13-18 of 110; and one or two of 18-25 decisive greedy steps follow such a
# flip. Per model: (share of a selecting sub-layer's tokens that may select otherwise, share of decisive steps
# whose top-1 must agree). V4's own selections are judged by the indexer's op check alone.
SELECTION_ALLOWANCE = {"deepseek_v4": (SELECTION_MISMATCH[torch.bfloat16], 1.0), "deepseek_v41": (0.25, 0.85)}


def sublayer_checks(results, budgets: dict, flipped: list[torch.Tensor] | None = None,
                    selection_share: float = SELECTION_MISMATCH[torch.bfloat16]) -> list[Check]:
    """`flipped`: for each "attention csa" result in order, [T] tokens whose device selection differs
    from the reference's (a near-tie at the top-k boundary, judged by the selection check instead);
    the other tokens are judged here. A result's own fourth item, where present, is such a mask (V4.1's
    selecting layers, device_sublayers). A long context's thousands of candidates put such ties in a
    quarter to four fifths of the queries (lib/porting/conformance_context.py); a short run has few."""
    errors: dict[str, list[torch.Tensor]] = {}
    left_out: dict[str, int] = {}
    selecting: dict[str, int] = {}       # tokens of results with their own mask: at most selection_share left out
    csa = iter(flipped or ())
    for key, got, want, *own in results:
        e = _token_errors(got, want)
        other = next(csa) if flipped is not None and key == "attention csa" else (own[0] if own else None)
        if other is not None and bool(other.any()):
            e, left_out[key] = e[~other], left_out.get(key, 0) + int(other.sum())
        errors.setdefault(key, []).append(e)
        if own and own[0] is not None:
            selecting[key] = selecting.get(key, 0) + own[0].numel()
    checks = []
    for key, errs in sorted(errors.items()):
        e = torch.cat(errs)
        budget = budgets[key.split()[0]].budget
        median = e.median().item() if e.numel() else float("nan")      # nothing left to judge: fails
        share = (e > OUTLIER_FACTOR * budget).float().mean().item() if e.numel() else 0.0
        own_ok = key not in selecting or left_out.get(key, 0) <= selection_share * selecting[key]
        ok = median <= budget and share <= OUTLIER_SHARE and own_ok
        left = f"; {left_out[key]} selecting otherwise left out" if left_out.get(key) else ""
        unit = "rows" if key.endswith("entries") else "tokens"
        checks.append(Check(f"{key}: median {unit[:-1]} error / outliers ({e.numel()} {unit}{left})",
                            f"{median:.4f} / {share:.1%}", f"<= {budget} / <= {OUTLIER_SHARE:.0%}", ok))
    return checks


class ReferenceRun(NamedTuple):
    """What the cpu reference did: the data every device check compares against."""
    prompt: list[int]
    tokens: list[int]                  # greedy tokens; token s follows logits s
    logits: list[torch.Tensor]         # last-row logits after the prompt and after each token
    sublayer_calls: list               # recorded attention / MoE sub-layer calls (and V4.1's block calls)
    op_calls: list                     # recorded calls of the ops checked op by op (checked_ops)
    draft: DraftReference | None       # greedy draft blocks over prompt + tokens (None: no DSpark drafter)
    state: dict                        # its live rows at the end (every token fed but the last)


def reference_run(model_path, steps: int = 32, prompt_len: int = 24) -> ReferenceRun:
    """The cpu reference's greedy run, from a rendering of its generated code that records every
    sub-layer call and every call of the ops checked op by op (codegen Rewrite record_*)."""
    recording = Rewrite(record_ops=tuple(checked_ops()), record_dispatch=True)
    with rendered("cpu", recording, "reference") as code:
        ref = load_model(model_path, "cpu", code=code)
        prompt = prompt_ids(prompt_len, ref.cfg.vocab_size)
        logits, state = _reference_greedy(ref, prompt, steps, code.model.RECORDED)
        recorded = list(code.model.RECORDED)
        tokens = [int(torch.argmax(x[-1])) for x in logits]
        draft = reference_draft(ref, prompt + tokens)
    calls = [(table, kind, args, out) for table, kind, args, _, out in recorded
             if table in SUBLAYER_TABLES or table == BLOCK_TABLE]
    op_calls = [(op, args, kwargs, out) for table, op, args, kwargs, out in recorded if table == "op"]
    return ReferenceRun(prompt, tokens, logits, calls, op_calls, draft, state)


def _reference_greedy(ref: Model, prompt: list[int], steps: int, recorded: list) -> tuple[list[torch.Tensor], dict]:
    store, seqs = new_store(ref, [len(prompt) + steps], staggered=False)
    logits = recording_step(ref, store, make_batch([prompt], last_only=True), seqs, recorded)
    out, pos = [logits], len(prompt)
    for _ in range(steps - 1):
        token = int(torch.argmax(logits[-1]))
        logits = recording_step(ref, store, make_batch([[token]], [pos], last_only=True), seqs, recorded)
        out.append(logits)
        pos += 1
    return out, store.live_rows(seqs[0])


def fused_widths(inject: str | None):
    """The fused kernels' width limits relaxed for the emulation, unless the injected bug is skipping them (F02)."""
    from lib.porting.faults import CATALOGUE

    strict = inject in CATALOGUE and CATALOGUE[inject].strict_widths
    return contextlib.nullcontext() if strict else relaxed_widths()


def run(backend: str, model_path, steps: int = 32, prompt_len: int = 24, ep_sim: int = 2,
        inject: str | None = None, expert_mode: str | None = None, reference: ReferenceRun | None = None,
        stop_on_failure: bool = False, stages: Stages | None = None, accuracy: int = 0) -> Report:
    """All conformance checks of `backend` (see `_run`), with the fused kernels' width limits relaxed
    for the emulation (lib/emulation/relaxed.py): at tiny widths the device runs the fused kernels
    its profile would choose for the real model, every other limit of theirs still checked. `accuracy` > 0 adds
    the held-out task accuracy of that many questions per task against the reference's (conformance_accuracy.py)."""
    with fused_widths(inject):
        return _run(backend, model_path, steps, prompt_len, ep_sim, inject, expert_mode, reference,
                    stop_on_failure, stages, accuracy)


def _run(backend: str, model_path, steps: int, prompt_len: int, ep_sim: int, inject: str | None,
         expert_mode: str | None, reference: ReferenceRun | None, stop_on_failure: bool,
         stages: Stages | None, accuracy: int = 0) -> Report:
    """All conformance checks of `backend`; `reference` may be reused across runs of one model.
    The checks run in stages, cheapest first (ops and sub-layers; the paged run against the
    reference's logits and in another placement; four batch replicas with a rewound verify; the
    engine and the drafter); with
    `stop_on_failure` the report ends after the first stage with a failing check, which is all an
    injected bug's detection needs. `stages` announces each stage as it runs (the command line's
    progress on stderr); by default nothing is written."""
    from lib.porting.faults import injection

    profile = load_profile(backend)
    budgets = profile.conformance
    stages = stages or Stages.quiet()
    if stages.enabled and stages.total is None:    # the device's six stages, the reference's, the drafter's
        draft = reference.draft is not None if reference else has_dspark_drafter(model_path)
        v41 = Checkpoint(model_path).config.model_type == "deepseek_v41"    # + its block wiring stage
        stages.total = 6 + (reference is None) + draft + (accuracy > 0) + v41
    if reference is None:
        with stages(f"cpu reference ({prompt_len}-token prompt + {steps} greedy steps, calls recorded)"):
            reference = reference_run(model_path, steps, prompt_len)
    prompt, tokens, ref_logits = reference.prompt, reference.tokens, reference.logits
    guard = CapabilityGuard(rules_from_profile(profile), mode="count")
    checks: list[Check] = []

    def done() -> bool:
        return stop_on_failure and not all(c.passed for c in checks)

    with injection(inject, backend, Checkpoint(model_path).config.model_type) as fault:
        options = fault.options(LoadOptions(expert_mode=expert_mode, ep_size=ep_sim, ep_simulate=ep_sim > 1))
        with stages(f"loading the {backend} model" + (f" (experts {expert_mode})" if expert_mode else "")):
            dev = load_model(model_path, backend, options=options, code=fault.code)
        rewritten = fault.injection.rewrite(backend).calls if fault.injection and fault.injection.rewrite else {}
        prepared = device_calls(reference.op_calls, profile, dev.cfg.fused, rewritten)
        try:
            with guard:
                with stages(f"op checks ({len(reference.op_calls)} recorded op calls)"):
                    op_results = run_ops(prepared)
                with stages(f"sub-layer checks ({len(reference.sublayer_calls)} recorded attention / MoE calls)"):
                    results = device_sublayers(reference.sublayer_calls, dev)
        except (ValueError, NotImplementedError) as err:     # a device op refused its inputs (its shape limits)
            return Report(backend, (Check("device ops accept the model's inputs", str(err)[:120], "no refusal",
                                          False),))
        checks.append(Check("fused kernels run (widths relaxed for the emulation)",
                            ", ".join(sorted(dev.cfg.fused)) or "none", "reported", True))
        checks += op_checks(op_results, profile, Check)
        selection_share, agree_share = SELECTION_ALLOWANCE[dev.cfg.model_type]
        checks += sublayer_checks(results, budgets, selection_share=selection_share)
        blocks = block_calls(reference.sublayer_calls)
        if blocks:
            with stages(f"block wiring ({len(blocks)} recorded V4.1 blocks, their input collapse)"):
                rewrite = fault.injection.rewrite(backend) if fault.injection and fault.injection.rewrite else None
                checks.append(collapse_check(blocks, model_path, backend, options, rewrite, budgets["attention"].budget))
        engram = engram_ids_check(dev, model_path, prompt + tokens)
        checks += [engram] if engram is not None else []
        if done():
            return Report(backend, tuple(checks + [guard_check(guard)]))
        with stages(f"paged teacher-forced decode ({len(tokens)} steps under the guard behind another sequence, "
                    "then alone in a fresh cache)"):
            with guard:
                first = paged_run(dev, prompt, tokens, sites=fault.paged)
            fresh = paged_run(dev, prompt, tokens, sites=fault.paged, staggered=False)
        checks.append(guard_check(guard))
        checks += logit_checks(ref_logits, first.logits, budgets["logits"].budget, first.error, agree_share=agree_share)
        checks.append(state_check(reference.state, first.state, first.error, Check))
        checks.append(placement_check(first, fresh, Check))
        if done():
            return Report(backend, tuple(checks))
        with stages(f"4x batch replicas with a rewound verify ({len(tokens)} steps)"):
            batched = paged_run(dev, prompt, tokens, copies=4, sites=fault.paged, rewind_at=len(tokens) // 2)
        checks += batch_checks(batched, Check)
        if done():
            return Report(backend, tuple(checks))
        with stages("engine checks (logprobs under the guard, drafting vs plain greedy)"):
            checks += engine_checks(dev, prompt, profile, Check, fault.logprob_scorer)
        if reference.draft is not None:
            with stages(f"draft checks ({len(reference.draft.starts)} DSpark draft blocks, teacher-forced)"):
                with drafter_model(model_path, backend, profile, dev, options, fault.code) as (drafting, mode):
                    checks += draft_checks(drafting, reference.draft, mode, budgets["logits"].budget, Check)
        if accuracy and not done():
            with stages(f"held-out task accuracy ({accuracy} questions per task, reference and {backend})"):
                checks += accuracy_checks(model_path, dev, backend, accuracy, Check)
    return Report(backend, tuple(checks))


def guard_check(guard: CapabilityGuard) -> Check:
    violations = guard.report().violations
    return Check("guard violations", str(len(violations)), "0", not violations)


def logit_checks(ref_logits, dev_logits, budget: float, error: str | None = None, what: str = "steps",
                 agree_share: float = 1.0) -> list[Check]:
    """Last-row logits of each step (or position) against the reference's: finite, the largest
    difference, and top-1 agreement wherever the reference's margin exceeds `budget` (on every
    such step, or on `agree_share` of them)."""
    if error is not None:                          # the run itself failed: a wrong slot mapping (B12, B13)
        return [Check("paged teacher-forced run", error[:80], "completes", False)]
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
    need = math.ceil(agree_share * qualifying)
    wanted = "all" if agree_share >= 1 else f">= {agree_share:.0%}"
    return [Check("logits finite", str(finite), "True", finite),
            Check("max |delta logit|", f"{worst:.3f}", "reported", True),
            Check(f"top-1 agreement on decisive {what} ({qualifying}/{len(ref_logits)} qualify)",
                  f"{agree}/{qualifying}", f"{wanted} (margin > {budget})", qualifying > 0 and agree >= need)]
