"""The engine (lib/engine/llm_engine.py): lossless DSpark, batch and chunk invariance, cache hygiene, refusals.

Everything loads the embedded tiny checkpoint through `load_model` and runs the real engine; the
oracle and wrong drafters replace only `lib.engine.drafting.propose`, the proposal itself.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

import lib.engine.drafting as dspark
from lib.engine.llm_engine import Engine, EngineConfig
from lib.engine.greedy import greedy
from lib.runtime.loaded_model import load_model
from lib.engine.sampling import SamplingParams, target_probs
from lib.weights.tiny_checkpoint import embedded_tiny
from tests.helpers import prompt_ids

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def cpu_model():
    return load_model(embedded_tiny(), "cpu")


def _engine(model, drafter=None, **kw) -> Engine:
    # a full draft block at every decode step unless a test says otherwise: the machinery under test every step
    config = EngineConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 256, "adaptive_drafting": False, **kw})
    return Engine(model, config) if drafter is None else Engine(model, config, drafter=drafter)


def test_dspark_greedy_is_lossless_and_equals_the_reference_loop(cpu_model):
    prompts = [prompt_ids(n, 1024, seed=20 + n) for n in (5, 23, 40)]
    reference = [list(greedy(cpu_model, p, 64)) for p in prompts]     # the plain one-sequence loop
    for batch in (1, 3):
        engine = _engine(cpu_model, speculative="dspark")
        got = [r.output for r in engine.generate(prompts[:batch], SamplingParams(max_tokens=64))]
        assert got == reference[:batch]
        assert engine.drafted[0] > 0          # the drafter really ran and was verified
        assert all(a <= d for a, d in zip(engine.accepted, engine.drafted))


def _scripted_drafter(continuation):
    """A drafter for the engine: `continuation(start, gamma)` -> proposed token ids."""
    def drafter(model, requests, rings, choose):
        gamma, starts = dspark.block_size(model), [r.computed for r in requests]
        tokens = torch.tensor([continuation(s, gamma) for s in starts])
        probs = torch.nn.functional.one_hot(tokens, model.cfg.vocab_size).float()
        return dspark.DraftBlock(tokens, probs, torch.zeros(len(starts), gamma))
    return drafter


def _views_at(model, prompt, speculative: str, length: int, drafter=None):
    """The rows a request's committed length can read, once it has committed exactly `length` positions."""
    engine = _engine(model, drafter, speculative=speculative, max_num_seqs=1)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=200))
    while engine.requests[rid].computed < length:
        engine.step()
    req = engine.requests[rid]
    return req.computed, engine.store.live_rows(rid), req, engine


def _same_views(a: dict, b: dict) -> bool:
    """The backbone rows two caches can still read are identical (the drafter rings exist in one only)."""
    keys = [k for k in b if k.startswith("layer")]
    return bool(keys) and all(torch.equal(a[k], b[k]) for k in keys)


@pytest.mark.parametrize("drafter", ["oracle", "wrong"])
def test_oracle_drafts_are_all_accepted_wrong_ones_rejected_and_caches_match(cpu_model, drafter):
    prompt = prompt_ids(21, 1024, seed=5)
    target = prompt + list(greedy(cpu_model, prompt, 80))
    gamma = dspark.block_size(cpu_model)
    if drafter == "oracle":   # the target's own greedy continuation after the anchor at `start`
        scripted = _scripted_drafter(lambda start, g: target[start + 1: start + 1 + g])
    else:                     # never the target's token
        scripted = _scripted_drafter(lambda start, g: [(t + 1) % 1024 for t in target[start + 1: start + 1 + g]])
    length, views, req, engine = _views_at(cpu_model, prompt, "dspark", 50, scripted)
    rounds = req.drafted[0]
    assert rounds > 0
    if drafter == "oracle":
        assert req.accepted == req.drafted                    # every position of every round accepted
        assert (length - len(prompt)) == rounds * (gamma + 1) or length >= 50
    else:
        assert req.accepted == [0] * gamma                    # rejected at the first position, always
    assert req.output == target[len(prompt): len(prompt) + len(req.output)]
    plain_length, plain_views, _, _ = _views_at(cpu_model, prompt, "none", length)
    assert plain_length == length
    assert _same_views(views, plain_views)       # rejected positions left no trace in any cache


