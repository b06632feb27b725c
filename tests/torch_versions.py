"""Features that need a newer torch than accelkit's floor (2.4): their tests skip below it, saying why.

The smoke set (``pytest -m smoke``, which ``.ci/smoke`` runs on the oldest and the newest torch) has
such tests too; below the version a feature needs, they skip instead of failing. The tests run on the CPU.
"""

from __future__ import annotations

import pytest
import torch

# FSDP2's fully_shard is public (torch.distributed.fsdp) from torch 2.6, and runs on the CPU (gloo)
# from 2.7 (on 2.6, torch.cpu.Stream has no record_event), but averages gradients correctly there only
# from 2.9 (below): accelkit refuses strategy='fsdp' on the CPU before 2.9.
FSDP2_ON_CPU = "2.9"
# Its gradients on the CPU: gloo's reduce-scatter with ReduceOp.AVG, which FSDP2 uses for float32, sums
# without dividing before torch 2.9 (checked: 2.7.1 and 2.8.0 sum; 2.9.0, 2.11.0, 2.13.0 and 2.14.1
# average), so sharded training takes steps world-size times too large there (pytorch#162338).
FSDP2_MEAN_ON_CPU = "2.9"

needs_fsdp2_on_cpu = pytest.mark.skipif(
    torch.__version__ < FSDP2_ON_CPU,
    reason=f"FSDP2 (fully_shard) runs on the CPU from torch {FSDP2_ON_CPU}; this is torch {torch.__version__}",
)
needs_fsdp2_mean_on_cpu = pytest.mark.skipif(
    torch.__version__ < FSDP2_MEAN_ON_CPU,
    reason=f"FSDP2 averages gradients on the CPU from torch {FSDP2_MEAN_ON_CPU}; this is torch {torch.__version__}",
)

# DCP's DefaultStager (torch.distributed.checkpoint.staging) is there from torch 2.9; before, accelkit
# stages background saves by hand (accelkit/_checkpoint/_async.py's _HostCopy).
DEFAULT_STAGER = "2.9"

needs_default_stager = pytest.mark.skipif(
    torch.__version__ < DEFAULT_STAGER,
    reason=f"DCP's DefaultStager is there from torch {DEFAULT_STAGER}; this is torch {torch.__version__}",
)
