"""The command-line flags every entry point that launches an engine shares (vLLM's names), and
the launch spec they make: `dsv4gen run`, `dsv4gen conformance --tp/--ep` and `python -m serve`.
"""
from __future__ import annotations

from pathlib import Path


def add_parallel_arguments(s) -> None:
    """The TP / EP flags `run`, `conformance` and `python -m serve` share (vLLM's names)."""
    s.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, dest="tp",
                   help="tensor-parallel ranks (one process each; heads, groups and vocab are split)")
    s.add_argument("--expert-parallel-size", "--ep", type=int, default=1, dest="ep",
                   help="expert-parallel ranks (routed experts split by index)")
    s.add_argument("--ep-dispatch", choices=["allgather", "alltoall"],
                   help="EP token exchange (default: the backend profile's)")


def launch_spec(args, path, engine_config):
    from lib.launcher.ranks import LaunchSpec
    from lib.runtime.loaded_model import backend_facts

    dispatch = args.ep_dispatch or backend_facts(args.backend).ep_dispatch
    return LaunchSpec(Path(path), args.backend, args.load_options(args), engine_config, args.tp, args.ep, dispatch)
