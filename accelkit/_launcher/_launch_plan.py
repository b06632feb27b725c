"""The launch plan: what ``@ak.distributed``, ``ak.launch`` and ``accelkit launch`` start.

Both entry points build it the same way: every setting merged once (given > ``ACCELKIT_*`` >
config file > default, see :func:`accelkit._config.resolve`), then the combinations checked
once, each error naming the values as they were given (``--node-rank 2``, ``node_rank=2``, the
config file). The plan says what the workers' environment is and how many processes this node
starts. Torch-free: the command line builds it; only counting devices imports torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal, NamedTuple

from .. import _env
from .._config import config_in_effect, resolve
from .._options import LaunchSettings, Options
from .._strategies import mesh_sizes, on_mesh, torch_version_refusal
from ..errors import ConfigurationError

if TYPE_CHECKING:
    from .._config import ConfigFile, Source

__all__ = ["LaunchPlan", "plan_launch"]

_IN_EFFECT: object = object()  # the config file in effect (ACCELKIT_CONFIG_FILE, else the default path)
# `accelkit launch`'s spelling of each launch setting.
_FLAG_NAMES = {"master_addr": "--main-process-ip", "master_port": "--main-process-port", "num_processes": "-n"}
# The config files' spelling (accelkit's, then Accelerate's).
_FILE_KEYS = {"master_addr": "main_process_ip", "master_port": "main_process_port"}
_ACCELERATE_KEYS = {"num_nodes": "num_machines", "node_rank": "machine_rank"}


class LaunchPlan(NamedTuple):
    """What a launch starts: the settings merged and checked, with where each came from."""

    call: str  # who launches, for messages: "accelkit launch", "accelkit.launch", "accelkit.distributed"
    given_as: Literal["code", "flag"]  # how the entry point took its settings: keyword arguments or flags
    launch: LaunchSettings  # num_processes may still be None: see local_processes()
    options: dict[str, object]  # the process-state options that are set (not defaults), validated
    fixed: tuple[str, ...]  # state options the entry point was given: the workers' code must agree
    sources: Mapping[str, Source]
    config: ConfigFile | None = None
    notes: tuple[str, ...] = ()

    def worker_env(self) -> dict[str, str]:
        """The variables every worker gets: the merged options, so the workers read no config file."""
        options = {k: v for k, v in self.options.items() if v != ()}
        env = {**_env.option_env(options), _env.LAUNCH_FLAGS: ",".join(self.fixed), _env.CONFIG_FILE: ""}
        if self.given_as == "code":
            env[_env.LAUNCHED_BY] = self.call  # an ak.init that disagrees names the decorator
        if self.launch.gpu_ids not in (None, "all"):
            env["CUDA_VISIBLE_DEVICES"] = str(self.launch.gpu_ids)
        return env

    def local_processes(self) -> int:
        """How many processes this node starts: ``num_processes``, else one per listed GPU, else one per device."""
        if self.launch.num_processes is not None:
            return self.launch.num_processes
        if self.launch.gpu_ids not in (None, "all"):
            return len(str(self.launch.gpu_ids).split(","))
        from .._backends import local_device_count  # imports torch: only to count devices

        return local_device_count(bool(self.options.get("cpu")))

    def describe(self, head: str) -> None:
        """Debug mode: say what is launched, and where each setting came from."""
        print(f"accelkit: launching {head}", file=sys.stderr)
        for name in (*LaunchSettings.names(), *sorted(self.options)):
            if name == "start_method":
                continue
            value = getattr(self.launch, name) if name in LaunchSettings.names() else self.options[name]
            print(f"accelkit:   {name} = {value!r} ({self.sources.get(name, 'default')})", file=sys.stderr)

    def spell(self, name: str) -> str:
        """A launch setting as it was given: ``--node-rank 2``, ``node_rank=2``, or from the config file."""
        value = getattr(self.launch, name)
        source = self.sources.get(name, "default")
        if self.given_as == "flag":
            flag = _FLAG_NAMES.get(name, "--" + name.replace("_", "-"))
            text = flag if value is True else f"{flag} {value!r}" if isinstance(value, str) else f"{flag} {value}"
        else:
            text = f"{name}={value!r}"
        if source == "config" and self.config is not None:  # as the file says it, and where
            key = (_ACCELERATE_KEYS if self.config.kind == "accelerate" else {}).get(name, _FILE_KEYS.get(name, name))
            line = self.config.lines.get(key)
            return f"{key}: {value} ({self.config.path}{f':{line}' if line else ''})"
        return f"{text} (the default)" if source == "default" else text


def plan_launch(
    given: Mapping[str, object],
    *,
    call: str,
    given_as: Literal["code", "flag"] = "code",
    fixed: tuple[str, ...] | None = None,
    config: ConfigFile | object | None = _IN_EFFECT,
) -> LaunchPlan:
    """Merge ``given`` (code or flags), ``ACCELKIT_*`` variables, the config file and defaults; check them.

    ``fixed`` names the state options the workers' code must agree with (default: every
    state option in ``given``); ``config`` is the config file read (default: the one in effect).

    Example:
        >>> plan = plan_launch({"num_processes": 2, "precision": "bf16"}, call="ak.launch", config=None)
        >>> plan.local_processes(), plan.options["precision"], plan.sources["num_nodes"]
        (2, 'bf16', 'default')
    """
    file: ConfigFile | None = config_in_effect() if config is _IN_EFFECT else config  # type: ignore[assignment]
    resolved = resolve(given, call=call, source=given_as, config=file)
    names = [n for n in given if n not in LaunchSettings.names()] if fixed is None else fixed
    note = file.ignored_message() if file is not None else None
    plan = LaunchPlan(
        call=call,
        given_as=given_as,
        launch=resolved.launch,
        options=resolved.given(given_as, "environment", "config"),
        fixed=tuple(names),
        sources=dict(resolved.sources),
        config=file,
        notes=(note,) if note else (),
    )
    _check(plan)
    _check_mesh(plan)
    return plan


def _check_mesh(plan: LaunchPlan) -> None:
    """The device mesh's sizes against the processes this launch starts (and the torch it has), before any starts."""
    options = Options()._replace(**{k: v for k, v in plan.options.items() if k in Options.names()})  # type: ignore[arg-type]
    if not on_mesh(options):
        return
    local = plan.local_processes()
    said = "" if plan.given_as == "flag" else plan.call
    mesh_sizes(options, local * plan.launch.num_nodes, local, said)
    refusal = torch_version_refusal(on_cpu=options.cpu)
    if refusal:
        raise ConfigurationError(f"{said}: {refusal}" if said else refusal)


