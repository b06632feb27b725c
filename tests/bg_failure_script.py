"""A script that saves in the background (``blocking=False``) and then ends, for tests/test_checkpoint_async.py.

``python bg_failure_script.py ROOT HOW``: saves a small model to ROOT/a, then a 1 MB one to ROOT/b.
HOW is ``fail`` (files are limited to 200 KB with ``RLIMIT_FSIZE``: the write raises EFBIG, a real
write failure), ``ok`` (no limit), ``caught`` (``fail``, then ``ak.wait_for_checkpoint()`` raises and
the script catches it), ``reset`` (``fail``, then ``ak.reset_state()`` warns) or ``distributed``
(``fail`` on two processes started by ``@ak.distributed``). Each returns right after.
"""

import resource
import signal
import sys

import torch

import accelkit as ak


def save(root: str, how: str) -> None:
    ak.save_state(f"{root}/a", model=torch.nn.Linear(8, 8), step=1)
    if how != "ok":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit raises OSError(EFBIG) instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    ak.save_state(f"{root}/b", blocking=False, model=torch.nn.Linear(512, 512), step=2)
    if how == "caught":
        try:
            ak.wait_for_checkpoint()
        except ak.CheckpointError as exc:
            print("caught:", str(exc).splitlines()[0])
    elif how == "reset":
        ak.reset_state()


@ak.distributed(num_processes=2, cpu=True)
def save_on_two_processes(root: str) -> None:
    save(root, "fail")


if __name__ == "__main__":
    root, how = sys.argv[1:3]
    if how == "distributed":
        save_on_two_processes(root)
    else:
        save(root, how)
