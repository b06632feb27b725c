"""Estimate pi on several processes: each rank throws its share of darts at the unit square.

    python examples/pi.py --darts 2000000

Runs one process per visible GPU, or 2 CPU processes on a machine without one (``--cpu``
and ``--num-processes N`` choose otherwise); under torchrun or another launcher the same
code runs on as many processes as it started.
"""

from __future__ import annotations

import argparse
import logging

import torch

import accelkit as ak

logging.basicConfig(format="%(message)s")  # module level: spawned workers import it too


def estimate_pi(darts: int, seed: int = 0) -> float:
    logger = ak.get_logger("pi", log_level="INFO")
    ak.set_seed(seed, device_specific=True)  # each rank throws different darts
    with ak.split_between_processes(range(darts)) as mine:
        xy = torch.rand(len(mine), 2, device=ak.device())
    hits = (xy.pow(2).sum(dim=1) <= 1).sum()
    logger.info("rank %d: %d of %d darts inside", ak.rank(), hits.item(), len(mine), in_order=True)
    return 4 * ak.reduce(hits, op="sum").item() / darts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--darts", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-processes", type=int, default=None, help="default: one per GPU, else 2 on the CPU")
    parser.add_argument("--cpu", action="store_true", help="run on CPU processes even where GPUs are visible")
    args = parser.parse_args()
    # The process count is chosen at run time, so the decorator is applied here rather than at the def.
    num_processes = args.num_processes or (0 if args.cpu else torch.cuda.device_count()) or 2
    run = ak.distributed(num_processes=num_processes, cpu=args.cpu or None)(estimate_pi)
    ak.print(f"pi is about {run(args.darts, args.seed):.4f}")  # once, also under `accelkit launch`


if __name__ == "__main__":
    main()
