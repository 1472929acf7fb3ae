"""Multi-node launch with torchrun, as two "nodes" on this host (two torchrun agents over loopback,
gloo): rank 0 serves HTTP and rank 1 only follows; the answers equal one process's; a stop reaches
both nodes; losing node 1 turns /health 503 within 5 s and ends the in-flight request with an error.

torchrun starts each worker in a session of its own, so "node 1's processes" are its agent and the
agent's workers, each killed through its own process group.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from serve_util import MODEL, running_server

ROOT = Path(__file__).resolve().parents[2]
STARTUP_S = 300             # two interpreters importing torch and loading on 2 busy cores


def _serving_requests():
    """The serving tests' client calls (tests/serve/test_serve_parallel.py), loaded by path: test
    folders are not packages."""
    path = ROOT / "tests" / "serve" / "test_serve_parallel.py"
    spec = importlib.util.spec_from_file_location("_serve_parallel_requests", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._answers


_answers = _serving_requests()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:                   # field 4, ppid
                found.append(int(stat.parent.name))
    return found


class Node:
    """One torchrun agent (its own session) and the workers it started (each in its own session)."""

    def __init__(self, rank: int, master_port: int, program: list[str], log: Path):
        self.rank, self.log = rank, log
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(master_port),
                   *program]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        with open(log, "wb") as out, open(log.with_suffix(".err"), "wb") as err:
            self.agent = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=err,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        self.workers: list[int] = []

    def find_workers(self) -> list[int]:
        self.workers = sorted(set(self.workers) | set(_children(self.agent.pid)))
        return self.workers

    def stdout(self) -> str:
        return self.log.read_text(errors="replace")

    def stderr(self) -> str:
        return self.log.with_suffix(".err").read_text(errors="replace")

    def text(self) -> str:
        return self.stdout() + self.stderr()

    def signal(self, sig: int) -> None:
        """`sig` to the agent's and every worker's process group: the whole node."""
        if self.agent.poll() is None:
            self.find_workers()
        for pid in (self.agent.pid, *self.workers):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)                     # each is its session's (and group's) leader

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.agent.wait(timeout=30)


class Server:
    def __init__(self, url: str):
        self.url = url

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@contextlib.contextmanager
def two_nodes(model: Path, tmp_path: Path):
    """Node 0 and node 1 of a TP=2 job; yields (node0, node1, server) once rank 0 listens."""
    master, http = _free_port(), _free_port()
    nodes = []
    try:
        program = ["-m", "serve", "--model", str(model), "--tensor-parallel-size", "2", "--port", str(http),
                   "--served-model-name", MODEL, "--max-num-seqs", "4"]
        for rank in (0, 1):
            nodes.append(Node(rank, master, program, tmp_path / f"node{rank}.log"))
        url = f"http://127.0.0.1:{http}"
        end = time.monotonic() + STARTUP_S
        while "listening on" not in nodes[0].text():
            for node in nodes:
                assert node.agent.poll() is None, f"node {node.rank} exited early:\n{node.text()[-3000:]}"
            assert time.monotonic() < end, f"rank 0 did not listen within {STARTUP_S} s:\n{nodes[0].text()[-3000:]}"
            time.sleep(0.2)
        assert f"listening on {url}" in nodes[0].text()
        for node in nodes:
            assert node.find_workers(), f"node {node.rank} has no worker process"
        yield nodes[0], nodes[1], Server(url)
    finally:
        for node in nodes:
            node.kill()


@pytest.fixture(scope="module")
def single_answers(tiny_ckpt):
    with running_server(tiny_ckpt) as server:
        return _answers(server)


def test_two_nodes_answer_like_one_process_and_stop_together(tiny_ckpt, single_answers, tmp_path):
    with two_nodes(tiny_ckpt, tmp_path) as (node0, node1, server):
        assert _answers(server) == single_answers
        assert "listening on" not in node1.text()         # rank 1 only follows: it never binds the port
        assert httpx.get(server.url + "/health").status_code == 200
        os.kill(node0.workers[0], signal.SIGTERM)          # rank 0 shuts down and stops rank 1
        for node in (node0, node1):
            assert node.agent.wait(timeout=120) == 0, f"node {node.rank}:\n{node.text()[-3000:]}"
        assert "server stopped" in node0.text()


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_losing_node_1_makes_health_503_within_5_s_and_ends_requests(tiny_ckpt, tmp_path, how):
    """SIGKILL: the node's processes are gone (their sockets reset). SIGSTOP: a silent node, like
    one whose power or network is lost (no reset reaches rank 0): only the heartbeat tells."""
    with two_nodes(tiny_ckpt, tmp_path) as (_, node1, server):
        assert httpx.get(server.url + "/health").status_code == 200
        stream = server.client().completions.create(model=MODEL, prompt="go on", max_tokens=3000, stream=True,
                                                    temperature=0, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        node1.signal(getattr(signal, how))
        lost = time.monotonic()
        while (health := httpx.get(server.url + "/health", timeout=5)).status_code == 200:
            assert time.monotonic() - lost < 5, f"/health still 200 five seconds after node 1 was lost ({how})"
            time.sleep(0.1)
        assert health.status_code == 503
        if how == "SIGSTOP":
            assert "rank 1 sent no heartbeat" in health.json()["error"]["message"]
        with pytest.raises(openai.APIError):
            for _ in chunks:                               # the stream ends with an error event, it does not hang
                assert time.monotonic() - lost < 30
        with pytest.raises(openai.InternalServerError):
            server.client().completions.create(model=MODEL, prompt="hi", max_tokens=4)


def test_the_torchrun_environment_is_read_only_under_torchrun():
    from lib.launcher.torchrun import environment

    assert environment({}) is None
    assert environment({"RANK": "1"}) is None                 # a stray variable is not a job
    job = environment({"RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8",
                       "MASTER_ADDR": "node0", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job7",
                       "TORCHELASTIC_RESTART_COUNT": "0"})
    assert (job.rank, job.world, job.local_rank, job.local_world, job.master_addr, job.master_port) == \
        (3, 16, 3, 8, "node0", 29500)
    assert job.follower and job.attempt == "job7/0"
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT not set"):
        environment({"TORCHELASTIC_RUN_ID": "job7", "RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="RANK=2 is not in 0..WORLD_SIZE-1"):
        environment({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"})


def test_a_world_size_that_is_not_tp_x_ep_is_refused_before_the_rendezvous(tiny_ckpt, monkeypatch, capsys):
    """torchrun started one rank where TP=2 needs two: every rank says so and exits 2 instead of
    waiting in the rendezvous."""
    from serve.cli import main

    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port()), "TORCHELASTIC_RUN_ID": "none"}.items():
        monkeypatch.setenv(key, value)
    assert main(["--model", str(tiny_ckpt), "--tensor-parallel-size", "2", "--port", "0"]) == 2
    assert "torchrun started WORLD_SIZE=1 ranks but TP=2, EP=1 needs max(TP, EP)=2" in capsys.readouterr().err


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_follower_exits_when_node_0_goes_silent(tiny_ckpt, tmp_path):
    """Node 0 stopped (SIGSTOP: no reset reaches node 1): rank 1's heartbeat to the store on node 0
    times out, and rank 1 exits instead of waiting in its broadcast for the group's timeout."""
    from lib.launcher.heartbeat import LOST_S

    with two_nodes(tiny_ckpt, tmp_path) as (node0, node1, _):
        node0.signal(signal.SIGSTOP)
        stopped = time.monotonic()
        while _running(node1.workers[0]):
            assert time.monotonic() - stopped < LOST_S + 20, "rank 1 still runs"
            time.sleep(0.2)
        print(f"rank 1 exited {time.monotonic() - stopped:.1f} s after node 0 went silent")
        assert "rank 0's node is gone, exiting" in node1.text()


