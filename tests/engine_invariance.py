"""Engine invariance check of one backend, run as its own process by tests/engine/test_engine.py.

    ATEN_CPU_CAPABILITY=default python -m tests.engine_invariance --backend ascend310p

Greedy tokens of several prompts must be identical (token for token) whether each request runs
alone or batched with others (batch invariance), with DSpark drafting or without, with a Pro-shaped
checkpoint's MTP drafter (one or three chained drafts) or without (lossless speculation), whatever the prefill chunk size (L24), and, with --graph-mode, whether the decode
steps replay captured graphs (lib/engine/graph_mode.py) or run eagerly. The device backends run on their CPU
emulation; lib/emulation/invariant_matmul.py explains why that emulation must be batch invariant, and the test
pins ATen's scalar-consistent kernels because the vectorised ones compute a tensor's last
partial vector with scalar code (exp, log1p... differ in the last bit from their SIMD forms), so
an element's result depends on where it lands in a flattened batch. Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from lib.engine.llm_engine import Engine, EngineConfig
from lib.runtime.loaded_model import load_model
from lib.engine.sampling import SamplingParams
from lib.weights.tiny_checkpoint import embedded_tiny, make_tiny
from tests.helpers import prompt_ids

PROMPTS = [prompt_ids(40, 1024, seed=11), prompt_ids(3, 1024, seed=12), prompt_ids(23, 1024, seed=13)]


def run(model, prompts, *, speculative: str, chunk: int, tokens: int, graphs: tuple[int, ...] | None = None,
        replayed: list | None = None, drafts: int | None = None) -> list[list[int]]:
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=chunk, speculative=speculative,
                          num_speculative_tokens=drafts,
                          max_model_len=256 if graphs else None, enforce_eager=graphs is None, cuda_graph_sizes=graphs,
                          adaptive_drafting=False)      # a full draft block every decode step: the invariance is of it
    engine = Engine(model, config)
    out = [r.output for r in engine.generate(prompts, SamplingParams(max_tokens=tokens))]
    if replayed is not None:
        replayed.append(engine.graphs.replayed)
    used = {group: u for group, (u, _) in engine.store.usage().items()}
    if any(used.values()):
        raise AssertionError(f"blocks still held after every request finished: {used}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--graph-mode", action="store_true", help="also decode through captured step graphs")
    args = p.parse_args(argv)
    model = load_model(embedded_tiny(), args.backend)
    solo = [run(model, [pr], speculative="none", chunk=512, tokens=args.tokens)[0] for pr in PROMPTS]
    result = {"backend": args.backend, "tokens": args.tokens, "solo": solo, "checks": {}}
    for name, which, spec, chunk in (("batched", [0, 1, 2], "none", 512),
                                     ("batched, dspark, prefill chunks of 7", [0, 1, 2], "dspark", 7),
                                     ("pair, dspark", [1, 2], "dspark", 512),
                                     ("prefill chunks of 1", [0], "none", 1)):
        got = run(model, [PROMPTS[i] for i in which], speculative=spec, chunk=chunk, tokens=args.tokens)
        result["checks"][name] = [g == solo[i] for g, i in zip(got, which)]
    # a V4-Pro-shaped checkpoint (HCA first, no sliding-only layer) with its one-layer MTP drafter, chained
    # for one and for three drafts: speculation with it is as lossless as DSpark's
    with tempfile.TemporaryDirectory() as tmp:
        pro = load_model(make_tiny(Path(tmp) / "pro-tiny", variant="pro-tiny"), args.backend)
        n = args.tokens // 2
        result["pro_solo"] = [run(pro, [pr], speculative="none", chunk=512, tokens=n)[0] for pr in PROMPTS]
        for name, drafts, chunk in (("pro-tiny, batched, mtp", 1, 512), ("pro-tiny, batched, mtp x3, prefill chunks of 7", 3, 7)):
            got = run(pro, PROMPTS, speculative="mtp", chunk=chunk, tokens=n, drafts=drafts)
            result["checks"][name] = [g == s for g, s in zip(got, result["pro_solo"])]
    if args.graph_mode:             # buckets of 2 and 4: the three requests pad one, then two finish early
        replayed = []
        got = run(model, PROMPTS, speculative="dspark", chunk=512, tokens=args.tokens, graphs=(2, 4), replayed=replayed)
        result["checks"]["graph mode, batched, dspark"] = [g == s for g, s in zip(got, solo)]
        result["graph_steps"] = replayed[0]
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
