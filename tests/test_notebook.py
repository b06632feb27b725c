"""ak.launch from a notebook: the fork path, its refusals, and real Jupyter kernels (nbclient)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import accelkit as ak
from accelkit.testing import free_port

pytestmark = pytest.mark.distributed

EXAMPLE = Path(__file__).parent.parent / "examples" / "notebook.ipynb"


# --- the fork path, in this process ------------------------------------------------------------


@pytest.mark.smoke
def test_every_option_reaches_forked_workers() -> None:
    def seen() -> dict[str, Any]:  # a closure: only fork can run it, as in a notebook
        st = ak.state()
        return {
            "world": (ak.rank(), ak.world_size(), st.num_nodes, st.node_rank),
            "options": (st.options.precision, st.options.gradient_accumulation_steps, st.options.debug),
            "device": (st.options.cpu, str(ak.device()), st.backend, dist.get_backend()),
            "timeout": st.options.timeout,
            "master": os.environ["MASTER_ADDR"],
        }

    got = ak.launch(
        seen,
        num_processes=2,
        precision="bf16",
        gradient_accumulation_steps=3,
        debug=True,
        cpu=True,
        backend="gloo",
        timeout=42,
        master_addr="localhost",
        start_method="fork",
    )
    assert got == {
        "world": (0, 2, 1, 0),
        "options": ("bf16", 3, True),
        "device": (True, "cpu", "gloo", "gloo"),
        "timeout": 42.0,
        "master": "localhost",
    }


def test_max_restarts_restarts_forked_workers() -> None:
    def crash_once() -> int:
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        if attempt == 0 and ak.rank() == 1:
            raise RuntimeError("transient failure")
        ak.wait_for_everyone()
        return attempt

    assert ak.launch(crash_once, num_processes=2, cpu=True, max_restarts=1, start_method="fork") == 1


def test_two_nodes_meet_at_master_port() -> None:
    port = free_port()
    node1 = f"""
        import accelkit as ak
        def where():
            print("node1 worker:", ak.rank(), ak.world_size(), ak.state().node_rank, flush=True)
        ak.launch(where, num_processes=1, num_nodes=2, node_rank=1, master_addr="127.0.0.1", master_port={port},
                  cpu=True)
    """
    other = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(node1)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:

        def where() -> tuple[int, int, int]:
            return ak.rank(), ak.world_size(), ak.state().node_rank

        got = ak.launch(
            where,
            num_processes=1,
            num_nodes=2,
            node_rank=0,
            master_addr="127.0.0.1",
            master_port=port,
            cpu=True,
            start_method="fork",
        )
        out, _ = other.communicate(timeout=60)
    finally:
        if other.poll() is None:
            other.kill()
            other.communicate()
    assert got == (0, 2, 0)
    assert other.returncode == 0, out
    assert "node1 worker: 1 2 1" in out


def test_debug_mode_runs_a_preflight_launch_first(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ACCELKIT_DEBUG", "1")
    assert ak.launch(ak.world_size, num_processes=2, cpu=True, start_method="fork") == 2
    assert "pre-flight launch OK (2 processes formed a group and met at a barrier)" in capfd.readouterr().err


def test_refuses_to_fork_when_cuda_is_initialised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setitem(sys.modules, "bitsandbytes", sys.modules["os"])  # a library known to initialise CUDA
    with pytest.raises(ak.StateError) as err:
        ak.launch(ak.rank, num_processes=2, start_method="fork")
    message = str(err.value)
    assert message.startswith("accelkit.launch cannot fork 2 worker processes: CUDA was already initialised")
    assert "(likely by bitsandbytes)" in message
    assert "Restart the kernel" in message and "inside the launched function" in message
    assert "GPU" not in message


def test_cuda_refusal_without_a_known_culprit_says_where_to_look(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    for name in ("bitsandbytes", "deepspeed", "apex", "xformers", "flash_attn", "vllm", "cupy", "pycuda", "jax"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ak.StateError, match=r"by a cell run earlier: \.cuda\(\), \.to\('cuda'\)"):
        ak.launch(ak.rank, num_processes=2, cpu=True, start_method="fork")


def test_refuses_to_fork_with_a_process_group() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ak.state()  # accelkit adopts the user's group
        with pytest.raises(ak.StateError) as err:
            ak.launch(ak.rank, num_processes=2, cpu=True, start_method="fork")
    finally:
        ak.reset_state()
        dist.destroy_process_group()
    message = str(err.value)
    assert message.startswith("accelkit.launch cannot fork 2 worker processes: a torch.distributed process group")
    assert "accelkit's state in this process (rank 0 of 1, created at " in message
    assert "destroy_process_group() and ak.reset_state() first, or restart the kernel" in message


def test_a_world_one_state_is_reset_before_forking() -> None:
    ak.init(cpu=True, precision="fp16")
    # The workers start afresh, with the options this process set (they reach them, as any launch's).
    assert ak.launch(lambda: ak.state().options.precision, num_processes=2, cpu=True, start_method="fork") == "fp16"
    assert not ak.is_initialized()


# --- real Jupyter kernels ------------------------------------------------------------------------


class _TimedClient:
    """Runs a notebook in a fresh kernel; records when each stream output arrived."""

    def __init__(self, nb: Any, path: Path) -> None:
        nbclient = pytest.importorskip("nbclient")

        arrivals: list[tuple[float, int, str]] = []

        class Client(nbclient.NotebookClient):  # type: ignore[misc]
            def process_message(self, msg: dict[str, Any], cell: Any, cell_index: int) -> Any:
                if msg["msg_type"] == "stream":
                    arrivals.append((time.monotonic(), cell_index, msg["content"]["text"]))
                return super().process_message(msg, cell, cell_index)

        self.arrivals = arrivals
        self.client = Client(
            nb, timeout=120, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(path)}}
        )

    def run(self) -> None:
        self.client.execute()


def _stdout(cell: Any) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o["output_type"] == "stream")


@pytest.fixture
def notebook_tools() -> Any:
    pytest.importorskip("ipykernel")
    pytest.importorskip("nbclient")
    return pytest.importorskip("nbformat")


@pytest.mark.smoke
@pytest.mark.slow
def test_example_notebook_trains_on_two_processes(notebook_tools: Any, tmp_path: Path) -> None:
    nb = notebook_tools.read(EXAMPLE, as_version=4)
    _TimedClient(nb, tmp_path).run()
    out = _stdout(nb.cells[-1])
    epochs = re.findall(r"epoch (\d): test accuracy ([\d.]+) on 360 samples \(2 processes\)", out)
    assert [e for e, _ in epochs] == ["1", "2", "3", "4"], out  # printed once: rank 0 only
    final = float(re.search(r"final test accuracy \(rank 0\): ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    assert final == float(epochs[-1][1]) > 0.85
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o["output_type"] == "error"]


FAILURE_CELLS = [
    """
    import os, sys, time
    import accelkit as ak

    def fail_on_rank_one():
        ak.wait_for_everyone()
        if ak.rank() == 1:
            raise ValueError("bad batch on rank 1")
        ak.wait_for_everyone()  # rank 0 waits for a peer that is gone
    """,
    "ak.launch(fail_on_rank_one, num_processes=2, cpu=True)",
    """
    def alive_children():
        kids = set()
        for task in os.listdir(f"/proc/{os.getpid()}/task"):
            with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
                kids.update(f.read().split())
        return sorted(k for k in kids if open(f"/proc/{k}/stat").read().split(") ")[-1][0] != "Z")
    print("children after the failure:", alive_children())
    """,
    """
    def chatty(n):
        print(f"rank {ak.rank()} says hello", flush=True)
        time.sleep(3)
        print(f"rank {ak.rank()} is done")
        return n + ak.world_size()
    print("second launch:", ak.launch(chatty, (40,), num_processes=2, cpu=True))
    print("children after the second launch:", alive_children())
    """,
    """
    import torch
    torch.cuda.is_initialized = lambda: True  # as if a cell had touched the GPU
    ak.launch(chatty, (0,), num_processes=2, cpu=True)
    """,
]


def test_failure_notebook_reports_the_rank_then_launches_again(notebook_tools: Any, tmp_path: Path) -> None:
    v4 = notebook_tools.v4
    nb = v4.new_notebook(cells=[v4.new_code_cell(textwrap.dedent(src).strip()) for src in FAILURE_CELLS])
    client = _TimedClient(nb, tmp_path)
    client.run()
    failed, children, second, cuda = nb.cells[1], nb.cells[2], nb.cells[3], nb.cells[4]

    (error,) = [o for o in failed.outputs if o["output_type"] == "error"]
    assert error["ename"] == "WorkerError"
    assert error["evalue"].startswith("rank 1 failed: ValueError: bad batch on rank 1")
    assert 'raise ValueError("bad batch on rank 1")' in error["evalue"]  # the worker's traceback
    timing = failed.metadata["execution"]
    took = _seconds(timing["shell.execute_reply"]) - _seconds(timing["iopub.execute_input"])
    assert took < 30, f"the failure took {took:.1f} s to reach the cell"

    assert "children after the failure: []" in _stdout(children)  # no orphans
    out = _stdout(second)
    assert "second launch: 42" in out  # rank 0's value, after a failure in the same kernel
    for rank in (0, 1):
        assert f"rank {rank} says hello\n" in out and f"rank {rank} is done\n" in out  # whole lines
    assert "children after the second launch: []" in out
    # Streamed while the workers ran: "hello" arrived seconds before the launch returned.
    hello = min(t for t, i, text in client.arrivals if i == 3 and "says hello" in text)
    returned = min(t for t, i, text in client.arrivals if i == 3 and "second launch" in text)
    assert returned - hello > 2

    (refusal,) = [o for o in cuda.outputs if o["output_type"] == "error"]
    assert refusal["ename"] == "StateError"
    assert "CUDA was already initialised in this process" in refusal["evalue"]
    assert "Restart the kernel" in refusal["evalue"]


def _seconds(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