def test_sampled_dspark_keeps_the_target_distribution(cpu_model):
    """Temperature 1, top-k 2: the first two emitted tokens over 300 seeds follow the target's
    exact joint distribution (the second one comes out of verification: accepted or corrected)."""
    params = dict(temperature=1.0, top_k=2, max_tokens=3)   # 3: the step after the first token drafts
    prompt = prompt_ids(12, 1024, seed=9)
    engine = _engine(cpu_model, speculative="dspark", max_num_seqs=64, max_num_batched_tokens=2048)
    ids = [engine.add_request(prompt, SamplingParams(seed=1000 + i, **params)) for i in range(300)]
    while engine.has_unfinished():
        engine.step()
    assert sum(engine.drafted) > 0
    pairs = [tuple(engine.requests[i].output[:2]) for i in ids]
    from lib.engine.greedy import all_logits
    p1 = target_probs(all_logits(cpu_model, prompt)[-1:], SamplingParams(**params))[0]
    expected = {}
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = target_probs(all_logits(cpu_model, prompt + [t1])[-1:], SamplingParams(**params))[0]
        for t2 in torch.nonzero(p2).flatten().tolist():
            expected[(t1, t2)] = float(p1[t1] * p2[t2])
    assert set(pairs) <= set(expected)
    counts = torch.tensor([pairs.count(k) for k in expected], dtype=torch.float64)
    probs = torch.tensor(list(expected.values()), dtype=torch.float64)
    chi2 = float(((counts - 300 * probs) ** 2 / (300 * probs)).sum())
    assert chi2 < 16.3, (chi2, dict(zip(expected, counts.tolist())))     # p = 0.001 at 3 degrees of freedom


def test_two_hundred_mixed_requests_free_every_block(cpu_model):
    """Different lengths and limits, tight cache (preemption), cancellations: every completed
    request equals its sequential greedy output and every block comes back."""
    rng = random.Random(7)
    prompts = [prompt_ids(rng.randint(2, 30), 1024, seed=100 + i) for i in range(12)]
    plain = _engine(cpu_model, speculative="none", max_num_seqs=12)
    reference = [r.output for r in plain.generate(prompts, SamplingParams(max_tokens=10))]
    engine = _engine(cpu_model, speculative="dspark", max_num_seqs=16, max_num_batched_tokens=64, num_blocks=6)
    live, done, cancelled, submitted = {}, {}, set(), 0
    while submitted < 200 or engine.has_unfinished():
        while submitted < 200 and len(live) < 24:
            k = rng.randrange(len(prompts))
            rid = engine.add_request(prompts[k], SamplingParams(max_tokens=rng.randint(1, 10)))
            live[rid] = k
            submitted += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = live.pop(out.request_id)
        if live and rng.random() < 0.1:
            victim = rng.choice(sorted(live))
            engine.abort(victim)
            cancelled.add(live.pop(victim))
    assert len(done) + len(cancelled) >= 150 and len(cancelled) > 5
    for rid, k in done.items():
        req = engine.requests[rid]
        assert req.finish_reason == "length", (rid, req.finish_reason, req.error)
        assert req.output == reference[k][: len(req.output)] and len(req.output) == req.params.max_tokens
    assert all(used == 0 for used, _ in engine.store.usage().values())


def test_preempted_requests_are_recomputed_to_the_same_tokens(cpu_model):
    # 3 sequences of about 70 positions need 2 blocks of 16 CSA entries each; the cache has
    # cdiv(1, 4) + 3 = 4 (one block of context positions plus one partial block per sequence)
    prompts = [prompt_ids(50, 1024, seed=41), prompt_ids(48, 1024, seed=42), prompt_ids(45, 1024, seed=43)]
    reference = [list(greedy(cpu_model, p, 24)) for p in prompts]
    engine = _engine(cpu_model, speculative="dspark", num_blocks=1, max_num_seqs=3)
    engine.scheduler.config = engine.scheduler.config._replace(decode_reserve_blocks=0)   # admit greedily
    got = engine.generate(prompts, SamplingParams(max_tokens=24, prompt_logprobs=0))
    assert [r.output for r in got] == reference
    assert sum(r.preemptions for r in got) > 0                                # the cache really ran out
    assert [len(r.prompt_logprobs) for r in got] == [len(p) for p in prompts]   # scored once each
    assert all(used == 0 for used, _ in engine.store.usage().values())


