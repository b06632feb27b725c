"""Run by the reliability tests under `accelkit launch`: rank 0 broadcasts while rank 1 gathers.

Both must raise the table (the calls are compared before any data moves), and the job must end promptly.
"""

import torch

import accelkit as ak

if __name__ == "__main__":
    if ak.rank() == 0:
        ak.broadcast(torch.zeros(3))
    else:
        ak.gather(torch.zeros(3))
