"""A complete @ak.distributed program: two CPU workers, one all_reduce, rank 0's result."""

import torch
import torch.distributed as dist

import accelkit as ak


@ak.distributed(num_processes=2, cpu=True)
def total() -> int:
    value = torch.tensor([ak.rank() + 1])
    dist.all_reduce(value)
    return int(value.item())


if __name__ == "__main__":
    print("total", total())
