"""A tiny training job for the clean-exit tests, written as scripts are: the prepared DDP model is a
module global. One step, one reduce, then a normal interpreter exit. `--user-group`: the script
forms the process group itself (accelkit adopts it); `--distributed`: @ak.distributed starts the
workers; `--no-ddp`: only the reduce."""

import sys

import torch
import torch.distributed as dist

import accelkit as ak


def step() -> int:
    global model
    if "--no-ddp" not in sys.argv:
        model = ak.prepare(torch.nn.Linear(4, 1))
        ak.backward(model(torch.ones(2, 4)).sum())
    return int(ak.reduce(torch.tensor([ak.rank() + 1.0]), op="sum").item())


@ak.distributed(num_processes=2, cpu=True)
def distributed_step() -> int:
    return step()


if __name__ == "__main__":
    if "--distributed" in sys.argv:
        print("total", distributed_step())
    else:
        if "--user-group" in sys.argv:
            dist.init_process_group("gloo")
        total = step()
        ak.print("total", total)  # once, from rank 0: the ranks' lines would interleave
