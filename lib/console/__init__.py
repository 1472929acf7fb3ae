"""Console progress of long commands: numbered stages on stderr, each with its elapsed seconds.

What a user waiting on `dsv4gen conformance` or `dsv4gen plan --ops` reads while nothing else
prints (lib/console/stages.py). The tools that run long stages (lib/porting, lib/planner) take a
`Stages` from the command line and announce their stages through it; library callers get a quiet one.
Standard library only: must not import anything of the project, so every package may use it.
"""