def test_dsv4gen_run_on_two_nodes_prints_once_what_one_process_prints(tiny_ckpt, tmp_path, capsys):
    from lib.cli.main import main as dsv4gen

    script = Path(sys.executable).parent / "dsv4gen"
    if not script.is_file():
        pytest.skip("the dsv4gen console script is not installed (pip install -e .)")
    flags = ["run", "--model", str(tiny_ckpt), "--prompt", "Hello", "--max-tokens", "12"]
    assert dsv4gen(flags) == 0
    single = capsys.readouterr().out
    master, nodes = _free_port(), []
    try:
        for rank in (0, 1):
            nodes.append(Node(rank, master, ["--no-python", str(script), *flags, "--tp", "2"],
                              tmp_path / f"node{rank}.log"))
        codes = [node.agent.wait(timeout=STARTUP_S) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert codes == [0, 0], nodes[0].text()[-3000:] + nodes[1].text()[-3000:]
    assert nodes[0].stdout() == single and nodes[1].stdout() == ""
    assert "[run cpu] loading" in nodes[0].stderr() and "[run cpu]" not in nodes[1].stderr()   # rank 1 says nothing


def test_dsv4gen_conformance_on_two_nodes_checks_tp2_against_one_process(tiny_ckpt, tmp_path):
    """conformance --tensor-parallel-size 2 under torchrun: rank 0 decodes the one-process reference and
    reports; both ranks take part in one TP job per speculative mode (two jobs in one torchrun run)."""
    script = Path(sys.executable).parent / "dsv4gen"
    if not script.is_file():
        pytest.skip("the dsv4gen console script is not installed (pip install -e .)")
    flags = ["conformance", "--backend", "hip936", "--model", str(tiny_ckpt), "--tp", "2", "--steps", "6"]
    master, nodes = _free_port(), []
    try:
        for rank in (0, 1):
            nodes.append(Node(rank, master, ["--no-python", str(script), *flags], tmp_path / f"node{rank}.log"))
        codes = [node.agent.wait(timeout=STARTUP_S) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert codes == [0, 0], nodes[0].text()[-3000:] + nodes[1].text()[-3000:]
    lines = nodes[0].stdout().splitlines()
    assert lines[-1] == "PASS" and nodes[1].stdout() == ""
    assert [line for line in lines if "greedy tokens vs one process" in line] == [
        "TP=2 EP=1 alltoall (none): 18 greedy tokens vs one process: identical",
        "TP=2 EP=1 alltoall (dspark): 18 greedy tokens vs one process: identical"]
    assert "2 ranks in torchrun's processes" in nodes[0].stderr()
