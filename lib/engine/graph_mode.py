"""The engine's graph mode: uniform decode steps replayed as captured graphs, one per batch bucket.

As vLLM does: graphs are captured at start for a list of batch sizes (`--cuda-graph-sizes`; default
1, 2, 4, 8, then multiples of 8 up to max_num_seqs), each for plain decode (one token per sequence)
and, when speculating, for a DSpark verify (1 + the draft block per sequence). A step of n such
sequences runs in the smallest bucket >= n, padded; a step that mixes in prefill chunks, has
sequences with different draft counts or more sequences than the largest bucket runs eagerly.
`--enforce-eager` turns graph mode off.

The default is the device's: captured where its stack has a graph API (torch.npu.NPUGraph,
CUDA / HIP graphs), eager on the CPU emulation, where replaying the exported program saves
nothing (it runs the same kernels) and exporting costs seconds per graph; asking for graph mode
on CPU (`--no-enforce-eager`) runs the exported programs. Either way the tokens are the same
(lib/porting/capture_check.py, tests/engine_invariance.py).
"""
from __future__ import annotations

import sys
import time

from lib.records.addressing import StepShape
from lib.runtime.step_graph import StepGraph, device_graph_api


def capture_sizes(max_num_seqs: int, sizes: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The batch buckets: `sizes` (checked), or vLLM's default list capped at max_num_seqs."""
    if sizes is not None:
        bad = [n for n in sizes if not 1 <= n <= max_num_seqs]
        if not sizes or bad:
            raise ValueError(f"graph capture sizes {list(sizes)}: each must be in [1, max_num_seqs={max_num_seqs}]")
        return tuple(sorted(set(sizes)))
    default = [n for n in (1, 2, 4) if n <= max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    return tuple(default) if default[-1] == max_num_seqs else (*default, max_num_seqs)


def graph_mode_on(enforce_eager: bool | None, store) -> bool:
    """None: the device's default (captured where a graph API exists)."""
    if enforce_eager is not None:
        return not enforce_eager
    return device_graph_api(store.device) is not None


class StepGraphs:
    """Every captured step of an engine: (bucket, tokens per sequence) -> StepGraph."""

    def __init__(self, model, store, sizes: tuple[int, ...], tokens: tuple[int, ...], max_len: int, out=None):
        out = sys.stderr if out is None else out
        self.sizes, self.graphs = sizes, {}
        self.replayed = self.eager = 0          # steps run each way (server metrics, tests)
        t0 = time.perf_counter()
        for q in tokens:
            for n in sizes:
                t = time.perf_counter()
                self.graphs[(n, q)] = StepGraph(model, store, StepShape(n, q, max_len))
                print(f"captured the step of {n} sequence(s) x {q} token(s) in {time.perf_counter() - t:.1f} s",
                      file=out, flush=True)
        print(f"graph mode: {len(self.graphs)} graphs captured in {time.perf_counter() - t0:.1f} s "
              f"(batch sizes {', '.join(map(str, sizes))})", file=out, flush=True)

    def graph_for(self, feeds: list[int]) -> StepGraph | None:
        """The graph a step of these per-sequence token counts replays, or None (runs eagerly)."""
        graph = None
        if feeds and len(set(feeds)) == 1:
            bucket = next((n for n in self.sizes if n >= len(feeds)), None)
            graph = self.graphs.get((bucket, feeds[0]))
        if graph is None:
            self.eager += 1
        else:
            self.replayed += 1
        return graph
