"""The `dsv4gen` command line: argument parsing and dispatch to the packages below.

Nothing imports this package.
"""
