"""The engine: requests, scheduling over the paged cache, sampling, stops, DSpark drafting.

Must not import the launcher, the porting tools, the planner, the server, the benchmarks or the CLI.
"""
