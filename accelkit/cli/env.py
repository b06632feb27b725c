"""``accelkit env``: the facts a bug report needs."""

from __future__ import annotations

import os
import platform

from .._version import __version__


def report() -> dict[str, str]:
    import torch

    facts = {
        "accelkit": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu count": str(os.cpu_count()),
        "cuda available": str(torch.cuda.is_available()),
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            facts[f"cuda:{i}"] = f"{props.name}, {props.total_memory / 2**30:.1f} GiB"
    facts.update({k: v for k, v in sorted(os.environ.items()) if k.startswith("ACCELKIT_")})
    return facts


def run() -> int:
    for key, value in report().items():
        print(f"- {key}: {value}")
    return 0
