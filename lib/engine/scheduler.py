"""Continuous batching: which requests run in the next forward, with how many tokens each.

Decode first: every running request in its decode phase gets its token (plus its drafts) before
any prefill sees the budget, so a long prompt cannot starve running streams (L26). Prefills take
what is left of `max_num_batched_tokens` in chunks (chunking never changes results, L24).
Admission is gated on cache room: a waiting request is admitted only if its first chunk fits and
a reserve for the running decodes stays free. When a decode cannot get a block, the newest
running request is preempted (its blocks freed, recomputed later); a request that cannot fit
even alone is finished with a clear error rather than retried forever.

Must not know: how tokens are sampled or what the model computes.
"""
from __future__ import annotations

from collections import deque
from typing import NamedTuple

from lib.engine.cache_sizing import can_admit
from lib.runtime.paged_cache import CacheFull
from lib.engine.requests import Request


class Scheduled(NamedTuple):
    request: Request
    feed: int          # tokens fed to the target this step (1 + drafts while decoding)
    drafts: int        # DSpark drafts to propose and verify (0 = plain step)


class SchedulerConfig(NamedTuple):
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    draft_tokens: int            # drafts per decode step when speculating (0: off)
    decode_reserve_blocks: int = 1   # growth kept free per running request when admitting (cache_sizing.can_admit)


class Scheduler:
    def __init__(self, config: SchedulerConfig, store):
        self.config = config
        self.store = store                    # lib.runtime.paged_cache.PagedCache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0                  # total since start (server metrics)
        # drafts a decoding request would propose this step (the engine's draft policy); default: a full block
        self.planned_drafts = lambda req: config.draft_tokens

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Forget a finished or cancelled request and give its blocks back."""
        if request in self.running:
            self.running.remove(request)
            self.store.free(request.id)
        elif request in self.waiting:
            self.waiting.remove(request)

    def schedule(self) -> tuple[list[Scheduled], list[Request]]:
        """The next step's work, and requests that had to be refused (cache too small for them)."""
        budget = self.config.max_num_batched_tokens
        plan: list[Scheduled] = []
        refused: list[Request] = []
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req not in self.running or not req.decoding or budget < 1:
                continue
            drafts = self._drafts_for(req, budget)
            if self._reserve(req, req.computed + 1 + drafts, plan, refused):
                plan.append(Scheduled(req, 1 + drafts, drafts))
                budget -= 1 + drafts
        for req in sorted(self.running, key=lambda r: r.arrival):
            if req.decoding or budget < 1 or req not in self.running:
                continue
            n = min(req.pending, budget)
            if not self._try_ensure(req, req.computed + n):
                break                        # prefills wait for blocks; decodes keep theirs
            plan.append(Scheduled(req, n, 0))
            budget -= n
        while self.waiting and budget >= 1 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            n = min(req.pending, budget)
            if not self._admit(req, n, plan):
                if not self.running:         # nothing will ever free up: it cannot fit at all
                    self.waiting.popleft()
                    refused.append(req)
                    continue
                break
            self.waiting.popleft()
            self.running.append(req)
            plan.append(Scheduled(req, n, 0))
            budget -= n
        return plan, refused

    def _drafts_for(self, req: Request, budget: int) -> int:
        # Never draft past what the request may still emit or past the context limit: the
        # verify forward writes positions computed .. computed + drafts.
        room = self.config.max_model_len - req.computed - 1
        return max(0, min(self.planned_drafts(req), req.remaining - 1, room, budget - 1))

    def _admit(self, req: Request, n: int, plan: list[Scheduled]) -> bool:
        # where each running request stands once this step's tokens are in
        ends = {r.id: r.computed for r in self.running} | {s.request.id: s.request.computed + s.feed for s in plan}
        if not can_admit(self.store, req.id, req.computed + n, ends, self.config.decode_reserve_blocks):
            return False
        self.store.add(req.id)
        return self._try_ensure(req, req.computed + n)

    def _try_ensure(self, req: Request, length: int) -> bool:
        try:
            self.store.ensure(req.id, length)
            return True
        except CacheFull:
            return False

    def _reserve(self, req: Request, length: int, plan: list[Scheduled], refused: list[Request]) -> bool:
        """Blocks for a decode step, preempting the newest other running requests if needed."""
        while not self._try_ensure(req, length):
            planned = {s.request.id for s in plan}
            victims = [r for r in self.running if r is not req and r.id not in planned]
            if not victims:
                if len(self.running) > 1:        # the others already have this step's blocks: wait
                    self.preempt(req)
                else:                            # alone and still no room: it can never run
                    self.running.remove(req)
                    self.store.free(req.id)
                    refused.append(req)
                return False
            self.preempt(max(victims, key=lambda r: r.arrival))
        return True

    def preempt(self, req: Request) -> None:
        """Free a running request's blocks; it goes back to the front of the queue and is recomputed."""
        self.running.remove(req)
        self.store.free(req.id)
        req.computed = 0
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)
