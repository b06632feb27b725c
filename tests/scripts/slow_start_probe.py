"""Run by the reliability tests: @ak.distributed whose spawned workers are slow to start.

Each worker's import of this file (as ``__mp_main__``) writes its pid to $REPORT_DIR, then sleeps,
as a slow ``import torch`` on a busy machine would: the launcher is killed meanwhile, before any
worker runs accelkit's code.
"""

import os
import time

if __name__ == "__mp_main__":
    with open(os.path.join(os.environ["REPORT_DIR"], f"starting-{os.getpid()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)

import accelkit as ak


@ak.distributed(num_processes=2, cpu=True)
def main() -> None:
    time.sleep(600)


if __name__ == "__main__":
    main()