def _check(plan: LaunchPlan) -> None:
    """The combinations no single setting's check can catch, once, after the merge."""
    launch, spell = plan.launch, plan.spell
    said = "" if plan.given_as == "flag" else f"{plan.call}: "  # `accelkit launch` says who it is itself
    nodes = launch.num_nodes
    if launch.node_rank >= nodes:
        raise ConfigurationError(
            f"{said}{spell('node_rank')} with {spell('num_nodes')}: node ranks count from 0 to {nodes - 1}; "
            f"give each machine its own rank below the number of machines"
        )
    if launch.mpirun:
        if nodes > 1:
            raise ConfigurationError(
                f"{said}{spell('mpirun')} with {spell('num_nodes')}: mpirun places the processes itself; give the "
                f"total with -n and the machines with --hostfile, and run `accelkit launch` once, on one machine"
            )
        if launch.max_restarts:
            raise ConfigurationError(
                f"{said}{spell('mpirun')} with {spell('max_restarts')}: mpirun does not restart processes; "
                f"drop max_restarts, or drop mpirun to run on torch's elastic agent"
            )
        hostfile = launch.hostfile
        if hostfile is not None and not os.path.isfile(hostfile):
            raise ConfigurationError(f"{said}{spell('hostfile')} does not exist; point it to mpirun's host file")
    elif launch.hostfile is not None:
        raise ConfigurationError(
            f"{said}{spell('hostfile')} is for mpirun; add --mpirun, or drop the host file and start "
            f"`accelkit launch --num-nodes N --node-rank K` on each machine"
        )
    elif nodes > 1:
        examples: tuple[tuple[str, object], ...] = (("master_port", 29500), ("master_addr", "10.0.0.1"))
        for name, example in examples:
            if plan.sources[name] == "default":
                needed, asked = (
                    (_FLAG_NAMES[name], f"{_FLAG_NAMES[name]} {example}")
                    if plan.given_as == "flag"
                    else (name, f"{name}={example!r}")
                )
                raise ConfigurationError(
                    f"{said}{spell('num_nodes')} needs {needed}: every node must meet node 0 at the same "
                    f"address and port, e.g. {asked}"
                )
