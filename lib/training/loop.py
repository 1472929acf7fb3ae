"""`dsv4gen train-tiny`: from a seed to a trained tiny DeepSeek-V4 checkpoint in the official format, with the record
of how it was made and how it scores.

1. initial weights: `make-tiny`'s initialisation of the `trained` preset (lib/weights/tiny_checkpoint.py) with this
   seed (every layer kind of Flash), the learned routers' selection biases set to zero (they then follow the experts'
   loads: routing.py);
2. the target trained on the task mix's training split (corpus.py, target.py; each step's batch shared by the
   data-parallel ranks, data_parallel.py), its indexer distilled from the attention it serves (indexer.py), then
   the DSpark drafter on the frozen target (drafter.py), its batches shared by the same ranks;
3. the checkpoint written (export.py) with the task mix's tokenizer, then loaded back as any checkpoint is and scored
   on the held-out split through the engine (lib/evaluation/suite.py); `training.json` beside the weights records
   the seed, steps, time, losses and that accuracy.
"""
from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm import tqdm

from backends.cpu.ops.basic import computing_in
from lib.runtime.loaded_model import load_model
from lib.training import data_parallel
from lib.training.corpus import TrainingStream, task_tokenizer
from lib.training.drafter import DrafterTrainer
from lib.training.export import write_trained
from lib.training.target import Schedule, TargetTrainer
from lib.weights.tiny_checkpoint import PRESETS, TINY_VARIANT, TRAINING_RECORD, make_tiny
from spec.variants import variant_config

# The reference ops compute in float64 for last-bit stability across batch shapes (backends/cpu/ops/basic.py);
# training needs neither that nor the doubled memory traffic, so weights and ops run in float32 while it trains
# (the checkpoint is written from them as from any float32 weights).
TRAINING_DTYPE = torch.float32


class TrainConfig(NamedTuple):
    seed: int = 0
    steps: int = 2400
    drafter_steps: int = 900        # DSpark drafter steps on the finished target
    tokens_per_step: int = 2048     # whole conversations per optimiser step, up to this many tokens
    drafter_tokens_per_step: int = 1024   # the same for a drafter step (more, smaller steps)
    lr: float = 2e-3
    eval_per_task: int = 100        # held-out questions per task scored at the end (0: none)
    preset: str = "trained"
    data_parallel_size: int = 2     # processes sharing each target step's batch, the threads split among them


def train_tiny(out: Path, config: TrainConfig = TrainConfig(), overwrite: bool = False, log=print) -> dict:
    """Train, write `out`, score it; returns the record also written to out/training.json."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out}: already exists and is not empty (pass --force to replace it)")
    if config.steps < 1 or min(config.tokens_per_step, config.drafter_tokens_per_step) < 64:
        raise ValueError(f"--steps must be >= 1 and --tokens-per-step and --drafter-tokens-per-step >= 64, got "
                         f"{config.steps}, {config.tokens_per_step} and {config.drafter_tokens_per_step}")
    if config.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {config.data_parallel_size}")
    started = time.monotonic()
    model, cfg, tokenizer = _initial(config)
    threads = max(1, torch.get_num_threads() // config.data_parallel_size)
    with computing_in(TRAINING_DTYPE):
        trained = _train(model, cfg, tokenizer, config, threads)
    trained_s = time.monotonic() - started
    path = write_trained(out, model.params, cfg, tokenizer, overwrite=overwrite)
    record = {"command": f"dsv4gen train-tiny --out {out} --seed {config.seed} --steps {config.steps} "
                         f"--drafter-steps {config.drafter_steps} --drafter-tokens-per-step {config.drafter_tokens_per_step} "
                         f"--tokens-per-step {config.tokens_per_step} --lr {config.lr} "
                         f"--data-parallel-size {config.data_parallel_size}",
              "config": config._asdict(), "torch": torch.__version__, "threads_per_rank": threads,
              "training_seconds": round(trained_s, 1), **trained}
    if config.eval_per_task:
        record["heldout"] = _score(path, config.eval_per_task, log)
    record["total_seconds"] = round(time.monotonic() - started, 1)
    (path / TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def _narrow(params) -> None:
    """The reference's float64 weights as float32 (TRAINING_DTYPE) tensors, in place in their dicts."""
    for scope in (params.model, *params.layers, *params.drafter):
        for key, value in scope.items():
            if isinstance(value, torch.Tensor) and value.dtype == torch.float64:
                scope[key] = value.to(TRAINING_DTYPE)


def _initial(config: TrainConfig):
    """The seed's initial model (float32 weights, selection biases zero), its config and the task tokenizer: the
    same in every data-parallel rank."""
    torch.manual_seed(config.seed)
    cfg = variant_config(TINY_VARIANT, PRESETS[config.preset])
    tokenizer = task_tokenizer(cfg.vocab_size)
    with tempfile.TemporaryDirectory(prefix="train-tiny-init-") as tmp:
        model = load_model(make_tiny(Path(tmp) / "init", seed=config.seed, preset=config.preset), "cpu")
    for block in model.params.layers:
        if "ffn.gate.bias" in block:
            block["ffn.gate.bias"].zero_()
    _narrow(model.params)
    return model, cfg, tokenizer


