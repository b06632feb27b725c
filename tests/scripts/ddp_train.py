"""A small DDP job for the multi-machine tests: rank 0 writes the trained parameters to $REPORT_DIR/params.pt.

Run by `accelkit launch` (or `python ddp_train.py` under srun), or through `@ak.distributed` with
`decorated NODE_RANK NUM_NODES MASTER_ADDR MASTER_PORT` (the rendezvous backend from the config file). Other arguments:
`steps=N` (default 6), `ckpt=DIR` (save the state after every step, resume from the latest),
`pause=S` (sleep S seconds after each step), `fail` (rank 0 raises after its first step).
"""

import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import accelkit as ak


def _arg(name: str, default: str) -> str:
    return next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith(f"{name}=")), default)


def train() -> None:
    steps, ckpt, pause = int(_arg("steps", "6")), _arg("ckpt", ""), float(_arg("pause", "0"))
    ak.set_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(96, 4, generator=data), torch.randn(96, 1, generator=data))
    # DDP lays its gradient buckets out again after the first step, in the order the gradients came; a
    # resumed run's first step has the first layout, and gloo sums each chunk of a bucket in another rank
    # order: the last bits differ. find_unused_parameters=True keeps one layout: resumes are exact.
    loader = DataLoader(dataset, batch_size=3, shuffle=True)
    model, opt, loader = ak.prepare(model, opt, loader, find_unused_parameters=True)
    step = 0
    latest = ak.latest_checkpoint(ckpt) if ckpt else None
    if latest is not None:
        step = ak.load_state(latest, model=model, optimizer=opt)["step"]
        ak.print(f"resumed from {latest.name} at step {step}", flush=True)
    while step < steps:
        for x, y in loader:
            ak.backward(F.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            step += 1
            if "fail" in sys.argv and ak.rank() == 0:
                raise RuntimeError("rank 0 gave up on purpose")
            if ckpt:
                ak.save_state(os.path.join(ckpt, f"step-{step:03d}"), model=model, optimizer=opt, step=step)
            ak.print(f"step {step}", flush=True)
            time.sleep(pause)
            if step == steps:
                break
    if ak.is_main_process():
        torch.save(ak.unwrap(model).state_dict(), os.path.join(os.environ["REPORT_DIR"], "params.pt"))


if __name__ == "__main__":
    if "decorated" in sys.argv:
        at = sys.argv.index("decorated")
        node_rank, nodes, addr, port = sys.argv[at + 1 : at + 5]
        ak.distributed(
            num_processes=2,
            num_nodes=int(nodes),
            node_rank=int(node_rank),
            master_addr=addr,
            master_port=int(port),
            cpu=True,
        )(train)()
    else:
        train()
