"""Does a TP / EP layout decode exactly like one process? Greedy tokens through the launcher users run.

Used by `dsv4gen conformance --tensor-parallel-size T --expert-parallel-size E` and the tests: the
same prompts decoded greedily for a fixed number of tokens (EOS ignored, so every step counts) by
one process and by T x E ranks, with or without DSpark, must give the same tokens. A re-introduced
B11 (every rank with rank 0's expert map) or B05 (scales not sliced for TP) breaks that.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from lib.engine.llm_engine import EngineConfig
from lib.launcher.ranks import LaunchSpec, ReplicatedEngine, launch, local_engine
from lib.weights.params import LoadOptions
from lib.engine.sampling import SamplingParams
from lib.porting.faults import check as check_injection

DEFAULT_PROMPTS = ((0, 17, 300, 41, 7, 512, 88, 2), (0, 900, 33, 270, 5), (0, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73))


class Agreement(NamedTuple):
    layout: str
    speculative: str
    reference: list[list[int]]
    parallel: list[list[int]]

    @property
    def first_difference(self) -> tuple[int, int] | None:
        """(prompt, step) of the first differing token, or None when every token agrees."""
        for p, (a, b) in enumerate(zip(self.reference, self.parallel)):
            for i, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    return p, i
            if len(a) != len(b):
                return p, min(len(a), len(b))
        return None

    def line(self) -> str:
        diff = self.first_difference
        steps = sum(len(r) for r in self.reference)
        verdict = "identical" if diff is None else f"DIFFER at prompt {diff[0]} step {diff[1]}"
        return f"{self.layout} ({self.speculative}): {steps} greedy tokens vs one process: {verdict}"


def greedy_tokens(model_path: Path, backend: str, prompts, steps: int, *, tp: int = 1, ep: int = 1,
                  dispatch: str = "allgather", speculative: str = "none",
                  options: LoadOptions = LoadOptions(), inject: str | None = None) -> list[list[int]] | None:
    """Greedy tokens of `prompts`; None on a torchrun rank other than 0 (it followed rank 0's job). With TP and
    EP 1 the engine runs in this process alone, inside a torchrun job too (the one-process reference)."""
    config = EngineConfig(max_num_seqs=len(prompts), speculative=speculative)
    if inject is not None:           # every rank loads with the bug's load-time fault sites (B05, B11)
        inj = check_injection(inject, backend)
        if not inj.load_only:
            raise ValueError(f"{inject} is injected into the generated code or the run path, which the TP/EP check "
                             "does not render; check it without --tensor-parallel-size / --expert-parallel-size")
        options = options._replace(faults=inj.load)
    spec = LaunchSpec(Path(model_path), backend, options, config, tp, ep, dispatch)
    engine = local_engine(spec, progress=False) if max(tp, ep) == 1 else launch(spec, False, follower_returns=True)
    if engine is None:
        return None
    try:
        params = SamplingParams(max_tokens=steps, ignore_eos=True)
        return [list(r.output) for r in engine.generate([list(p) for p in prompts], params)]
    finally:
        if isinstance(engine, ReplicatedEngine):
            engine.close()


def check(model_path: Path, backend: str, tp: int, ep: int, dispatch: str, *, steps: int = 64,
          prompts=DEFAULT_PROMPTS, modes=("none", "dspark"), options: LoadOptions = LoadOptions(),
          reference: dict | None = None, inject: str | None = None) -> list[Agreement]:
    """One Agreement per speculative mode; `reference` caches the one-process tokens per mode."""
    reference = {} if reference is None else reference
    out = []
    for mode in modes:
        if mode not in reference:
            reference[mode] = greedy_tokens(model_path, backend, prompts, steps, speculative=mode, options=options)
        got = greedy_tokens(model_path, backend, prompts, steps, tp=tp, ep=ep, dispatch=dispatch, speculative=mode,
                            options=options, inject=inject)
        out.append(Agreement(f"TP={tp} EP={ep} {dispatch}", mode, reference[mode], got))
    return out
