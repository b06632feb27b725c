"""The handshake when a group forms: every rank must run the same software with the same options.

Ranks that run different accelkit, torch or Python versions, or resolved different options
(another precision, strategy, accumulation, world size or debug mode: a missing variable on one
node), would fail later in ways that hide the cause, or silently compute something else. Right
after the group forms, each rank posts its facts to the store and compares them with rank 0's:
a handful of store operations, once. On any difference every rank raises, before the first
collective, with a line per differing rank naming both values.
"""

from __future__ import annotations

import json
import platform
from typing import Any

from .._version import __version__
from ..errors import ConfigurationError

__all__ = ["handshake", "job_facts"]

# What the facts are called in messages.
_NAMES = {"accelkit": "accelkit", "torch": "torch", "python": "Python", "world_size": "world size"}


def job_facts(options: Any, world_size: int) -> dict[str, str]:
    """What must be the same on every rank: versions and the options that change the computation.

    Example:
        >>> from accelkit._options import Options
        >>> job_facts(Options(), 2)["precision"]
        'no'
    """
    import torch

    return {
        "accelkit": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "precision": options.precision,
        "strategy": options.strategy,
        "gradient_accumulation_steps": str(options.gradient_accumulation_steps),
        "debug": str(options.debug),
        "check_collectives": str(options.check_collectives),
        "mesh": f"dp_replicate={options.dp_replicate} dp_shard={options.dp_shard} tp={options.tp} cp={options.cp}",
        "world_size": str(world_size),
    }


def handshake(store: Any, rank: int, world: int, facts: dict[str, str]) -> None:
    """Compare ``facts`` with every rank's through ``store`` (a fresh key space); raise on any difference.

    Every rank of the group must call it. Raises :class:`~accelkit.ConfigurationError` on every
    rank when any rank's facts differ from rank 0's.
    """
    store.set(f"facts/{rank}", json.dumps(facts))
    reference = json.loads(store.get("facts/0"))
    differ = {name: [reference.get(name), value] for name, value in facts.items() if reference.get(name) != value}
    if differ:
        store.append("differences", json.dumps([rank, differ]) + "\n")
    if store.add("arrived", 1) == world:
        store.set("done", "1")
    store.wait(["done"])
    if not store.check(["differences"]):
        return
    lines = sorted(json.loads(line) for line in store.get("differences").decode().splitlines())
    details = [
        f"  - rank {r} has {_NAMES.get(name, name)} {theirs!r}, rank 0 has {ours!r}"
        for r, differ in lines
        for name, (ours, theirs) in sorted(differ.items())
    ]
    ranks = ", ".join(str(r) for r, _ in lines)
    raise ConfigurationError(
        f"rank {rank}: the processes of this job do not match (rank {ranks} differ{'s' if len(lines) == 1 else ''} "
        f"from rank 0):\n" + "\n".join(details) + "\nInstall the same accelkit, torch and Python on every node, "
        "and give every process the same options (the same ACCELKIT_* variables and config file)."
    )
