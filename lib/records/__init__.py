"""Records the backends and the runtime share: a batch, a sequence's decode state, an EP expert map.

Plain immutable records and the arithmetic that builds them. Must not import any other package
of the project but `spec`.
"""
