"""Two workers that wait; the test interrupts the launching process once both wrote their pid."""

import os
import sys
import time

import accelkit as ak


def wait(folder: str) -> None:
    with open(os.path.join(folder, f"worker-{ak.rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)


if __name__ == "__main__":
    ak.launch(wait, (sys.argv[1],), num_processes=2, cpu=True)
