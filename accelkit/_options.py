"""Every option accelkit accepts, typed once and validated once.

- :class:`Options`: the process-state options (precision, accumulation, debug, device,
  sharding), in every process; :class:`LaunchSettings`: how many workers to start and where.
- :class:`StateOptions`, :class:`InitOptions`, :class:`LaunchOptions`: the same names as
  ``TypedDict``\\ s, for the ``**options`` of ``ak.init``, ``@ak.distributed``, ``ak.launch``
  and ``accelkit.testing`` (a test checks that their keys equal the records' fields).
- :func:`validate`: one table of rules, so code, ``ACCELKIT_*`` variables, the config file and
  the command line all refuse the same values with the same words.

Torch-free: ``accelkit --help`` and ``accelkit config`` import this module.
"""

import difflib
import json
import multiprocessing
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, Literal, NamedTuple, TypedDict, TypeGuard, get_args

from . import _env
from .errors import ConfigurationError

Precision = Literal["no", "fp16", "bf16"]
DistBackend = Literal["gloo", "nccl", "xccl", "mpi"]
StrategyName = Literal["ddp", "fsdp", "deepspeed"]
RdzvBackend = Literal["static", "c10d"]
StartMethod = Literal["spawn", "fork", "forkserver"]
TrackerName = Literal["tensorboard", "csv", "jsonl", "wandb", "mlflow"]
CommHookName = Literal["no", "fp16", "bf16", "power_sgd", "batched_power_sgd"]
CommWrapperName = Literal["no", "fp16", "bf16"]
PRECISIONS: tuple[str, ...] = get_args(Precision)
DIST_BACKENDS: tuple[str, ...] = get_args(DistBackend)
STRATEGIES: tuple[str, ...] = get_args(StrategyName)
RDZV_BACKENDS: tuple[str, ...] = get_args(RdzvBackend)
TRACKERS: tuple[str, ...] = get_args(TrackerName)
COMM_HOOKS: tuple[str, ...] = get_args(CommHookName)
COMM_WRAPPERS: tuple[str, ...] = get_args(CommWrapperName)
# Values asked for by name (Accelerate lists fp8) that cannot run yet: refused with what each needs, never listed.
REFUSED: dict[str, dict[object, str]] = {
    "precision": {
        "fp8": "fp8 needs an NVIDIA GPU of compute capability 8.9 or newer, torchao, and a model converted to "
        "fp8, which accelkit does not do yet; use 'bf16'"
    },
}
DEFAULT_TIMEOUT = 600.0  # seconds a collective may wait before the job fails
DEFAULT_RDZV_TIMEOUT = 300.0  # seconds the nodes of a job wait for each other


class Options(NamedTuple):
    """Options of the process state (precision, accumulation, debug, device, timeouts, sharding, tracking)."""

    precision: Precision = "no"
    gradient_accumulation_steps: int = 1
    sync_each_batch: bool = False  # under ak.accumulate, synchronise gradients on every micro-step too
    debug: bool = False
    check_collectives: bool = True  # every collective's call compared across ranks (False: the backend call only)
    cpu: bool = False
    backend: DistBackend | None = None
    timeout: float = DEFAULT_TIMEOUT
    # Sharding: how ak.prepare wraps a model when the world has several processes.
    strategy: StrategyName = "ddp"
    fsdp_wrap: tuple[str, ...] = ()  # module class names that become their own FSDP unit
    fsdp_min_params: int = 0  # or: submodules with at least this many parameters (0: off)
    fsdp_reshard_after_forward: bool = True
    fsdp_cpu_offload: bool = False
    deepspeed_config: str | None = None  # a JSON file path, or JSON text
    # The device mesh (any set: the model goes on a mesh, FSDP2 over its data-parallel dimensions).
    dp_replicate: int = 1  # data-parallel replicas (HSDP's replicate dimension)
    dp_shard: int = -1  # data-parallel shards; -1: the processes the other dimensions leave
    tp: int = 1  # tensor parallelism (ak.prepare's tp_plan)
    cp: int = 1  # context parallelism (refused: see accelkit._strategies.mesh_sizes)
    activation_checkpointing: tuple[str, ...] = ()  # module class names whose forward is recomputed in backward
    # DDP's gradient communication hook (ak.prepare registers it; its comm_hook= option wins).
    comm_hook: CommHookName = "no"
    comm_wrapper: CommWrapperName = "no"  # fp16/bf16 compression around a PowerSGD hook
    comm_hook_options: str | None = None  # JSON text of PowerSGDState's options
    # Experiment tracking (ak.init_trackers): the trackers to start ("all": every installed one), and where.
    log_with: tuple[str, ...] = ()
    project_dir: str = "runs"

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return cls._fields


