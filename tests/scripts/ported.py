"""A script ported from Accelerate as users port it: ak.init where Accelerator(...) was, inside the
training function, logging configured under __main__. Prints one line per rank.

    python ported.py decorator N | launch N        (started by @ak.distributed or ak.launch)
    accelkit launch -n N ported.py script           (started by the launcher)
"""

import logging
import sys

import torch

import accelkit as ak

logger = logging.getLogger(__name__)


def train() -> str:
    ak.init(precision="bf16", gradient_accumulation_steps=2)  # was: Accelerator(mixed_precision="bf16", ...)
    ak.prepare(torch.nn.Linear(2, 1))
    with ak.precision():
        inside = (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    st, summed = ak.state(), int(ak.reduce(torch.ones(1)).item())  # reduce sums by default, as Accelerate's
    logger.info("rank %d of %d ready", ak.rank(), ak.world_size())
    line = f"rank={ak.rank()} world={ak.world_size()} precision={st.options.precision} "
    line += f"steps={st.options.gradient_accumulation_steps} autocast={inside} summed={summed}"
    print(line, flush=True)
    return line


decorated = ak.distributed(num_processes=int(sys.argv[2]) if len(sys.argv) > 2 else 2, cpu=True)(train)

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(name)s|%(levelname)s|%(message)s")
    mode = sys.argv[1] if len(sys.argv) > 1 else "script"
    if mode == "decorator":
        print("result", decorated())
    elif mode == "launch":
        print("result", ak.launch(train, num_processes=int(sys.argv[2]), cpu=True))
    else:
        train()