def test_admission_keeps_room_for_the_running_requests_to_grow_in_positions(cpu_model):
    # 8 prompts of 60 positions take one block of each entry group (15 entries of ratio 4, 7 of ratio 8,
    # blocks of 16); growing by one block of 16 positions takes a second ratio-4 block (19 entries) and
    # no ratio-8 one (9). num_blocks = N gives the ratio-4 group cdiv(N, 4) + 8 blocks: the 8th admission
    # needs 8 taken + 7 growing = 15 of them, so N = 28 admits all 8 and N = 24 (14 blocks) admits 7.
    # N = 32 leaves the ratio-8 group cdiv(32, 8) + 8 = 12 blocks, all the 8 sequences need there:
    # a free block kept per running request in every group would admit only 6. Prompts of 50 grow into
    # no new block (16 entries of ratio 4), so N = 24 admits all 8; a reserve of a ratio-4 block's
    # positions (64) would carry each into a second block and admit 7.
    for length, num_blocks, admitted in ((60, 24, 7), (60, 28, 8), (60, 32, 8), (50, 24, 8)):
        prompts = [prompt_ids(length, 1024, seed=60 + k) for k in range(8)]
        engine = _engine(cpu_model, speculative="none", num_blocks=num_blocks, max_num_batched_tokens=480)
        ids = [engine.add_request(p, SamplingParams(max_tokens=2)) for p in prompts]
        engine.step()
        assert sum(len(engine.requests[i].output) == 1 for i in ids) == admitted, (length, num_blocks)
        while engine.has_unfinished():
            engine.step()
        assert all(engine.requests[i].finish_reason == "length" for i in ids)


