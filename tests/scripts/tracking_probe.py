"""Run by `accelkit launch` in the tracking tests: trackers chosen by the command line, one bar per node."""

import sys

import accelkit as ak

ak.init_trackers("probe", {"script": "tracking_probe"})
for step in ak.progress(range(3), desc=f"bar-of-rank{ak.rank()}"):
    ak.log({"loss": 1.0 / (step + 1), "rank": ak.rank()}, step=step)
if "fail" in sys.argv[1:] and ak.rank() == 1:
    raise RuntimeError("rank 1 fails on purpose")
ak.end_training()
