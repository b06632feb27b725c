"""A script that forgets `if __name__ == "__main__":` around its launch (spawned workers re-run it)."""

import accelkit as ak


@ak.distributed(num_processes=2, cpu=True)
def train() -> int:
    return ak.rank()


print("result", train())
