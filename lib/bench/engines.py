"""The two kinds of engine `dsv4gen bench` times, behind one interface: prefill and greedy decode.

`Ours` is a backend model loaded by `lib.runtime.loaded_model.load_model` and driven by `lib.engine.llm_engine.Engine`,
exactly the loader and build path `dsv4gen run` and the server use (B21): chunked prefill over the
paged cache, one batched forward per step. `Peer` is transformers' DeepseekV4ForCausalLM on the same
checkpoint, prefilled in the same chunk size through its own cache. Each call times only the phase
it names with time.perf_counter; setup (engine records, the prompts' prefill before a decode) is
outside the clock. Must not know about reports or other engines.
"""
from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import NamedTuple

import torch


class Timed(NamedTuple):
    seconds: float
    tokens: list[list[int]]        # each sequence's greedy tokens: the prefill's, then one per decode step
    margins: list[float] | None    # top-1 minus top-2 logit of each sequence's first token (peer only)


def _margins(logits: torch.Tensor) -> list[float]:
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


class Ours:
    """A dsv4gen backend through the engine."""

    def __init__(self, path: Path, backend: str, chunk: int, code=None):
        """`code`: the backend's generated package to run (default: the checked-in one)."""
        from lib.runtime.loaded_model import load_model

        self.name, self.chunk = backend, chunk
        t0 = time.perf_counter()
        self.model = load_model(path, backend, code=code)
        self.load_s = time.perf_counter() - t0

    def _engine(self, seqs: int, longest: int, batched: int):
        from lib.engine.llm_engine import Engine, EngineConfig
        from lib.engine.cache_sizing import blocks_for
        from lib.engine.scheduler import SchedulerConfig

        # admission keeps room for each running decode to grow (L26): the engine's own reserve per sequence
        reserve = SchedulerConfig._field_defaults["decode_reserve_blocks"]
        blocks = blocks_for(self.model, seqs, longest) + seqs * reserve
        return Engine(self.model, EngineConfig(max_num_seqs=seqs, max_num_batched_tokens=batched,
                                               max_model_len=longest, num_blocks=blocks, speculative="none"))

    def prefill(self, ids: list[int]) -> Timed:
        """Time to the first token of one prompt: every chunk of `self.chunk` tokens, then the argmax."""
        from lib.engine.sampling import SamplingParams

        engine = self._engine(1, len(ids) + 1, self.chunk)
        t0 = time.perf_counter()
        (req,) = engine.generate([ids], SamplingParams(max_tokens=1))
        return Timed(time.perf_counter() - t0, [list(req.output)], None)

    def prefill_steps(self, ids: list[int]) -> list[float]:
        """Seconds of each engine step of one prompt's prefill: one step per chunk of `self.chunk`
        tokens, the last ending in the first token. The first k steps are exactly the prefill of
        the prompt's first k chunks (causal attention, the same engine path)."""
        from lib.engine.sampling import SamplingParams

        engine = self._engine(1, len(ids) + 1, self.chunk)
        req = engine.requests[engine.add_request(ids, SamplingParams(max_tokens=1))]
        seconds = []
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            seconds.append(time.perf_counter() - t0)
        if len(seconds) != math.ceil(len(ids) / self.chunk) or len(req.output) != 1:
            raise RuntimeError(f"{self.name}: a {len(ids)}-token prompt took {len(seconds)} engine steps "
                               f"of {self.chunk} tokens, not {math.ceil(len(ids) / self.chunk)}")
        return seconds

    def decode(self, prompts: list[list[int]], steps: int, around=contextlib.nullcontext) -> Timed:
        """Time of `steps` batched decode steps once every prompt has its first token.

        All prompts prefill in one untimed step (max_num_batched_tokens covers them), so each
        timed step decodes exactly one token of every sequence. `around()` is entered just
        outside the timed steps (a profiler, lib/bench/decode_profile.py)."""
        from lib.engine.sampling import SamplingParams

        length = len(prompts[0])
        engine = self._engine(len(prompts), length + steps + 1, max(self.chunk, len(prompts) * length))
        ids = [engine.add_request(p, SamplingParams(max_tokens=steps + 1)) for p in prompts]
        engine.step()
        reqs = [engine.requests[i] for i in ids]
        if any(len(r.output) != 1 for r in reqs):
            raise RuntimeError(f"{self.name}: the prompts did not all prefill in one engine step")
        with around():
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            seconds = time.perf_counter() - t0
        if engine.has_unfinished() or any(len(r.output) != steps + 1 for r in reqs):
            raise RuntimeError(f"{self.name}: {steps} decode steps did not give every sequence {steps} tokens")
        return Timed(seconds, [list(r.output) for r in reqs], None)

    def close(self) -> None:
        self.model = None


class Peer:
    """transformers 5.23.0 DeepseekV4ForCausalLM (lib/bench/hf_peer.py), fp32, eval, no grad."""

    name = "transformers"

    def __init__(self, path: Path, chunk: int):
        from lib.bench.hf_peer import load_hf_model

        self.chunk = chunk
        t0 = time.perf_counter()
        self.model = load_hf_model(path)
        self.load_s = time.perf_counter() - t0

    def prefill(self, ids: list[int]) -> Timed:
        from lib.bench.hf_peer import hf_prefill

        t0 = time.perf_counter()
        logits, _ = hf_prefill(self.model, [ids], self.chunk)
        token = int(logits[0].argmax())
        return Timed(time.perf_counter() - t0, [[token]], _margins(logits))

    def decode(self, prompts: list[list[int]], steps: int) -> Timed:
        from lib.bench.hf_peer import hf_decode_step, hf_prefill

        logits, cache = hf_prefill(self.model, prompts, self.chunk)
        margins = _margins(logits)
        tokens = logits.argmax(-1).tolist()
        out = [[t] for t in tokens]
        position = len(prompts[0])
        t0 = time.perf_counter()
        for s in range(steps):
            logits, cache = hf_decode_step(self.model, tokens, position + s, cache)
            tokens = logits.argmax(-1).tolist()
            for row, t in zip(out, tokens):
                row.append(t)
        return Timed(time.perf_counter() - t0, out, margins)

    def close(self) -> None:
        self.model = None
