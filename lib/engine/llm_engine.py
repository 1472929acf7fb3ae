"""The engine: requests in, tokens out, one batched forward per `step()`, on any backend.

Each step the scheduler picks work (decodes first, then prefill chunks); requests in their decode
phase get drafts from the checkpoint's drafter (DSpark, or an MTP layer); ONE target forward scores every fed token over the paged cache without
committing; then each request's rows are sampled (prefill end, plain decode) or verified (drafts),
and only what was accepted is committed. Rejected positions are never committed, so they leave
no trace (lib/runtime/paged_cache.py: rings keep `slack` rows past what the committed length reads, and
entries past it are never read). Drafter rings are written from the target's own features of
committed positions only.

Must not know: HTTP, chat formats. The server drives `step()` from its own loop.
"""
from __future__ import annotations

import itertools
import time
from typing import Iterable, NamedTuple

import torch

from lib.engine import drafting as dspark
from lib.engine import mtp_drafting as mtp
from lib.records.batch import make_batch
from lib.engine.emit import emit, finish, row_logprobs
from lib.engine import cache_sizing as engine_cache
from lib.engine.draft_policy import DraftPolicy
from lib.engine.graph_mode import StepGraphs, capture_sizes, graph_mode_on
from lib.runtime.paged_step import paged_step
from lib.engine.requests import Request, RequestOutput
from lib.runtime.loaded_model import Model
from lib.engine.sampling import SamplingParams, make_generator, sample, target_probs, token_logprobs, verify
from lib.engine.scheduler import Scheduled, Scheduler, SchedulerConfig
from lib.engine.stops import StopChecker


class EngineConfig(NamedTuple):
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None        # default: the model's max_position_embeddings
    num_blocks: int | None = None           # context blocks of block_tokens positions (default: max_num_seqs full contexts)
    speculative: str = "auto"               # "dspark" | "mtp" | "none" | "auto" (the checkpoint's own drafter, if any)
    enforce_eager: bool | None = None       # True: never replay captured graphs; None: the device's default
    cuda_graph_sizes: tuple[int, ...] | None = None   # graph batch buckets (lib/engine/graph_mode.py)
    adaptive_drafting: bool = True          # draft only while it pays, each request as far as it survives
                                            # (lib/engine/draft_policy.py); False: a full block every decode step
    num_speculative_tokens: int | None = None   # drafts per round (default: DSpark's block, one MTP step)


def dspark_drafter(model: Model, requests: list[Request], store, choose) -> dspark.DraftBlock:
    """The checkpoint's own DSpark drafter: gamma tokens after each request's last sampled token.

    A drafter is any callable of this signature (the engine takes one as an argument): it sees the
    requests in the order of the draft plan, the paged cache (whose rings hold every stage's rows
    of each request's committed positions), and `choose`, the requests' own sampling rules, and
    returns one DraftBlock row per request."""
    return dspark.propose(model, [r.output[-1] for r in requests], store, [r.id for r in requests], choose)


