"""Reference implementations of every graph op (spec/graph.yaml): small, fp32, obviously correct.

They are the oracle every backend is tested against and the `cpu` backend's lowering. An op must
not know which backend or layer calls it; everything it needs arrives as arguments.
"""