class LaunchSettings(NamedTuple):
    """How many workers to start, where, and how the nodes meet (``@ak.distributed``, ``accelkit launch``)."""

    num_processes: int | None = None  # per node; None: one per device
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    max_restarts: int = 0
    start_method: StartMethod | None = None  # None: spawn, or fork from a notebook
    rdzv_backend: RdzvBackend = "static"
    rdzv_timeout: float = DEFAULT_RDZV_TIMEOUT
    mpirun: bool = False
    hostfile: str | None = None
    gpu_ids: str | None = None  # "all" or "0,1": the devices the workers see

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return cls._fields

    @property
    def world_size(self) -> int:
        return (self.num_processes or 1) * self.num_nodes


# The keyword options of ak.init / @ak.distributed / ak.launch / accelkit.testing. None means "not set here".
class StateOptions(TypedDict, total=False):
    """The process-state options, as keyword arguments (see :class:`Options`)."""

    precision: Precision | None
    gradient_accumulation_steps: int | None
    sync_each_batch: bool | None
    debug: bool | None
    check_collectives: bool | None
    cpu: bool | None
    backend: DistBackend | None
    timeout: float | timedelta | None
    strategy: StrategyName | None
    fsdp_wrap: str | Sequence[str | type] | None
    fsdp_min_params: int | None
    fsdp_reshard_after_forward: bool | None
    fsdp_cpu_offload: bool | None
    deepspeed_config: str | os.PathLike[str] | Mapping[str, Any] | None
    dp_replicate: int | None
    dp_shard: int | None
    tp: int | None
    cp: int | None
    activation_checkpointing: str | Sequence[str | type] | None
    comm_hook: CommHookName | None
    comm_wrapper: CommWrapperName | None
    comm_hook_options: str | Mapping[str, Any] | None
    log_with: TrackerName | Literal["all"] | str | Sequence[str] | None
    project_dir: str | os.PathLike[str] | None


class InitOptions(StateOptions, total=False):
    """``ak.init``'s options: the state's, and where this process was told it stands (checked)."""

    num_processes: int | None
    num_nodes: int | None
    node_rank: int | None
    master_addr: str | None
    master_port: int | None


class LaunchOptions(InitOptions, total=False):
    """``@ak.distributed`` / ``ak.launch``'s options: the state's, and how to start the workers."""

    max_restarts: int | None
    start_method: StartMethod | None


# Launch settings that code may pass (the rest come from `accelkit launch` flags and the config file).
CODE_LAUNCH_NAMES: tuple[str, ...] = tuple(k for k in LaunchOptions.__annotations__ if k in LaunchSettings.names())
INIT_LAUNCH_NAMES: tuple[str, ...] = tuple(k for k in InitOptions.__annotations__ if k in LaunchSettings.names())


def is_int(value: object) -> TypeGuard[int]:
    """An integer that is not a bool (``True`` is no process count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def suggest(value: object, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` when ``value`` is close to one of ``choices``, else ``""``.

    Example:
        >>> suggest("bf61", PRECISIONS)
        "; did you mean 'bf16'?"
    """
    close = difflib.get_close_matches(value, list(choices), n=1, cutoff=0.6) if isinstance(value, str) else []
    return f"; did you mean {close[0]!r}?" if close else ""


def validate(options: Mapping[str, object], call: str, known: Iterable[str] | None = None) -> dict[str, object]:
    """Checks names and values; returns them normalised (``None`` values dropped). Errors echo the call.

    ``known`` defaults to the state options; pass ``LaunchSettings.names()`` (or both) for the others.

    Example:
        >>> validate({"precision": "bf16", "fsdp_wrap": "Block,Head"}, "ak.init")
        {'precision': 'bf16', 'fsdp_wrap': ('Block', 'Head')}
    """
    names = tuple(known) if known is not None else Options.names()
    out: dict[str, object] = {}
    for name, value in options.items():
        if name not in names:
            hint = suggest(name, names) or f"; valid options: {', '.join(names)}"
            raise TypeError(f"{call}() got an unexpected option {name!r}{hint}")
        if value is not None:
            out[name] = _RULES[name](name, value, call)
    return out


