"""Every environment variable accelkit reads or writes, in one place.

Launchers describe a worker through environment variables. :func:`detect_launch` reads
those of torchrun / torchelastic, Open MPI, MPICH / Intel MPI (PMI) and SLURM, so that a
process started by any of them with world size N is one of N ranks.
"""

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import NamedTuple

from .errors import ConfigurationError

# Options that `@ak.distributed` / `accelkit launch` hand to workers, and users may set.
PRECISION = "ACCELKIT_PRECISION"
GRADIENT_ACCUMULATION_STEPS = "ACCELKIT_GRADIENT_ACCUMULATION_STEPS"
SYNC_EACH_BATCH = "ACCELKIT_SYNC_EACH_BATCH"
DEBUG = "ACCELKIT_DEBUG"
CHECK_COLLECTIVES = "ACCELKIT_CHECK_COLLECTIVES"
CPU = "ACCELKIT_CPU"
BACKEND = "ACCELKIT_BACKEND"
TIMEOUT = "ACCELKIT_TIMEOUT"
STRATEGY = "ACCELKIT_STRATEGY"
FSDP_WRAP = "ACCELKIT_FSDP_WRAP"
FSDP_MIN_PARAMS = "ACCELKIT_FSDP_MIN_PARAMS"
FSDP_RESHARD_AFTER_FORWARD = "ACCELKIT_FSDP_RESHARD_AFTER_FORWARD"
FSDP_CPU_OFFLOAD = "ACCELKIT_FSDP_CPU_OFFLOAD"
DEEPSPEED_CONFIG = "ACCELKIT_DEEPSPEED_CONFIG"
DP_REPLICATE = "ACCELKIT_DP_REPLICATE"  # the device mesh's sizes
DP_SHARD = "ACCELKIT_DP_SHARD"
TP = "ACCELKIT_TP"
CP = "ACCELKIT_CP"
ACTIVATION_CHECKPOINTING = "ACCELKIT_ACTIVATION_CHECKPOINTING"  # module class names, comma-separated
COMM_HOOK = "ACCELKIT_COMM_HOOK"  # DDP's gradient communication hook: fp16, bf16, power_sgd, ...
COMM_WRAPPER = "ACCELKIT_COMM_WRAPPER"
COMM_HOOK_OPTIONS = "ACCELKIT_COMM_HOOK_OPTIONS"  # JSON, e.g. {"matrix_approximation_rank": 2}
LOG_WITH = "ACCELKIT_LOG_WITH"  # trackers for ak.init_trackers, comma-separated
PROJECT_DIR = "ACCELKIT_PROJECT_DIR"  # where ak.init_trackers writes (default ./runs)
LOG_LEVEL = "ACCELKIT_LOG_LEVEL"
# The config file to read (``accelkit config`` writes it); an empty value means none.
CONFIG_FILE = "ACCELKIT_CONFIG_FILE"
# The run directory where workers of `accelkit launch` record their failures.
RUN_DIR = "ACCELKIT_RUN_DIR"
# Option names the launcher received explicitly (`accelkit launch` flags, @ak.distributed / ak.launch
# options; comma-separated): code in the workers must agree with them. LAUNCHED_BY names that launcher.
LAUNCH_FLAGS = "ACCELKIT_LAUNCH_FLAGS"
LAUNCHED_BY = "ACCELKIT_LAUNCHED_BY"
# Set only by accelkit.testing in its workers: "cpu" keeps every rank on the CPU whatever the code or
# the config file asks; "cuda" puts every local rank on cuda:0, over gloo (several ranks on one GPU).
TEST_DEVICE = "ACCELKIT_TEST_DEVICE"
TEST_DEVICES = ("cpu", "cuda")
# Seconds between two "still waiting for rank N" lines of a rank stuck in a collective (0: none).
WAIT_LOG_INTERVAL = "ACCELKIT_WAIT_LOG_INTERVAL"
# The pid of the process that started this worker: the worker exits when it is gone.
LAUNCHER_PID = "ACCELKIT_LAUNCHER_PID"
# The job's attempt, the same on every node (the c10d rendezvous's round; each agent counts its own
# restarts, and a node started again to replace a lost one counts none): read as the restart count.
ATTEMPT = "ACCELKIT_ATTEMPT"
# The network interfaces gloo and NCCL bind to; a multi-node launch sets those the user left unset.
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"

