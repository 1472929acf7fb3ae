"""Starting a tensor/expert-parallel job: one process per rank, the engine replicated on every rank.

The calling process is rank 0: it spawns ranks 1..W-1 (fresh interpreters, `spawn`: nothing is
inherited from a forked parent, B11), every rank joins the process group before reading a weight
(L17), binds itself to its NUMA node where the machine has several (L20), and loads its own
shard. Rank 0's engine takes requests; each `step()` first broadcasts the commands received since
the last step (add, abort, release), so every rank's engine holds the same requests and makes the
same scheduling, drafting and sampling decisions (a request without a seed gets one chosen on rank 0; whether a
step drafts, which depends on rank 0's timings, is sent along: lib/engine/draft_policy.py), and
the generated code's collectives line up. A worker that dies is noticed by a monitor thread.

Under torchrun (several hosts: lib/launcher/torchrun.py) nothing is spawned: torchrun started every
rank, each joins the group through env://, rank 0 gets the ReplicatedEngine and every other rank
follows it, then exits. Rank 0 cannot see another host's processes, so there the monitor reads the
followers' heartbeat counters in the job's store instead (lib/launcher/heartbeat.py).
"""
from __future__ import annotations

import itertools
import multiprocessing
import os
import random
import socket
import threading
from pathlib import Path
from typing import Callable, NamedTuple

import msgspec

from lib.distributed import process_group as parallel
from lib.launcher import torchrun

JOIN_TIMEOUT_S = 600.0      # torchrun ranks: how long rank 0 waits for ranks it cannot see to join
LEAVE_TIMEOUT_S = 10.0      # ... and for them to leave after "stop"


class LaunchSpec(NamedTuple):
    model_path: Path
    backend: str
    load_options: object            # lib.weights.params.LoadOptions
    engine_config: object           # lib.engine.llm_engine.EngineConfig
    tp: int = 1
    ep: int = 1
    ep_dispatch: str = "allgather"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bind_numa(rank: int) -> str | None:
    """Pin this process to the CPUs of NUMA node rank % nodes (L20); None where there is one node."""
    root = Path("/sys/devices/system/node")
    nodes = sorted(p for p in root.glob("node[0-9]*")) if root.is_dir() else []
    if len(nodes) < 2 or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = set()
    for part in (nodes[rank % len(nodes)] / "cpulist").read_text().strip().split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    os.sched_setaffinity(0, cpus)
    return nodes[rank % len(nodes)].name


def _build(spec: LaunchSpec, rank: int, world: int, init_method: str, progress: bool, peers_gone=None):
    parallel.init_process_group(rank, world, init_method, peers_gone=peers_gone)   # before any weight (L17)
    bind_numa(rank)
    return _load(spec, progress)


def _load(spec: LaunchSpec, progress: bool):
    """This rank's shard and engine, once it is in the process group."""
    from lib.engine.llm_engine import Engine
    from lib.runtime.loaded_model import load_model
    from lib.text.tokenizer import Tokenizer

    par = parallel.live(spec.tp, spec.ep, spec.ep_dispatch)        # this process's rank, read now (B11)
    model = load_model(spec.model_path, backend=spec.backend, progress=progress, options=spec.load_options,
                       parallel=par)
    return Engine(model, spec.engine_config, tokenizer=Tokenizer.from_dir(spec.model_path))


def _worker(spec: LaunchSpec, rank: int, world: int, init_method: str) -> None:
    import torch

    # W ranks share this host's cores: one rank's intra-op pool must not take them all (on a device
    # the host threads only launch kernels)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    engine = _build(spec, rank, world, init_method, progress=False)
    follow(engine)


def follow(engine) -> None:
    """A worker rank's loop: apply rank 0's commands, step, until told to stop."""
    import torch.distributed as dist

    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        for command in box[0]:
            kind, *args = command
            if kind == "stop":
                return
            getattr(engine, kind)(*args)
        engine.step()


def _first_exit(workers: list) -> str | None:
    """Which worker process (rank 1 first) has exited, and how; None while all run."""
    for rank, proc in enumerate(workers, start=1):
        if not proc.is_alive():
            return f"worker rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
    return None


class ReplicatedEngine:
    """Rank 0's engine: the Engine interface, with every command replayed on the other ranks."""

    def __init__(self, engine, workers: list, on_close: Callable[[], None],
                 liveness: Callable[[], str | None] | None = None):
        """`workers`: the rank processes this process spawned; `liveness()`: why a rank it cannot see
        is gone, or None (torchrun ranks on other hosts)."""
        self.engine, self.workers, self._on_close, self._liveness = engine, workers, on_close, liveness
        self._pending: list[tuple] = []
        self._closed = False

    def __getattr__(self, name):                 # read-only state: requests, store, scheduler, counters...
        return getattr(self.engine, name)

    def add_request(self, prompt, params, request_id=None) -> str:
        if params.seed is None:                  # every rank must draw the same random numbers
            params = msgspec.structs.replace(params, seed=random.getrandbits(63))
        rid = self.engine.add_request(prompt, params, request_id)   # checks happen here, once
        self._pending.append(("add_request", list(prompt), params, rid))
        return rid

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._pending.append(("abort", request_id))

    def release(self, request_id: str) -> None:
        self.engine.release(request_id)
        self._pending.append(("release", request_id))

    def step(self):
        import torch.distributed as dist

        gate = self.engine.policy.draft_this_step()    # rank 0's timings decide whether every rank drafts
        self.engine.hold_gate(gate)
        box, self._pending = [self._pending + [("hold_gate", gate)]], []
        dist.broadcast_object_list(box, src=0)
        return self.engine.step()

    def generate(self, prompts, params):
        ids = [self.add_request(p, params) for p in prompts]
        while self.engine.has_unfinished():
            self.step()
        return [self.engine.requests[i] for i in ids]

    def dead_worker(self) -> str | None:
        if self._closed:                         # the ranks were stopped on purpose
            return None
        return _first_exit(self.workers) or (self._liveness() if self._liveness is not None else None)

    def close(self) -> None:
        """Stop the workers (they leave their loop), then make sure they are gone."""
        import torch.distributed as dist

        try:
            if self.dead_worker() is None:
                dist.broadcast_object_list([[("stop",)]], src=0)
        finally:
            self._closed = True
            for proc in self.workers:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
            self._on_close()


