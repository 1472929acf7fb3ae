"""Whether this process is one rank of a job torchrun started, and its place in that job.

torchrun (`python -m torch.distributed.run`) starts every rank itself, on every node, and tells
each where it stands through environment variables: RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (the env:// rendezvous), TORCHELASTIC_RUN_ID and
TORCHELASTIC_RESTART_COUNT. Such a rank must not spawn ranks of its own: it joins the group
torchrun set up (lib/launcher/ranks.py).
"""
from __future__ import annotations

import os
from typing import Mapping, NamedTuple

REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")     # what env:// reads


class TorchrunRank(NamedTuple):
    rank: int
    world: int
    local_rank: int
    local_world: int
    master_addr: str
    master_port: int
    attempt: str            # torchrun's run id and restart count: keys one attempt writes to the store

    @property
    def follower(self) -> bool:
        return self.rank != 0


def environment(env: Mapping[str, str] | None = None) -> TorchrunRank | None:
    """This process's rank when torchrun (or another launcher setting the env:// variables) started
    it; None otherwise. ValueError names what is missing or malformed."""
    env = os.environ if env is None else env
    under_torchrun = "TORCHELASTIC_RUN_ID" in env
    present = [k for k in REQUIRED if env.get(k)]
    if not under_torchrun and len(present) < len(REQUIRED):
        return None
    missing = [k for k in REQUIRED if k not in present]
    if missing:
        raise ValueError(f"started by torchrun (TORCHELASTIC_RUN_ID is set) but {', '.join(missing)} "
                         "not set: cannot join the job's process group")
    numbers = {}
    for key in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        raw = env.get(key)
        if raw is None:
            continue
        try:
            numbers[key] = int(raw)
        except ValueError:
            raise ValueError(f"environment variable {key}='{raw}' is not an integer") from None
    rank, world = numbers["RANK"], numbers["WORLD_SIZE"]
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is not in 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
    attempt = f"{env.get('TORCHELASTIC_RUN_ID', 'none')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return TorchrunRank(rank, world, numbers.get("LOCAL_RANK", rank), numbers.get("LOCAL_WORLD_SIZE", world),
                        env["MASTER_ADDR"], numbers["MASTER_PORT"], attempt)


def check_world(job: TorchrunRank, tp: int, ep: int) -> int:
    """The world size TP x EP needs, or ValueError when torchrun started a different number of ranks."""
    need = max(tp, ep)
    if job.world != need:
        raise ValueError(f"torchrun started WORLD_SIZE={job.world} ranks but TP={tp}, EP={ep} needs max(TP, EP)="
                         f"{need}: launch --nnodes N --nproc-per-node M with N x M = {need}, or change "
                         "--tensor-parallel-size / --expert-parallel-size")
    return need