def parse_env(name: str, raw: str) -> object:
    """The value of state option ``name`` from its ``ACCELKIT_*`` variable's text (validated)."""
    var = _env.OPTION_VARIABLES[name]
    if name in _FLAGS:
        value: object = _env.read_bool(var, {var: raw})
    elif name in _INTEGERS:
        value = _env.read_int(var, {var: raw})
    elif name == "timeout":
        try:
            value = float(raw)
        except ValueError:
            raise ConfigurationError(f"environment variable {var}={raw!r} is not a number of seconds") from None
    elif name in _CHOICES:
        value = raw.strip().lower()
    else:
        value = raw
    return validate({name: value}, f"environment variable {var}").get(name)


def env_overrides(env: Mapping[str, str] | None = None) -> dict[str, object]:
    """The state options that ``ACCELKIT_*`` variables set, parsed and validated."""
    return {name: parse_env(name, str(raw)) for name, raw in _env.option_overrides(env).items()}


# --- the rules ----------------------------------------------------------------------------------

_FLAGS = ("sync_each_batch", "debug", "check_collectives", "cpu", "fsdp_reshard_after_forward", "fsdp_cpu_offload",
          "mpirun")  # fmt: skip
# name -> (smallest value, largest value or None, how to fix a bad one)
_INTEGERS: dict[str, tuple[int, int | None, str]] = {
    "gradient_accumulation_steps": (1, None, "use 1 to step the optimizer on every batch"),
    "fsdp_min_params": (0, None, "e.g. 1_000_000; 0 turns size-based wrapping off"),
    "num_processes": (1, None, "a positive number of processes per node: 1 runs here, 2 or more start workers"),
    "num_nodes": (1, None, "the number of machines, e.g. 2"),
    "node_rank": (0, None, "this machine's rank, from 0 to num_nodes - 1"),
    "master_port": (1, 65535, "a free TCP port on node 0, e.g. 29500"),
    "max_restarts": (0, None, "0 restarts nothing"),
    "dp_replicate": (1, None, "the data-parallel replicas, e.g. 2 (1: none)"),
    "dp_shard": (-1, None, "the data-parallel shards, e.g. 4, or -1 for the processes the other sizes leave"),
    "tp": (1, None, "the processes that split each layer, e.g. 2 (1: no tensor parallelism)"),
    "cp": (1, None, "1 (context parallelism is not supported)"),
}
# name -> (valid values, a hint); backend and start_method may also be None
_CHOICES: dict[str, tuple[tuple[str, ...], str]] = {
    "precision": (PRECISIONS, "bf16 suits most GPUs"),
    "backend": (DIST_BACKENDS, "None picks one for the device"),
    "strategy": (STRATEGIES, "'fsdp' shards parameters, gradients and optimizer state"),
    "rdzv_backend": (RDZV_BACKENDS, "'static' gives each node its rank"),
    "comm_hook": (COMM_HOOKS, "'fp16' halves DDP's gradient traffic; your own hook goes to ak.prepare(comm_hook=fn)"),
    "comm_wrapper": (COMM_WRAPPERS, "it compresses a 'power_sgd' or 'batched_power_sgd' hook's input"),
}


def _bad(call: str, name: str, value: object, expected: str, fix: str) -> ConfigurationError:
    return ConfigurationError(f"{call}({name}={value!r}): expected {expected}; {fix}")


def _choice(name: str, value: object, call: str) -> object:
    valid, hint = _CHOICES[name]
    if value not in valid:
        why = REFUSED.get(name, {}).get(value)
        raise _bad(call, name, value, f"one of {', '.join(map(repr, valid))}", why or hint + suggest(value, valid))
    return value


def _start_method(name: str, value: object, call: str) -> object:
    methods = multiprocessing.get_all_start_methods()
    if value not in methods:
        raise _bad(call, name, value, f"one of {', '.join(map(repr, methods))}", "None chooses for you")
    return value


