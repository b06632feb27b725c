"""Prints this rank's view of the job as JSON (or writes it to $REPORT_DIR/rank<N>.json),
after one all_reduce across the job."""

import json
import os

import torch
import torch.distributed as dist

import accelkit as ak

st = ak.state()
total = torch.tensor([st.rank + 1])
if st.distributed:
    dist.all_reduce(total)
report = json.dumps(
    {
        "rank": st.rank,
        "world_size": st.world_size,
        "local_rank": st.local_rank,
        "local_world_size": st.local_world_size,
        "node_rank": st.node_rank,
        "num_nodes": st.num_nodes,
        "launcher": st.launcher,
        "sum": int(total.item()),
    }
)
if "REPORT_DIR" in os.environ:
    with open(os.path.join(os.environ["REPORT_DIR"], f"rank{st.rank}.json"), "w") as f:
        f.write(report)
else:
    print(report)
