"""Import time: ``import torch, accelkit`` over ``import torch``, in fresh processes.

Each sample is a fresh interpreter that times its own imports with ``time.perf_counter``
(so interpreter startup is left out) and prints them; the subprocess wall time is kept
too. The torch-only and torch+accelkit children alternate (paired, the order flipping
each pair) after one discarded warm-up pair; figures are medians, and the difference
and the ratio are medians over the pairs. The "same child" rows time ``import accelkit``
after ``import torch`` inside one child, which cancels the noise of the torch import;
since ``import accelkit`` may load its names lazily, the "every public name" rows also
resolve each name in ``accelkit.__all__`` (what a script using the API pays), the last
with bytecode caching forced on (``PYTHONPYCACHEPREFIX`` in a temporary folder,
``PYTHONDONTWRITEBYTECODE`` unset), as for a wheel install: an editable checkout under
``PYTHONDONTWRITEBYTECODE=1`` compiles accelkit's source at every import.
"""

from __future__ import annotations

import sys
import tempfile
from typing import NamedTuple

from _common import Row, child_env, paired_row, run_child

TARGET_S = 0.02  # issue: import accelkit costs at most +0.02 s over import torch

# Each child prints: import torch, + import accelkit, + every public name resolved (cumulative).
TORCH_ONLY = "import time; t0 = time.perf_counter(); import torch; t = time.perf_counter() - t0; print(t, t, t)"
WITH_ACCELKIT = (
    "import time; t0 = time.perf_counter(); import torch; t1 = time.perf_counter(); "
    "import accelkit; t2 = time.perf_counter(); "
    "[getattr(accelkit, n) for n in getattr(accelkit, '__all__', ())]; t3 = time.perf_counter(); "
    "print(t1 - t0, t2 - t0, t3 - t0)"
)


class Sample(NamedTuple):
    wall: float  # the subprocess, start to exit
    torch: float  # in the child: import torch
    imported: float  # in the child: import torch, then import accelkit
    resolved: float  # ... then every name in accelkit.__all__ resolved


def _sample(code: str, env: dict[str, str]) -> Sample:
    wall, out = run_child([sys.executable, "-c", code], env)
    torch_s, imported_s, resolved_s = (float(x) for x in out.split())
    return Sample(wall, torch_s, imported_s, resolved_s)


def run(quick: bool) -> list[Row]:
    pairs = 7 if quick else 15
    env = child_env()
    with tempfile.TemporaryDirectory(prefix="accelkit-bench-pyc-") as pyc:
        cached_env = {k: v for k, v in child_env(PYTHONPYCACHEPREFIX=pyc).items() if k != "PYTHONDONTWRITEBYTECODE"}
        for e in (env, env, cached_env):  # warm-up: file-system caches, the bytecode cache
            _sample(WITH_ACCELKIT, e)
        ref: list[Sample] = []
        ours: list[Sample] = []
        cached: list[Sample] = []
        for i in range(pairs):
            if i % 2 == 0:
                ref.append(_sample(TORCH_ONLY, env))
                ours.append(_sample(WITH_ACCELKIT, env))
            else:
                ours.append(_sample(WITH_ACCELKIT, env))
                ref.append(_sample(TORCH_ONLY, env))
            cached.append(_sample(WITH_ACCELKIT, cached_env))
    return [
        paired_row(
            "import torch,accelkit vs torch (in child)", [o.imported for o in ours], [r.torch for r in ref], TARGET_S
        ),
        paired_row("import torch,accelkit vs torch (process wall)", [o.wall for o in ours], [r.wall for r in ref]),
        paired_row(
            "import accelkit after torch (same child)", [o.imported for o in ours], [o.torch for o in ours], TARGET_S
        ),
        paired_row(
            "import accelkit + every public name (same child)",
            [o.resolved for o in ours],
            [o.torch for o in ours],
            TARGET_S,
        ),
        paired_row(
            "import accelkit + every public name (same child, .pyc cached)",
            [c.resolved for c in cached],
            [c.torch for c in cached],
            TARGET_S,
        ),
    ]
