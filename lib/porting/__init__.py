"""Porting tools: conformance, the field-bug fault catalogue, TP/EP checks, lowering diffs, op schemas.

Must not import the server, the planner, the benchmarks or the CLI.
"""