def _train(model, cfg, tokenizer, config: TrainConfig, threads: int) -> dict:
    """The target, then the drafter on it, over `config.data_parallel_size` ranks of `threads` threads each: the
    record's training fields."""
    stream = TrainingStream(tokenizer, cfg.sliding_window, config.seed)
    every = torch.get_num_threads()
    with data_parallel.ranks(config.data_parallel_size, _rank, (config, threads)) as share:
        torch.set_num_threads(threads)
        try:
            losses, kls, tokens = _train_target(model, stream, config, share, progress=True)
            drafted = _train_drafter(model, stream, config, share, progress=True) if config.drafter_steps else {}
        finally:
            torch.set_num_threads(every)
    return {"tokens": tokens, "loss_first_20": _mean(losses[:20]), "loss_last_20": _mean(losses[-20:]),
            "indexer_kl_first_20": _mean(kls[:20]), "indexer_kl_last_20": _mean(kls[-20:]), **drafted}


def _train_target(model, stream: TrainingStream, config: TrainConfig, share, progress: bool):
    """Every rank's target steps (the same batches: each rank takes its share); the losses of the whole batches."""
    trainer = TargetTrainer(model, Schedule(config.steps, lr=config.lr, warmup=max(1, min(50, config.steps // 10))))
    losses, kls, tokens = [], [], 0
    with tqdm(total=config.steps, desc="training the target", unit="step", disable=not progress) as bar:
        for _ in range(config.steps):
            batch = stream.batch(config.tokens_per_step)
            ce, kl = trainer.step(batch, share)
            losses.append(ce)
            kls.append(kl)
            tokens += sum(len(s.ids) for s in batch)
            bar.update(1)
            bar.set_postfix(loss=f"{_mean(losses[-20:]):.3f}", indexer_kl=f"{_mean(kls[-20:]):.3f}")
    trainer.finish()
    return losses, kls, tokens


def _rank(rank: int, world: int, init_method: str, config: TrainConfig, threads: int) -> None:
    """A data-parallel worker (a fresh process): the same initial model and stream as rank 0, its share of
    every target step, then of every drafter step on its own copy of the target (bit-identical to rank 0's);
    rank 0 keeps the weights."""
    torch.set_num_threads(threads)
    share = data_parallel.join(rank, world, init_method)
    model, cfg, tokenizer = _initial(config)
    stream = TrainingStream(tokenizer, cfg.sliding_window, config.seed)
    with computing_in(TRAINING_DTYPE):
        _train_target(model, stream, config, share, progress=False)
        if config.drafter_steps:
            _train_drafter(model, stream, config, share, progress=False)


def _train_drafter(model, stream: TrainingStream, config: TrainConfig, share, progress: bool) -> dict:
    """DSpark's objective on the frozen target (drafter.py), each step's batch shared by the ranks as the target's
    are; the record's drafter fields."""
    trainer = DrafterTrainer(model, config.drafter_steps, lr=config.lr, warmup=max(1, min(20, config.drafter_steps // 10)))
    losses, accepted = [], []
    with tqdm(total=config.drafter_steps, desc="training the DSpark drafter", unit="step", disable=not progress) as bar:
        for _ in range(config.drafter_steps):
            loss, acc = trainer.step(stream.batch(config.drafter_tokens_per_step), share)
            losses.append(loss)
            accepted.append(acc)
            bar.update(1)
            bar.set_postfix(loss=f"{_mean(losses[-20:]):.3f}", accepted=f"{_mean(accepted[-20:]):.2f}")
    trainer.finish()
    return {"drafter_loss_first_20": _mean(losses[:20]), "drafter_loss_last_20": _mean(losses[-20:]),
            "drafter_accepted_first_20": _mean(accepted[:20]), "drafter_accepted_last_20": _mean(accepted[-20:])}


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 4) if values else float("nan")


def _score(path: Path, per_task: int, log) -> dict:
    """Held-out exact match of the written checkpoint, loaded back as users load it (plain decoding), and DSpark's
    acceptance on the same questions (a full block every step, so every position is measured). The two runs go in
    two processes of half the threads each: the engine at these widths is bound by per-op overhead, which a second
    thread does not share (as in training, data_parallel.py)."""
    every = torch.get_num_threads()
    half = max(1, every // 2)
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        drafted = pool.submit(_scored, str(path), per_task, "dspark", half, False)
        torch.set_num_threads(half)
        try:
            plain = _scored(str(path), per_task, "plain", half, True)
        finally:
            torch.set_num_threads(every)
        dspark = drafted.result()
    accuracy = {task: round(a["accuracy"], 4) for task, a in plain.accuracy().items()}
    log("held-out exact match: " + ", ".join(f"{t} {a:.0%}" for t, a in accuracy.items()))
    spec = dspark.speculation() or {}
    same = [o.reply for o in plain.outcomes] == [o.reply for o in dspark.outcomes]
    return {"accuracy": accuracy, "dspark_mean_accepted_per_round": round(spec.get("mean_accepted_per_round", 0.0), 3),
            "dspark_replies_identical": same}


def _scored(path: str, per_task: int, name: str, threads: int, progress: bool):
    """One scoring run (`name`: plain or dspark) of the checkpoint at `path` in this process: its SuiteRun."""
    from lib.engine.llm_engine import Engine, EngineConfig
    from lib.evaluation import suite
    from lib.evaluation.tasks import TASKS
    from lib.text.tokenizer import Tokenizer

    torch.set_num_threads(threads)
    model, tok = load_model(path, "cpu"), Tokenizer.from_dir(path)
    exs = suite.heldout_for(model.cfg, tok, TASKS, per_task)
    engine = Engine(model, EngineConfig(max_num_seqs=16, speculative="none" if name == "plain" else "dspark",
                                        adaptive_drafting=False), tokenizer=tok)
    desc = "scoring held-out questions (plain; DSpark beside it)"
    with tqdm(total=len(exs), desc=desc, unit="question", disable=not progress) as bar:
        return suite.run(engine, tok, exs, progress=bar)
