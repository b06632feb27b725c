"""Run by `accelkit launch` in the tests: one all_reduce, then each rank writes what it saw
to $REPORT_DIR/rank<N>.json. Arguments it acts on: `fail=K` (rank K raises ValueError),
`segv=K` (rank K dies from SIGSEGV),
`init=MODE` (calls ak.init(precision=MODE)), `sleep` (waits to be interrupted)."""

import ctypes
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import accelkit as ak


def main() -> None:
    for arg in sys.argv[1:]:
        if arg.startswith("init="):
            ak.init(precision=arg[5:])
    st = ak.state()
    total = torch.tensor([st.rank + 1])
    if st.distributed:
        dist.all_reduce(total)
    report = {
        "rank": st.rank,
        "world_size": st.world_size,
        "local_rank": st.local_rank,
        "node_rank": st.node_rank,
        "launcher": st.launcher,
        "precision": st.options.precision,
        "debug": st.options.debug,
        "cpu": st.options.cpu,
        "sum": int(total.item()),
        "argv": sys.argv,
        "name": __name__,
        "path0": sys.path[0],
        "pid": os.getpid(),
        "threads": os.environ.get("OMP_NUM_THREADS"),
    }
    path = os.path.join(os.environ["REPORT_DIR"], f"rank{st.rank}.json")
    with open(f"{path}.tmp", "w") as f:  # whole or not at all: a test may read it while this rank sleeps
        json.dump(report, f)
    os.replace(f"{path}.tmp", path)
    if f"fail={st.rank}" in sys.argv:
        raise ValueError(f"bad batch on rank {st.rank}")
    if f"segv={st.rank}" in sys.argv:
        ctypes.string_at(0)  # reads address 0: what a crash in an extension looks like
    if "sleep" in sys.argv:
        time.sleep(600)


if __name__ == "__main__":
    main()
