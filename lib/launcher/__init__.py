"""Starting a tensor/expert-parallel job: one process per rank, the engine replicated on each.

Holds the rank processes (spawned on one host, or started by torchrun on several) and the
command-line flags `dsv4gen run` and the server share. Must not import the server, the porting
tools, the planner, the benchmarks or the CLI.
"""
