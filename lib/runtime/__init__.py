"""A loaded model and its forward over decode state: load, step, the paged cache and its step.

Must not know requests, scheduling, sampling or the server.
"""