def test_refusals_name_what_was_wrong(cpu_model):
    engine = _engine(cpu_model, speculative="none", max_model_len=64)
    with pytest.raises(ValueError, match=r"prompt \(60 tokens\) \+ max_tokens \(10\) = 70 exceeds the maximum context length 64"):
        engine.add_request(list(range(20, 80)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="token id 5000 is outside the vocabulary"):
        engine.add_request([1, 5000], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([20, 21], SamplingParams(temperature=-1.0))
    # one block of context plus one partial block per sequence: 2 blocks of 16 CSA entries, 128 positions
    small = _engine(cpu_model, speculative="none", num_blocks=1, max_num_seqs=1)
    rid = small.add_request(list(range(20, 170)), SamplingParams(max_tokens=4))
    outs = small.step()
    assert outs[0].finished and outs[0].finish_reason == "error" and "cannot hold request" in outs[0].error
    assert small.requests[rid].finish_reason == "error" and not small.has_unfinished()


def test_abort_frees_blocks_at_once(cpu_model):
    engine = _engine(cpu_model, speculative="dspark")
    rid = engine.add_request(prompt_ids(30, 1024), SamplingParams(max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.store.usage()["slots"][0] == 1 and engine.store.usage()["c4"][0] > 0
    engine.abort(rid)
    assert all(used == 0 for used, _ in engine.store.usage().values()) and not engine.has_unfinished()


class _DraftSpy:
    """The generated module with its drafter program watched: the blocks' input tokens are kept."""

    def __init__(self, module):
        self.module, self.seen = module, []

    def __getattr__(self, name):
        return getattr(self.module, name)

    def draft(self, params, batch, rings, cfg, rope):
        self.seen.append(batch.tokens.tolist())
        return self.module.draft(params, batch, rings, cfg, rope)


def test_noise_token_comes_from_the_config(cpu_model):
    """B15: the draft block is [anchor, noise x (gamma-1)] with dspark_noise_token_id, never 0."""
    spy = _DraftSpy(cpu_model.module)
    watched = cpu_model._replace(module=spy)                     # the model's generated module, watched
    _engine(watched, speculative="dspark").generate([prompt_ids(9, 1024)], SamplingParams(max_tokens=3))
    seen = spy.seen
    noise = cpu_model.cfg.dspark_noise_token_id
    assert seen and all(block[1:] == [noise] * (len(block) - 1) for block in seen) and noise != 0


@pytest.mark.parametrize("backend", ["cpu", "ascend310p", "ascend910", "hip936"])
def test_batch_chunk_and_speculation_invariance(backend):
    """tests/engine_invariance.py in its own process with ATen's scalar-consistent kernels (it says why)."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1",
           # glibc otherwise returns and re-maps the fp64 temporaries of every op (several x slower)
           "MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296"}
    # graph mode (captured decode steps) on the backend whose field stack captures its steps
    graph = ["--graph-mode"] if backend == "ascend910" else []
    out = subprocess.run([sys.executable, "-m", "tests.engine_invariance", "--backend", backend, *graph], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["tokens"] >= 64 and all(len(s) == 64 for s in result["solo"])
    assert all(len(s) == 32 for s in result["pro_solo"]) and sum("mtp" in name for name in result["checks"]) == 2
    failed = {name: ok for name, ok in result["checks"].items() if not all(ok)}
    assert not failed, failed
    if graph:
        assert "graph mode, batched, dspark" in result["checks"] and result["graph_steps"] >= 10


def test_logprobs_and_prompt_logprobs_match_the_model(cpu_model):
    from lib.engine.greedy import all_logits

    prompt = prompt_ids(10, 1024, seed=3)
    engine = _engine(cpu_model, speculative="dspark", max_num_batched_tokens=4)     # prompt in chunks of 4
    (req,) = engine.generate([prompt], SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=1))
    logp = torch.log_softmax(all_logits(cpu_model, prompt + req.output).double(), dim=-1)
    assert req.prompt_logprobs[0] is None and len(req.prompt_logprobs) == len(prompt)
    for i, rec in enumerate(req.prompt_logprobs[1:], start=1):
        assert rec.token == prompt[i] and abs(rec.logprob - float(logp[i - 1, prompt[i]])) < 1e-4
    assert [r.token for r in req.logprobs] == req.output
    for k, rec in enumerate(req.logprobs):
        row = logp[len(prompt) - 1 + k]
        assert abs(rec.logprob - float(row[rec.token])) < 1e-4 and rec.rank == 1          # greedy: the top token
        assert [t for t, _ in rec.top] == row.topk(3).indices.tolist()


def test_stop_strings_and_stop_tokens_end_the_request(cpu_model):
    from lib.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(embedded_tiny())
    prompt = tok.encode("The quick brown fox")
    free = Engine(cpu_model, EngineConfig(speculative="dspark"), tokenizer=tok)
    (full,) = free.generate([prompt], SamplingParams(max_tokens=24))
    text = full.text
    assert len(text) > 8
    stop = text[len(text) // 2: len(text) // 2 + 3]
    engine = Engine(cpu_model, EngineConfig(speculative="dspark"), tokenizer=tok)
    (cut,) = engine.generate([prompt], SamplingParams(max_tokens=24, stop=(stop,)))
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)] and stop not in cut.text
    third = full.output[2]
    engine = Engine(cpu_model, EngineConfig(speculative="dspark"), tokenizer=tok)
    (by_id,) = engine.generate([prompt], SamplingParams(max_tokens=24, stop_token_ids=(third,)))
    assert by_id.finish_reason == "stop" and by_id.output == full.output[: full.output.index(third) + 1]


def test_cli_run_reports_draft_statistics(capsys):
    from lib.cli.main import main

    assert main(["run", "--prompt", "Hello", "--max-tokens", "12", "--stats"]) == 0
    out = capsys.readouterr()
    assert "speculative: dspark; emitted 12 tokens" in out.err and "accepted/drafted per position" in out.err
    assert main(["run", "--prompt", "Hello", "--max-tokens", "12", "--stats", "--speculative", "none"]) == 0
    plain = capsys.readouterr()
    assert plain.out == out.out and "speculative: none" in plain.err          # lossless, through the CLI
    runs = []
    for _ in range(2):
        assert main(["run", "--prompt", "Hello", "--max-tokens", "12", "--temperature", "0.9", "--seed", "4"]) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1]
