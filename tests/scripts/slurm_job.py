"""A job for `srun -n 2 python slurm_job.py`: SLURM starts the ranks, `@ak.distributed` just runs in each.

Each rank prints one JSON line: its rank and world size as accelkit read them, the launcher it
detected, what a gather of every rank's number returned, its pid and its parent's command.
"""

import json
import os

import torch

import accelkit as ak


@ak.distributed(num_processes=2, cpu=True)
def report() -> dict[str, object]:
    gathered = ak.gather(torch.tensor([ak.rank()]))
    with open(f"/proc/{os.getppid()}/comm") as f:
        parent = f.read().strip()
    return {
        "rank": ak.rank(),
        "world_size": ak.world_size(),
        "launcher": ak.state().launcher,
        "gathered": gathered.tolist(),
        "pid": os.getpid(),
        "parent": parent,
        "launched_by": os.environ.get("ACCELKIT_LAUNCHED_BY"),
    }


if __name__ == "__main__":
    print(json.dumps(report()), flush=True)