class Engine:
    def __init__(self, model: Model, config: EngineConfig = EngineConfig(), tokenizer=None,
                 drafter=None, logprob_scorer=token_logprobs):
        """`drafter`: see dspark_drafter (default: the checkpoint's own, DSpark or MTP); `logprob_scorer`:
        sampling.token_logprobs's signature (a fault site: conformance passes field bug B20 through it)."""
        self.model, self.config, self.tokenizer = model, config, tokenizer
        self.logprob_scorer = logprob_scorer
        cfg = model.cfg
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.method = dspark.speculative_method(model, config.speculative)     # "dspark" | "mtp" | None
        self.speculative = self.method is not None
        self.gamma = dspark.drafts_per_round(model, self.method, config.num_speculative_tokens)
        self.drafter = drafter or (self._mtp_drafter if self.method == "mtp" else dspark_drafter)
        blocks = config.num_blocks or engine_cache.blocks_for(model, config.max_num_seqs,
                                                              self.max_model_len + self.gamma + 1)
        self.store = engine_cache.make_store(model, blocks, config.max_num_seqs, rings=self.speculative,
                                             slack=1 + self.gamma)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                                   self.max_model_len, self.gamma), self.store)
        self.graphs = None
        if graph_mode_on(config.enforce_eager, self.store):
            tokens = (1, 1 + self.gamma) if self.speculative else (1,)
            self.graphs = StepGraphs(model, self.store, capture_sizes(config.max_num_seqs, config.cuda_graph_sizes),
                                     tokens, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.drafted = [0] * self.gamma             # engine-wide per-position counters (metrics)
        self.accepted = [0] * self.gamma
        self.policy = DraftPolicy(self.gamma, adaptive=config.adaptive_drafting)
        self.scheduler.planned_drafts = self._planned_drafts
        self._gate_open = False
        self._next_gate: bool | None = None         # another rank's gate decision for the next step (hold_gate)
        self._drafted_last = False
        # committed positions' target features not yet made into drafter ring rows, per request: (first position,
        # rows [n, k*d]), at most a window of them; made only before the request drafts (_flush_rings)
        self._unwritten: dict[str, list[tuple[int, torch.Tensor]]] = {}

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: list[int], params: SamplingParams = SamplingParams(),
                    request_id: str | None = None) -> str:
        cfg = self.model.cfg
        params.validate(cfg.vocab_size)
        if not prompt:
            raise ValueError("the prompt is empty: at least one token is needed")
        bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (vocab_size {cfg.vocab_size})")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{len(prompt) + params.max_tokens} exceeds the maximum context length "
                             f"{self.max_model_len}")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise ValueError(f"request id '{rid}' is already in use")
        eos = () if self.tokenizer is None else (self.tokenizer.eos_id,)
        stops = StopChecker(params.stop, params.stop_token_ids, eos, params.ignore_eos)
        detok = None
        if self.tokenizer is not None:
            from lib.text.tokenizer import DetokenizeStream
            keep = self.tokenizer.markup_ids if params.keep_markup else frozenset()
            detok = DetokenizeStream(self.tokenizer, skip_special_tokens=True, keep_ids=keep)
        req = Request(rid, list(prompt), params, make_generator(params.seed, len(self.requests)),
                      next(self._ids), stops, detok, drafted=[0] * self.gamma, accepted=[0] * self.gamma)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def abort(self, request_id: str) -> None:
        """Cancel a request; its cache blocks are freed at once."""
        req = self.requests.pop(request_id, None)
        self.policy.forget(request_id)
        self._unwritten.pop(request_id, None)
        if req is not None and not req.finished:
            req.finish_reason = "abort"
            self.scheduler.remove(req)

    def release(self, request_id: str) -> None:
        """Forget a finished request: a long-running server would otherwise keep every one."""
        req = self.requests.get(request_id)
        if req is not None and req.finished:
            del self.requests[request_id]

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    # ---- one step ------------------------------------------------------------------------
    def hold_gate(self, open_: bool) -> None:
        """Draft (or not) in the next step whatever this engine's own measurements say: the ranks of a parallel
        job follow rank 0's gate (lib/launcher/ranks.py), as their collectives must line up."""
        self._next_gate = open_

    def _planned_drafts(self, req: Request) -> int:
        return self.policy.planned(req.id) if self._gate_open else 0

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        gate, self._next_gate = self._next_gate, None
        self._gate_open = bool(self.speculative) and (self.policy.draft_this_step() if gate is None else gate)
        plan, refused = self.scheduler.schedule()
        outputs = [self._refuse(r) for r in refused]
        if not plan:
            return outputs
        decode_only = all(s.request.decoding for s in plan)
        flushed = time.perf_counter()
        if self.method == "dspark":           # an MTP layer makes its rows in its first draft pass instead
            self._flush_rings([s.request.id for s in plan if s.drafts])
        if not self._drafted_last:     # the backlog of a plain stretch: paid once, not a cost of drafting on
            started += time.perf_counter() - flushed
        drafts = self._draft([s for s in plan if s.drafts])
        plan = [s._replace(feed=1 + len(drafts[s.request.id].tokens), drafts=len(drafts[s.request.id].tokens))
                if s.drafts else s for s in plan]
        chunks = []
        for s in plan:
            req = s.request
            fed = req.tokens[req.computed: req.computed + (s.feed - s.drafts)]
            chunks.append(fed + (drafts[req.id].tokens if s.drafts else []))
        batch = make_batch(chunks, [s.request.computed for s in plan])
        graph = None if self.graphs is None else self.graphs.graph_for([s.feed for s in plan])
        result = paged_step(self.model, batch, self.store, [s.request.id for s in plan], commit=False,
                            with_hidden=self.speculative, graph=graph)
        logits, hidden = result[0].float(), (result[1] if self.speculative else None)
        lo = 0
        for s in plan:
            outputs.append(self._advance(s, logits[lo: lo + s.feed], None if hidden is None else hidden[lo: lo + s.feed],
                                         drafts.get(s.request.id)))
            lo += s.feed
        outputs = [o for o in outputs if o is not None]
        self._drafted_last = any(s.drafts for s in plan)
        if decode_only and self.speculative:
            self.policy.step_done(self._drafted_last, time.perf_counter() - started,
                                  sum(len(o.new_tokens) for o in outputs), len(plan))
        return outputs

    def _advance(self, s: Scheduled, logits: torch.Tensor, hidden, draft) -> RequestOutput | None:
        """Sample or verify one request's rows, commit what was accepted, emit tokens."""
        req = s.request
        start = req.computed
        if not req.decoding and req.prompt_logprobs is not None and start < len(req.prompt):
            _prompt_logprobs(req, logits, start, self.logprob_scorer)
        if s.feed < req.pending:                         # a prefill chunk that does not end the prompt
            self._commit(req, start + s.feed, hidden, start)
            return None
        if s.drafts:
            verdict = verify(logits, torch.tensor(draft.tokens), draft.probs, req.params, req.generator)
            self.policy.verified(req.id, draft.confidence, s.drafts, verdict.accepted)
            tokens = verdict.tokens
            for k in range(s.drafts):
                req.drafted[k] += 1
                self.drafted[k] += 1
                if k < verdict.accepted:
                    req.accepted[k] += 1
                    self.accepted[k] += 1
            self._commit(req, start + 1 + verdict.accepted, hidden, start)
        else:
            row = logits[-1:]
            tokens = [int(row[0].argmax())] if req.params.greedy else \
                [int(sample(target_probs(row, req.params), req.generator)[0])]
            self._commit(req, start + s.feed, hidden, start)
        out = emit(req, tokens, logits[: len(tokens)] if s.drafts else logits[-1:], self.logprob_scorer)
        if req.finished:
            self.scheduler.remove(req)
            self.policy.forget(req.id)
            self._unwritten.pop(req.id, None)
        return out

    def _commit(self, req: Request, length: int, hidden, start: int) -> None:
        self.store.set_length(req.id, length)
        # Ring rows only for positions a ring can still read: [L - W, L) with L only growing, so a
        # long prompt's earlier rows would be computed (main_proj, every stage's wkv) for nothing.
        window = self.model.cfg.sliding_window
        first = max(start, length - window)
        if hidden is not None and first < length:
            kept = [] if start == 0 else self._unwritten.get(req.id, [])     # from 0: a (re)computed history
            kept.append((first, hidden[first - start: length - start].clone()))   # not a view of the whole step
            while kept[0][0] + kept[0][1].shape[0] <= length - window:       # rings hold the last window only
                kept.pop(0)
            self._unwritten[req.id] = kept
        req.computed = length

    def _flush_rings(self, request_ids: list[str]) -> None:
        """The drafter ring rows of every committed position these requests have not had made yet, in one
        drafter-context pass over all of them: a pass per request costs, at batch 16, as much as the step itself,
        and a request that does not draft (the gate closed, its drafting paused) pays nothing for its rings."""
        work = [(rid, first, h) for rid in request_ids for first, h in self._unwritten.pop(rid, [])]
        if not work:
            return
        hidden = torch.cat([h for _, _, h in work])
        positions = torch.cat([torch.arange(first, first + h.shape[0]) for _, first, h in work])
        rows = dspark.context_rows(self.model, hidden, positions)
        lo = 0
        for rid, first, h in work:
            engine_cache.write_draft_rows(self.store, rid, first, [r[lo: lo + h.shape[0]] for r in rows])
            lo += h.shape[0]

    def _draft(self, plan: list[Scheduled]) -> dict[str, "_Draft"]:
        if not plan:
            return {}
        reqs = [s.request for s in plan]
        all_greedy = all(r.params.greedy for r in reqs)

        def choose(logits: torch.Tensor, k: int):
            if all_greedy:        # greedy verification reads no draft distribution: the argmax is all there is
                return logits.argmax(-1), None
            ids, probs = [], []
            for i, r in enumerate(reqs):
                p = target_probs(logits[i: i + 1], r.params)
                ids.append(int(logits[i].argmax()) if r.params.greedy else int(sample(p, r.generator)[0]))
                probs.append(p[0])
            return torch.tensor(ids), torch.stack(probs)

        block = self.drafter(self.model, reqs, self.store, choose)
        tokens, confidence = block.tokens.tolist(), block.confidence.float().tolist()     # one host read each
        out = {}
        for i, (r, s) in enumerate(zip(reqs, plan)):
            n = self.policy.length(r.id, confidence[i], s.drafts)
            probs = None if block.probs is None else block.probs[i, :n]
            out[r.id] = _Draft(tokens[i][:n], probs, confidence[i])
        return out

    def _mtp_drafter(self, model: Model, requests: list[Request], store, choose) -> dspark.DraftBlock:
        """The checkpoint's MTP layer, chained for gamma drafts; it reads the target states of every position
        committed since the request last drafted (lib/engine/mtp_drafting.py)."""
        contexts = [mtp.context(self._unwritten.pop(r.id), r.tokens) for r in requests]
        return mtp.propose(model, store, [r.id for r in requests], contexts, self.gamma, choose)

    def _refuse(self, req: Request) -> RequestOutput:
        req.error = (f"the KV cache ({engine_cache.total_blocks(self.store)} blocks) cannot hold request {req.id} "
                     f"({len(req.tokens)} tokens) even alone; raise --num-blocks or lower --max-model-len")
        return finish(req, "error")

    # ---- convenience -----------------------------------------------------------------------
    def generate(self, prompts: Iterable[list[int]], params: SamplingParams = SamplingParams()) -> list[Request]:
        """Run prompts to completion (tests, `dsv4gen run`); returns the finished requests in order."""
        ids = [self.add_request(p, params) for p in prompts]
        while self.has_unfinished():
            self.step()
        return [self.requests[i] for i in ids]


class _Draft(NamedTuple):
    tokens: list[int]
    probs: torch.Tensor | None   # [drafts, V] (None: greedy)
    confidence: list[float]      # [gamma] the block's confidence logits


def _prompt_logprobs(req: Request, logits: torch.Tensor, start: int, scorer) -> None:
    """Row j (position start + j) scores prompt token start + j + 1 (B20: gathers, no masks).
    Positions already scored (before a preemption's recompute) are not scored twice."""
    first = max(start, len(req.prompt_logprobs) - 1)
    end = min(start + logits.shape[0], len(req.prompt) - 1)
    if end <= first:
        return
    targets = torch.tensor(req.prompt[first + 1: end + 1])
    req.prompt_logprobs.extend(row_logprobs(logits[first - start: end - start], targets, req.params.prompt_logprobs,
                                            scorer))
