"""Benchmarks: `dsv4gen bench` against transformers on the same weights, prefill scaling, the
engine's speculative decoding, prefill parts, and the server under load.

Must not import the CLI; nothing but the CLI imports this package.
"""
