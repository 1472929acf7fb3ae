"""`dsv4gen train-tiny`: train the `trained` tiny preset on the task mix and write it in the official checkpoint format
(lib/training). Prints the time it took and the held-out exact match of the checkpoint it wrote."""
from __future__ import annotations

import sys

from lib.console.stages import Stages


def add_parser(sub) -> None:
    from lib.training.loop import TrainConfig

    d = TrainConfig()
    s = sub.add_parser("train-tiny",
                       help="train the tiny model (window 32) on the checkable task mix, on this CPU, and write it "
                            "as an official-format checkpoint")
    s.add_argument("--out", required=True, help="checkpoint folder to write")
    s.add_argument("--seed", type=int, default=d.seed, help=f"initial weights and training stream (default {d.seed})")
    s.add_argument("--steps", type=int, default=d.steps, help=f"optimiser steps (default {d.steps})")
    s.add_argument("--drafter-steps", type=int, default=d.drafter_steps,
                   help=f"DSpark drafter steps on the finished target; 0: keep its initial weights (default {d.drafter_steps})")
    s.add_argument("--tokens-per-step", type=int, default=d.tokens_per_step,
                   help=f"whole conversations per step, up to this many tokens (default {d.tokens_per_step})")
    s.add_argument("--drafter-tokens-per-step", type=int, default=d.drafter_tokens_per_step,
                   help=f"the same for a drafter step (default {d.drafter_tokens_per_step})")
    s.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    s.add_argument("--eval-per-task", type=int, default=d.eval_per_task,
                   help=f"held-out questions per task scored at the end; 0: none (default {d.eval_per_task})")
    s.add_argument("--data-parallel-size", type=int, default=d.data_parallel_size,
                   help=f"processes that share each target step's batch, this machine's threads split among them: "
                        f"the tiny model's ops are too small for a second thread to help much (default "
                        f"{d.data_parallel_size})")
    s.add_argument("--force", action="store_true", help="replace an existing output folder")
    s.set_defaults(func=_run)


def _run(args) -> int:
    from lib.training.loop import TrainConfig, train_tiny
    from lib.weights.tiny_checkpoint import TRAINING_RECORD

    config = TrainConfig(seed=args.seed, steps=args.steps, drafter_steps=args.drafter_steps,
                         tokens_per_step=args.tokens_per_step, drafter_tokens_per_step=args.drafter_tokens_per_step,
                         lr=args.lr, eval_per_task=args.eval_per_task,
                         data_parallel_size=args.data_parallel_size)
    with Stages("train-tiny")(f"training {args.steps} steps of up to {args.tokens_per_step} tokens, seed {args.seed}"):
        record = train_tiny(args.out, config, overwrite=args.force,
                            log=lambda line: print(line, file=sys.stderr))
    print(f"wrote the trained checkpoint to {args.out} ({record['tokens']:,} training tokens in "
          f"{record['training_seconds']:.0f} s; loss {record['loss_first_20']:.3f} -> {record['loss_last_20']:.3f}; "
          f"{args.out}/{TRAINING_RECORD} has the record)")
    if "heldout" in record:
        held = record["heldout"]
        print("held-out exact match: " + ", ".join(f"{t} {a:.0%}" for t, a in held["accuracy"].items()))
        print(f"DSpark: {held['dspark_mean_accepted_per_round']:.2f} accepted drafts per round; replies identical "
              f"with and without it: {'yes' if held['dspark_replies_identical'] else 'NO'}")
    return 0
