"""`dsv4gen plan`: memory and speed of a deployment, and launch counts per decode step.

Must not import the server, the porting tools, the benchmarks or the CLI.
"""