OPTION_VARIABLES = {
    "precision": PRECISION,
    "gradient_accumulation_steps": GRADIENT_ACCUMULATION_STEPS,
    "sync_each_batch": SYNC_EACH_BATCH,
    "debug": DEBUG,
    "check_collectives": CHECK_COLLECTIVES,
    "cpu": CPU,
    "backend": BACKEND,
    "timeout": TIMEOUT,
    "strategy": STRATEGY,
    "fsdp_wrap": FSDP_WRAP,
    "fsdp_min_params": FSDP_MIN_PARAMS,
    "fsdp_reshard_after_forward": FSDP_RESHARD_AFTER_FORWARD,
    "fsdp_cpu_offload": FSDP_CPU_OFFLOAD,
    "deepspeed_config": DEEPSPEED_CONFIG,
    "dp_replicate": DP_REPLICATE,
    "dp_shard": DP_SHARD,
    "tp": TP,
    "cp": CP,
    "activation_checkpointing": ACTIVATION_CHECKPOINTING,
    "comm_hook": COMM_HOOK,
    "comm_wrapper": COMM_WRAPPER,
    "comm_hook_options": COMM_HOOK_OPTIONS,
    "log_with": LOG_WITH,
    "project_dir": PROJECT_DIR,
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class LaunchEnv(NamedTuple):
    """Where this process sits in a job, as its launcher described it."""

    launcher: str  # "torchrun", "openmpi", "pmi", "slurm" or "none"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    restart_count: int = 0
    agent_store: bool = False  # the elastic agent hosts the rendezvous store


def read_int(name: str, env: Mapping[str, str] | None = None) -> int | None:
    """The integer value of ``name``, ``None`` when unset; a clear error when malformed."""
    env = os.environ if env is None else env
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(
            f"environment variable {name}={raw!r} is not an integer; unset it or set it to a whole number"
        ) from None


def read_bool(name: str, env: Mapping[str, str] | None = None) -> bool | None:
    env = os.environ if env is None else env
    raw = env.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigurationError(f"environment variable {name}={raw!r} is not a boolean; use 1/0, true/false or yes/no")


def read_seconds(name: str, default: float, env: Mapping[str, str] | None = None) -> float:
    """A non-negative number of seconds from ``name``, ``default`` when unset; a clear error when malformed."""
    raw = read_str(name, env)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ConfigurationError(
            f"environment variable {name}={raw!r} is not a number of seconds >= 0; e.g. {name}={default:g}"
        )
    return value


def read_str(name: str, env: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if env is None else env
    raw = env.get(name)
    return raw.strip() if raw is not None and raw.strip() else None


def test_device(env: Mapping[str, str] | None = None) -> str | None:
    """The device accelkit.testing pinned this worker to (``"cpu"`` or ``"cuda"``), None outside its workers."""
    raw = read_str(TEST_DEVICE, env)
    if raw is None:
        return None
    if raw not in TEST_DEVICES:
        raise ConfigurationError(
            f"environment variable {TEST_DEVICE}={raw!r}: expected one of {', '.join(TEST_DEVICES)}; "
            f"accelkit.testing sets it for its workers, unset it elsewhere"
        )
    return raw


def option_overrides(env: Mapping[str, str] | None = None) -> dict[str, object]:
    """The ``ACCELKIT_*`` options that are set, by option name (values still raw strings)."""
    env = os.environ if env is None else env
    return {name: env[var] for name, var in OPTION_VARIABLES.items() if var in env}


def option_env(options: Mapping[str, object]) -> dict[str, str]:
    """Environment variables that carry ``options`` into worker processes."""
    out: dict[str, str] = {}
    for name, value in options.items():
        if value is None:
            continue
        if isinstance(value, bool):
            text = "1" if value else "0"
        elif isinstance(value, (tuple, list)):
            text = ",".join(getattr(v, "__name__", str(v)) for v in value)
        else:
            text = str(value)
        out[OPTION_VARIABLES[name]] = text
    return out


def launch_flags(env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The option names that ``accelkit launch`` set from its command-line flags."""
    raw = read_str(LAUNCH_FLAGS, env)
    return tuple(n for n in raw.split(",") if n) if raw else ()


@contextlib.contextmanager
def patched(values: Mapping[str, str], *touched: str) -> Iterator[None]:
    """Set ``values`` in this process's environment; restore them and ``touched`` afterwards.

    Example:
        >>> with patched({CONFIG_FILE: ""}):
        ...     os.environ[CONFIG_FILE]
        ''
    """
    names = [*values, *touched]
    before = {name: os.environ.get(name) for name in names}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read this process's place in the job from the launcher's variables."""
    env = os.environ if env is None else env
    for reader in (_torchrun, _openmpi, _pmi, _slurm):
        found = reader(env)
        if found is not None:
            _check_consistent(found)
            return found
    return LaunchEnv(launcher="none")


def _torchrun(env: Mapping[str, str]) -> LaunchEnv | None:
    world = read_int("WORLD_SIZE", env)
    rank = read_int("RANK", env)
    if world is None or rank is None:
        return None
    local_rank = read_int("LOCAL_RANK", env)
    local_world = read_int("LOCAL_WORLD_SIZE", env)
    if local_rank is None:  # plain env:// setup: assume one node
        local_rank, local_world = rank, world
    local_world = local_world or world
    return LaunchEnv(
        launcher="torchrun" if "TORCHELASTIC_RUN_ID" in env else "env",
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        node_rank=_or(read_int("GROUP_RANK", env), rank // max(local_world, 1)),
        num_nodes=_or(read_int("GROUP_WORLD_SIZE", env), max(world // max(local_world, 1), 1)),
        master_addr=read_str("MASTER_ADDR", env),
        master_port=read_int("MASTER_PORT", env),
        restart_count=_or(read_int(ATTEMPT, env), read_int("TORCHELASTIC_RESTART_COUNT", env) or 0),
        agent_store=read_bool("TORCHELASTIC_USE_AGENT_STORE", env) or False,
    )


def _from_counts(
    launcher: str, env: Mapping[str, str], world: str, rank: str, local_rank: str, local_world: str
) -> LaunchEnv | None:
    w, r = read_int(world, env), read_int(rank, env)
    if w is None or r is None:
        return None
    lr = _or(read_int(local_rank, env), r)
    lw = _or(read_int(local_world, env), w)
    return LaunchEnv(
        launcher=launcher,
        rank=r,
        world_size=w,
        local_rank=lr,
        local_world_size=lw,
        node_rank=r // max(lw, 1),
        num_nodes=max(w // max(lw, 1), 1),
        master_addr=read_str("MASTER_ADDR", env),
        master_port=read_int("MASTER_PORT", env),
    )


def _openmpi(env: Mapping[str, str]) -> LaunchEnv | None:
    return _from_counts(
        "openmpi", env, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
    )  # fmt: skip


def _pmi(env: Mapping[str, str]) -> LaunchEnv | None:
    # MPICH and Intel MPI (Hydra process manager).
    return _from_counts("pmi", env, "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")


def _slurm(env: Mapping[str, str]) -> LaunchEnv | None:
    # Only a task started by `srun` is a rank: a batch script's shell has SLURM_PROCID too,
    # but no step task count.
    world = read_int("SLURM_STEP_NUM_TASKS", env)
    rank = read_int("SLURM_PROCID", env)
    if world is None or rank is None:
        return None
    nodes = _or(read_int("SLURM_STEP_NUM_NODES", env), _or(read_int("SLURM_NNODES", env), 1))
    return LaunchEnv(
        launcher="slurm",
        rank=rank,
        world_size=world,
        local_rank=_or(read_int("SLURM_LOCALID", env), rank),
        local_world_size=max(world // max(nodes, 1), 1),
        node_rank=_or(read_int("SLURM_NODEID", env), 0),
        num_nodes=nodes,
        master_addr=read_str("MASTER_ADDR", env),
        master_port=read_int("MASTER_PORT", env),
    )


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


def _check_consistent(launch: LaunchEnv) -> None:
    if launch.world_size < 1 or not 0 <= launch.rank < launch.world_size:
        raise ConfigurationError(
            f"the {launch.launcher} launcher variables say rank {launch.rank} of world size "
            f"{launch.world_size}; a rank must lie in [0, world size). Check the launch command."
        )
    if not 0 <= launch.local_rank < max(launch.local_world_size, 1):
        raise ConfigurationError(
            f"the {launch.launcher} launcher variables say local rank {launch.local_rank} of "
            f"{launch.local_world_size} local processes; check the launch command."
        )
