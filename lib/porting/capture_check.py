"""`dsv4gen capture`: a backend's step exported per batch bucket, replayed against eager.

For each bucket one graph is exported (lib/runtime/step_graph.py) from a blank, all-padding step,
then replayed on steps it was not traced with while the same steps run eagerly on a twin cache:
sequences of different lengths, fewer sequences than the bucket (padding), sequences leaving and
joining, entries of every ratio completing, and block tables that differ between the two caches
(the graph's cache holds a spacer sequence, so its physical blocks are others). Every step's logits
must equal eager's bit for bit, and so must every row the sequences can still read at the end.

Bit equality with eager on the unpadded batch needs batch-invariant kernels (docs/porting.md):
the CLI runs this with ATEN_CPU_CAPABILITY=default, as the engine invariance tests do.
"""
from __future__ import annotations

import random
import time
from typing import NamedTuple

import torch

from lib.records.addressing import StepShape
from lib.records.batch import make_batch
from lib.runtime.paged_cache import PagedCache
from lib.runtime.paged_step import paged_step
from lib.runtime.step_graph import StepGraph

# Prompt lengths of the bucket's sequences (cycled): short and long, some about to complete an
# entry of ratio 4, one crossing 128 (the HCA ratio) during the decode steps.
PROMPTS = (37, 5, 124, 63, 250, 1, 17, 90)
SPACER = 300            # positions the graph cache's spacer sequence holds (its blocks come first)


class BucketCheck(NamedTuple):
    bucket: int            # sequences the graph takes
    tokens: int            # new tokens per sequence per step
    steps: int             # replayed steps
    identical: int         # steps whose logits equal eager's bit for bit
    max_abs: float         # largest |replay - eager| over every step
    rows_identical: bool   # every readable pool row equal at the end
    mixes: int             # distinct (sequences, lengths) mixes replayed
    nodes: int             # nodes of the exported graph
    export_s: float
    replay_ms: float       # mean per step (CPU: the exported program; no device graph here)
    eager_ms: float

    @property
    def passed(self) -> bool:
        return self.identical == self.steps and self.rows_identical


def check_bucket(model, bucket: int, *, tokens: int = 1, steps: int = 8, max_len: int = 512,
                 seed: int = 0) -> BucketCheck:
    """Export one bucket and replay it `steps` times beside eager (see the module doc)."""
    rng = random.Random(seed)
    blocks = -(-(max_len * (bucket + 2) + SPACER) // model.facts.block_tokens)
    eager = PagedCache(model, blocks, max_seqs=bucket + 2, slack=tokens)
    replay = PagedCache(model, blocks, max_seqs=bucket + 2, slack=tokens)
    replay.add("spacer")
    replay.ensure("spacer", SPACER)
    t0 = time.perf_counter()
    graph = StepGraph(model, replay, StepShape(bucket, tokens, max_len))
    export_s = time.perf_counter() - t0
    live, joined = [], 0

    def join():
        nonlocal joined
        ids = [rng.randrange(model.cfg.vocab_size) for _ in range(PROMPTS[joined % len(PROMPTS)])]
        name, joined = f"s{joined}", joined + 1
        for store in (eager, replay):
            store.add(name)
            paged_step(model, make_batch([ids]), store, [name])
        live.append(name)

    for _ in range(bucket):
        join()
    identical, worst, mixes, times = 0, 0.0, set(), {"replay": 0.0, "eager": 0.0}
    for step in range(steps):
        if step == steps // 3:                      # a sequence leaves and another joins
            _leave(live, eager, replay, 0)
            join()
        if step == 2 * steps // 3 and len(live) > 1:        # one leaves: the bucket is padded from here
            _leave(live, eager, replay, len(live) - 1)
        chunks = [[rng.randrange(model.cfg.vocab_size) for _ in range(tokens)] for _ in live]
        starts = [eager.length(s) for s in live]
        mixes.add(tuple(starts))
        got = {}
        for name, store, g in (("eager", eager, None), ("replay", replay, graph)):
            t = time.perf_counter()
            got[name] = paged_step(model, make_batch(chunks, starts), store, live, graph=g)[0]
            times[name] += time.perf_counter() - t
        identical += torch.equal(got["eager"], got["replay"])
        worst = max(worst, (got["eager"].float() - got["replay"].float()).abs().max().item())
    rows = all(torch.equal(a, b) for s in live
               for a, b in zip(eager.live_rows(s).values(), replay.live_rows(s).values(), strict=True))
    return BucketCheck(bucket, tokens, steps, identical, worst, rows, len(mixes), len(graph.program.graph.nodes),
                       export_s, 1e3 * times["replay"] / steps, 1e3 * times["eager"] / steps)


def _leave(live: list, eager: PagedCache, replay: PagedCache, index: int) -> None:
    name = live.pop(index)
    eager.free(name)
    replay.free(name)


def table(backend: str, checks: list[BucketCheck]) -> str:
    head = (f"{'bucket':>6} {'tokens':>6} {'identical':>10} {'max |d|':>8} {'rows':>5} {'mixes':>5} {'nodes':>6} "
            f"{'export s':>8} {'replay ms':>9} {'eager ms':>8}")
    lines = [f"captured step of backend {backend}: exported per bucket, replayed against eager", head]
    for c in checks:
        lines.append(f"{c.bucket:>6} {c.tokens:>6} {f'{c.identical}/{c.steps}':>10} {c.max_abs:>8.1e} "
                     f"{'same' if c.rows_identical else 'DIFF':>5} {c.mixes:>5} {c.nodes:>6} {c.export_s:>8.1f} "
                     f"{c.replay_ms:>9.1f} {c.eager_ms:>8.1f}")
    return "\n".join(lines)