def _integer(name: str, value: object, call: str) -> object:
    low, high, fix = _INTEGERS[name]
    if name == "fsdp_min_params" and isinstance(value, float) and value.is_integer():
        value = int(value)  # 1e6 is a fine parameter count
    span = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
    if not is_int(value) or value < low or (high is not None and value > high) or (name == "dp_shard" and value == 0):
        raise _bad(call, name, value, span + (", not 0" if name == "dp_shard" else ""), fix)
    return value


def _flag(name: str, value: object, call: str) -> object:
    if not isinstance(value, bool):
        raise _bad(call, name, value, "True or False", f"pass {name}=True to enable it")
    return value


def _seconds(name: str, value: object, call: str) -> object:
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 < seconds < float("inf"):
        default = DEFAULT_TIMEOUT if name == "timeout" else DEFAULT_RDZV_TIMEOUT
        raise _bad(call, name, value, "a positive number of seconds (or a timedelta)", f"the default is {default:g}")
    return float(seconds)


def _text(name: str, value: object, call: str) -> object:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value).strip():
        raise _bad(call, name, value, "a non-empty string", "e.g. '10.0.0.1' (a host) or a file path")
    return os.fspath(value).strip()


def _class_names(name: str, value: object, call: str) -> object:
    items = value.split(",") if isinstance(value, str) else value
    fix = f"e.g. {name}=[TransformerBlock] or {name}='Block,Head'"
    if not isinstance(items, (list, tuple)):
        raise _bad(call, name, value, "module classes or class names", fix)
    names = []
    for item in items:
        n = item.__name__ if isinstance(item, type) else item
        if not isinstance(n, str) or not n.strip().isidentifier():
            raise _bad(call, name, value, "module classes or class names", fix)
        names.append(n.strip())
    return tuple(names)


def _deepspeed_config(name: str, value: object, call: str) -> object:
    if isinstance(value, Mapping):
        return json.dumps(value, sort_keys=True)
    if not isinstance(value, (str, os.PathLike)):
        raise _bad(call, name, value, "a path to a DeepSpeed JSON config, or a dict", "e.g. 'ds_config.json'")
    return os.fspath(value)


def _comm_hook_options(name: str, value: object, call: str) -> object:
    fix = "e.g. {'matrix_approximation_rank': 2, 'start_powerSGD_iter': 10}, or that as JSON text"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise _bad(call, name, value, "a mapping of PowerSGD options (JSON text here)", fix) from None
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise _bad(call, name, value, "a mapping of PowerSGD options", fix)
    try:
        return json.dumps(dict(value), sort_keys=True)
    except (TypeError, ValueError):
        raise _bad(call, name, value, "numbers and booleans as values", fix) from None


def _log_with(name: str, value: object, call: str) -> object:
    items = value.split(",") if isinstance(value, str) else value
    valid = (*TRACKERS, "all")
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise _bad(
            call, name, value, "tracker names", f"e.g. {name}=['tensorboard', 'csv'] or {name}='tensorboard,csv'"
        )
    names: list[str] = []
    for item in (i.strip().lower() for i in items if i.strip()):  # "" (e.g. ACCELKIT_LOG_WITH=): none
        if item not in valid:
            expected = f"tracker names among {', '.join(map(repr, valid))}"
            raise _bad(call, name, value, expected, f"{item!r} is not one of them" + suggest(item, valid))
        if item not in names:
            names.append(item)
    return tuple(names)


def _gpu_ids(name: str, value: object, call: str) -> object:
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    text = ",".join(str(i).strip() for i in items)
    if text != "all" and not all(i.isdigit() for i in text.split(",")):
        raise _bad(call, name, value, "'all' or device indices like '0,1'", "e.g. gpu_ids='0,1'")
    return text


_RULES: dict[str, Callable[[str, object, str], object]] = {
    **dict.fromkeys(_CHOICES, _choice),
    **dict.fromkeys(_INTEGERS, _integer),
    **dict.fromkeys(_FLAGS, _flag),
    "timeout": _seconds,
    "rdzv_timeout": _seconds,
    "start_method": _start_method,
    "master_addr": _text,
    "hostfile": _text,
    "project_dir": _text,
    "log_with": _log_with,
    "fsdp_wrap": _class_names,
    "activation_checkpointing": _class_names,
    "deepspeed_config": _deepspeed_config,
    "comm_hook_options": _comm_hook_options,
    "gpu_ids": _gpu_ids,
}
assert set(_RULES) == {*Options.names(), *LaunchSettings.names()}, "every option has one rule"
