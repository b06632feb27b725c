"""Launch time: a complete 2-process CPU job doing one all_reduce, torchrun vs accelkit.

Five commands, each a full job from process start to exit, timed by wall clock (and by
the CPU time of the whole process tree, which is less sensitive to a busy machine):
torchrun (``python -m torch.distributed.run --nproc-per-node 2``, a fresh port per run) on
a script that calls ``init_process_group("gloo")``, ``all_reduce`` and
``destroy_process_group``; the same job as an ``@ak.distributed(num_processes=2,
cpu=True)`` function that calls ``ak.state()`` (which joins the group) and
``torch.distributed.all_reduce``; torch's own ``launch_agent`` running a plain function
in spawned workers (multiprocessing's spawn start, which accelkit used before it started its
function workers as a command, as torchrun does);
torchrun again, to show the noise of a raw-vs-raw pair; and ``accelkit launch -n 2`` on
torchrun's script itself (the command line, paired with torchrun on the very same script).
They run interleaved, the order rotating each round, after one discarded warm-up round;
figures are medians, the difference and the ratio medians over the rounds.

Every job runs byte-compiled, as an installed package does: with ``PYTHONDONTWRITEBYTECODE``
set, a source checkout compiles accelkit's modules afresh in the launcher and in every worker
of every run (tens of ms each) while torch loads its installed ``.pyc`` files, which measured
the checkout, not the launch. The warm-up round writes the checkout's ``__pycache__``.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable

from _common import ChildTimes, Row, child_env, free_port, paired_row, run_child_timed

TARGET_S = 0.10  # issue: a launch costs at most +0.10 s over torchrun

RAW_SCRIPT = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(4)
dist.all_reduce(t)
assert t[0].item() == dist.get_world_size() == 2
dist.destroy_process_group()
"""

ACCELKIT_SCRIPT = """\
import torch
import torch.distributed as dist

import accelkit as ak


@ak.distributed(num_processes=2, cpu=True)
def main() -> float:
    ak.state()
    t = torch.ones(4)
    dist.all_reduce(t)
    return t[0].item()


if __name__ == "__main__":
    assert main() == 2.0
"""

AGENT_SCRIPT = """\
import sys

import torch
import torch.distributed as dist


def main() -> float:
    dist.init_process_group("gloo")
    t = torch.ones(4)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t[0].item()


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, launch_agent

    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="bench", rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{sys.argv[1]}", rdzv_configs={"rank": 0}, monitor_interval=0.05,
        start_method="spawn", logs_specs=DefaultLogsSpecs(),
    )
    assert launch_agent(config, main, [])[0] == 2.0
"""


def _env() -> dict[str, str]:
    env = child_env()
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # byte-compiled, as installed (see the module's docstring)
    return env


def _torchrun(script: str, cwd: str) -> ChildTimes:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    return run_child_timed([*cmd, script], _env(), cwd=cwd)


def _accelkit_launch(script: str, cwd: str) -> ChildTimes:
    # What the `accelkit` console script runs; `python -m torch.distributed.run` is torchrun's equivalent.
    cli = "import sys; from accelkit._cli import main; sys.exit(main())"
    return run_child_timed([sys.executable, "-c", cli, "launch", "-n", "2", script], _env(), cwd=cwd)


def _python(script: str, cwd: str) -> ChildTimes:
    return run_child_timed([sys.executable, script], _env(), cwd=cwd)


def _agent(script: str, cwd: str) -> ChildTimes:
    return run_child_timed([sys.executable, script, str(free_port())], _env(), cwd=cwd)


def run(quick: bool) -> list[Row]:
    rounds = 5 if quick else 15
    with tempfile.TemporaryDirectory(prefix="accelkit-bench-") as tmp:
        scripts = {"raw": RAW_SCRIPT, "accelkit": ACCELKIT_SCRIPT, "agent": AGENT_SCRIPT}
        for name, text in scripts.items():
            with open(os.path.join(tmp, f"{name}_allreduce.py"), "w") as f:
                f.write(text)
        jobs: dict[str, tuple[Callable[[str, str], ChildTimes], str]] = {
            "torchrun": (_torchrun, "raw_allreduce.py"),
            "accelkit": (_python, "accelkit_allreduce.py"),
            "agent": (_agent, "agent_allreduce.py"),
            "torchrun2": (_torchrun, "raw_allreduce.py"),
            "cli": (_accelkit_launch, "raw_allreduce.py"),
        }
        for launch, script in jobs.values():  # warm-up round, discarded
            launch(script, tmp)
        samples: dict[str, list[ChildTimes]] = {name: [] for name in jobs}
        names = list(jobs)
        for i in range(rounds):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                launch, script = jobs[name]
                samples[name].append(launch(script, tmp))

    def wall(name: str) -> list[float]:
        return [t.wall for t in samples[name]]

    def cpu(name: str) -> list[float]:
        return [t.cpu for t in samples[name]]

    return [
        paired_row("launch: accelkit vs torchrun", wall("accelkit"), wall("torchrun"), TARGET_S),
        paired_row("launch: torchrun vs torchrun (noise)", wall("torchrun2"), wall("torchrun")),
        paired_row(
            "launch: accelkit launch -n 2 vs torchrun --nproc-per-node 2", wall("cli"), wall("torchrun"), TARGET_S
        ),
        paired_row("launch: accelkit vs launch_agent(spawn, fn)", wall("accelkit"), wall("agent")),
        paired_row("launch: launch_agent(spawn, fn) vs torchrun", wall("agent"), wall("torchrun")),
        paired_row("launch CPU (process tree): accelkit vs torchrun", cpu("accelkit"), cpu("torchrun")),
        paired_row("launch CPU (process tree): torchrun vs torchrun", cpu("torchrun2"), cpu("torchrun")),
        paired_row("launch CPU (process tree): accelkit launch vs torchrun", cpu("cli"), cpu("torchrun")),
    ]
