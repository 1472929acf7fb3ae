"""Task accuracy: the checkable task mix (tasks.py, names.py), exact-match scoring (scoring.py) and its run through the
engine (suite.py), which `dsv4gen eval` prints and conformance compares across backends."""