def launch(spec: LaunchSpec, progress: bool = True, follower_returns: bool = False):
    """The engine for `spec`: a plain Engine in one process, else a ReplicatedEngine over W processes.

    Under torchrun with more than one rank, only rank 0 returns the ReplicatedEngine: every other
    rank follows it until it stops the job, then exits the process (SystemExit(0)), so an entry
    point never reaches its own work (serving HTTP, printing) there; with `follower_returns` it
    returns None instead, so a command that runs several jobs in turn (conformance) goes on to the
    next one on every rank."""
    world = max(spec.tp, spec.ep)
    job = torchrun.environment()
    if job is not None and max(world, job.world) > 1:
        return _launch_torchrun(spec, job, progress, follower_returns)
    if world == 1:
        return local_engine(spec, progress)
    from lib.weights.checkpoint import Checkpoint

    parallel.check_sizes(Checkpoint(spec.model_path).config, spec.tp, spec.ep)   # fail before spawning
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=_worker, args=(spec, rank, world, init_method), daemon=True,
                           name=f"dsv4gen-rank{rank}") for rank in range(1, world)]
    for proc in workers:
        proc.start()
    try:
        engine = _build(spec, 0, world, init_method, progress, peers_gone=lambda: _first_exit(workers))
    except BaseException:
        import torch.distributed as dist
        for proc in workers:
            proc.kill()
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    import torch.distributed as dist

    return ReplicatedEngine(engine, workers, on_close=dist.destroy_process_group)


def local_engine(spec: LaunchSpec, progress: bool = True):
    """An Engine of `spec` in this process alone (one rank), even inside a torchrun job."""
    from lib.engine.llm_engine import Engine
    from lib.runtime.loaded_model import load_model
    from lib.text.tokenizer import Tokenizer

    model = load_model(spec.model_path, backend=spec.backend, progress=progress, options=spec.load_options)
    return Engine(model, spec.engine_config, tokenizer=Tokenizer.from_dir(spec.model_path))


_jobs = itertools.count()    # torchrun jobs this process has joined: every rank runs the same ones, in turn


def _launch_torchrun(spec: LaunchSpec, job: torchrun.TorchrunRank, progress: bool, follower_returns: bool = False):
    """Join the group torchrun set up and load this rank's shard; rank 0 returns its engine. Each
    job of the process gets its own scope in the store (group arrival, heartbeats)."""
    import torch
    import torch.distributed as dist

    from lib.launcher import heartbeat
    from lib.weights.checkpoint import Checkpoint

    world = torchrun.check_world(job, spec.tp, spec.ep)              # fail before the rendezvous, on every rank
    parallel.check_sizes(Checkpoint(spec.model_path).config, spec.tp, spec.ep)
    if "OMP_NUM_THREADS" not in os.environ:      # this node's ranks share its cores (as spawned workers do)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // job.local_world))
    scope = f"{job.attempt}/job{next(_jobs)}"
    parallel.init_process_group(job.rank, world, "env://", join_timeout=JOIN_TIMEOUT_S,
                                scope=scope)                         # before any weight (L17)
    bind_numa(job.local_rank)
    if job.follower:
        beat = heartbeat.Beat(job.master_addr, job.master_port, job.rank, scope)
        try:
            follow(_load(spec, progress=False))
        finally:
            beat.stop()
            dist.destroy_process_group()
        beat.leave()                             # rank 0 tears its side down only after this (heartbeat.py)
        if follower_returns:
            return None
        raise SystemExit(0)
    watcher = heartbeat.Watcher(job.master_addr, job.master_port, range(1, world), scope)
    try:
        engine = _load(spec, progress)
    except BaseException:
        dist.destroy_process_group()
        raise

    def close() -> None:
        watcher.wait_left(LEAVE_TIMEOUT_S)
        dist.destroy_process_group()
    return ReplicatedEngine(engine, [], on_close=close, liveness=watcher.dead)


def watch(engine, on_death: Callable[[str], None], period: float = 0.5) -> threading.Thread | None:
    """Call `on_death(reason)` once if a worker process of `engine` dies, or (torchrun) a rank's
    heartbeat stops, so a server turns unhealthy even while idle (a busy one also sees its next
    collective fail, where the lost peer's connection resets)."""
    if not isinstance(engine, ReplicatedEngine):
        return None
    stop = threading.Event()

    def loop():
        while not stop.wait(period):
            reason = engine.dead_worker()
            if reason:
                on_death(reason)
                return
    thread = threading.Thread(target=loop, name="dsv4gen-worker-monitor", daemon=True)
    thread.start()
    return thread
