"""Run by the reliability tests: each rank writes its pid and its DataLoader worker's pid to
$REPORT_DIR, then waits to be stopped (rank 0 in a barrier that rank 1 never reaches).

`python lifeline_probe.py` under a launcher; `python lifeline_probe.py --distributed` starts the
two workers itself with @ak.distributed.
"""

import json
import os
import sys
import time

import torch

import accelkit as ak


class Pids(torch.utils.data.Dataset[torch.Tensor]):
    """Each DataLoader worker that loads an item records its pid."""

    def __len__(self) -> int:
        return 1000

    def __getitem__(self, index: int) -> torch.Tensor:
        path = os.path.join(os.environ["REPORT_DIR"], f"loader-{os.getpid()}.pid")
        if not os.path.exists(path):
            report(path, str(os.getpid()))
        return torch.tensor([index])


def report(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole: the test reads the file as soon as it appears."""
    with open(f"{path}.tmp", "w") as f:
        f.write(text)
    os.replace(f"{path}.tmp", path)


def main() -> None:
    st = ak.state()
    loader = ak.prepare(torch.utils.data.DataLoader(Pids(), batch_size=2, num_workers=1))
    batches = iter(loader)
    next(batches)  # the DataLoader worker is running now (and stays, with `batches`)
    pids = json.dumps({"rank": st.rank, "pid": os.getpid()})
    report(os.path.join(os.environ["REPORT_DIR"], f"rank{st.rank}.json"), pids)
    if st.rank == 0:
        ak.wait_for_everyone()  # never reached by rank 1: rank 0 blocks in a collective
    time.sleep(600)


@ak.distributed(num_processes=2, cpu=True)
def distributed_main() -> None:
    main()


if __name__ == "__main__":
    if "--distributed" in sys.argv:
        distributed_main()
    else:
        main()
