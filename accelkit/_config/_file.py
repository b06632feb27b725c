"""The config file: accelkit's own flat YAML, or an existing Accelerate ``config.yaml``.

:func:`load_config` reads either kind into one :class:`ConfigFile`: process-state options
(validated like ``ak.init``'s) and launch settings (processes *per node*). Every problem is a
:class:`~accelkit.errors.ConfigurationError` naming ``file:line``, the key, what was expected
and a fix, raised before anything starts. PyYAML is imported only when a file is read or
written, so :func:`config_in_effect` costs a ``stat`` when there is no config file.
"""

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple

from .. import _env, _safe_io
from .._options import (
    COMM_HOOKS,
    COMM_WRAPPERS,
    DIST_BACKENDS,
    PRECISIONS,
    RDZV_BACKENDS,
    REFUSED,
    STRATEGIES,
    Options,
)
from .._version import __version__
from ..errors import ConfigurationError
from ._fields import FILE_NAMES, LAUNCH_KEYS, NO_ALIAS, Fields

Kind = Literal["accelkit", "accelerate"]
_INSTALL = "pip install pyyaml"
_LAUNCH_NAMES = {file: name for name, file in FILE_NAMES.items()}  # file key -> launch setting
# Keys only an Accelerate config has.
_ACCELERATE_MARKERS = {"compute_environment", "distributed_type", "mixed_precision", "num_machines", "machine_rank"}


class ConfigFile(NamedTuple):
    """A config file, read and validated.

    ``state`` holds process-state options (``Options`` names); ``launch`` holds launch
    settings (``LaunchSettings`` names; ``num_processes`` per node): only those the file sets.
    ``ignored`` lists keys that have no effect here; ``notes`` says why for those whose value
    asked for something.
    """

    path: Path
    kind: Kind
    state: dict[str, object]
    launch: dict[str, object]
    ignored: tuple[str, ...]
    lines: dict[str, int]
    notes: dict[str, str]

    def ignored_message(self) -> str | None:
        """One line about the ignored keys (to print once), or ``None`` when there are none."""
        if not self.ignored:
            return None
        why = "".join(f"; {key}: {note}" for key, note in self.notes.items())
        return f"{self.path}: keys with no effect in accelkit, ignored: {', '.join(self.ignored)}{why}"


def default_config_path() -> Path:
    """``${XDG_CONFIG_HOME:-~/.config}/accelkit/default_config.yaml``."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "accelkit" / "default_config.yaml"


def config_path(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """The config file in effect: ``explicit``, else ``ACCELKIT_CONFIG_FILE`` (empty: none),
    else the default path when that file exists."""
    if explicit is not None:
        return _existing(Path(os.fspath(explicit)).expanduser(), "--config-file / config_file")
    raw = os.environ.get(_env.CONFIG_FILE)
    if raw is not None:
        return _existing(Path(raw).expanduser(), f"environment variable {_env.CONFIG_FILE}") if raw.strip() else None
    default = default_config_path()
    return default if default.is_file() else None


def _existing(path: Path, given_by: str) -> Path:
    path = path.absolute()  # messages name the file wherever they are read
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigurationError(
            f"config file {str(path)!r} (from {given_by}) {what}; "
            f"write one with `accelkit config --config-file {path}`, or point to an existing file"
        )
    return path


def config_in_effect(explicit: str | os.PathLike[str] | None = None) -> ConfigFile | None:
    """The config file in effect (``explicit``, else see :func:`config_path`), read and validated; None without one.

    A problem with the default file (one a user may not remember, written by ``accelkit config``) says so.
    """
    path = config_path(explicit)
    if path is None:
        return None
    try:
        return load_config(path)
    except ConfigurationError as err:
        if explicit is None and os.environ.get(_env.CONFIG_FILE) is None:
            raise ConfigurationError(
                f"{err}\n(This is the default config file, written by `accelkit config`, and read by every run: fix "
                f"it, rewrite it with `accelkit config default --force`, or read none with {_env.CONFIG_FILE}=)"
            ) from None
        raise


def load_config(path: str | os.PathLike[str]) -> ConfigFile:
    """Reads and validates accelkit's YAML or an Accelerate ``config.yaml`` (told apart by its keys)."""
    file = Path(os.fspath(path)).expanduser()
    values, lines = _read_yaml(file)
    fields_ = Fields(str(file), values, lines)
    if _ACCELERATE_MARKERS & set(values):
        from ._accelerate import from_accelerate

        state, launch = from_accelerate(fields_, file)
        kind: Kind = "accelerate"
    else:
        state, launch = from_accelkit(fields_)
        kind = "accelkit"
    launch = {_LAUNCH_NAMES.get(k, k): v for k, v in launch.items()}
    return ConfigFile(file, kind, state, launch, tuple(fields_.ignored), lines, dict(fields_.notes))


def write_config(
    values: Mapping[str, object], path: str | os.PathLike[str] | None = None, *, written_by: str = "write_config"
) -> Path:
    """Validates ``values`` (accelkit's keys) and writes them atomically; returns the path."""
    file = Path(os.fspath(path)).expanduser() if path is not None else default_config_path()
    given = {k: v for k, v in values.items() if v is not None}
    fields_ = Fields("accelkit.write_config()", dict(given), {})
    state, launch = from_accelkit(fields_)
    merged = {**launch, **state}
    order = [k for k in (*LAUNCH_KEYS, *Options.names()) if k in merged]
    out = {k: list(v) if isinstance(v := merged[k], tuple) else v for k in order}  # YAML lists, not tuples
    text = yaml_module().safe_dump(out, sort_keys=False, default_flow_style=False)
    header = f"# accelkit {__version__} config, written by {written_by}; edit freely, or rerun `accelkit config`.\n"
    try:
        _safe_io.write_atomic(file, (header + text).encode())
    except OSError as err:
        raise ConfigurationError(f"cannot write the config file {file}: {err}; choose another path") from None
    return file


def yaml_module(path: Path | None = None) -> Any:
    """PyYAML (a dependency of accelkit: missing only from a broken install), or an error naming ``path``."""
    try:
        import yaml  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        what = f"reading the config file {path}" if path is not None else "writing accelkit config files"
        raise ConfigurationError(f"{what} needs PyYAML, which is not installed here: {_INSTALL}") from None
    return yaml


# --- reading YAML with line numbers -------------------------------------------------------------


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    yaml = yaml_module(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        _existing(path, "load_config")
        raise
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigurationError(f"cannot read the config file {path}: {err}; check the path and permissions") from None
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            raise ConfigurationError(
                f"{path}: the config file is empty; write one with `accelkit config`, or delete it"
            )
        if not isinstance(root, yaml.MappingNode):
            raise ConfigurationError(
                f"{path}:{root.start_mark.line + 1}: expected `key: value` lines at the top level, "
                f"found a {root.id}; see `accelkit config default` for an example"
            )
        lines: dict[str, int] = {}
        return _mapping(loader, root, "", lines, path), lines
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(err, "problem", None) or str(err)
        context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
        if context and start is not None and mark is not None and start.line != mark.line:
            problem += f" ({context}, which starts on line {start.line + 1})"
        raise ConfigurationError(
            f"{where}: not valid YAML: {problem}; fix that line (YAML wants `key: value`)"
        ) from None
    finally:
        loader.dispose()


def _mapping(loader: Any, node: Any, prefix: str, lines: dict[str, int], path: Path) -> dict[str, Any]:
    yaml = yaml_module()
    out: dict[str, Any] = {}
    for key_node, value_node in node.value:
        line = key_node.start_mark.line + 1
        key = loader.construct_object(key_node, deep=True)
        if not isinstance(key, str):
            raise ConfigurationError(f"{path}:{line}: {key!r}: keys must be names; write e.g. `num_processes: 2`")
        name = prefix + key
        if name in lines:
            raise ConfigurationError(
                f"{path}:{line}: {name}: duplicate key (first set on line {lines[name]}); keep only one of them"
            )
        lines[name] = line
        if isinstance(value_node, yaml.MappingNode):
            out[key] = _mapping(loader, value_node, name + ".", lines, path)
        else:
            out[key] = loader.construct_object(value_node, deep=True)
    return out


# --- accelkit's own keys -----------------------------------------------------------------------


def from_accelkit(f: Fields) -> tuple[dict[str, object], dict[str, object]]:
    f.check_known((*LAUNCH_KEYS, *Options.names()))
    checked: dict[str, object] = {
        "precision": f.choice("precision", PRECISIONS, NO_ALIAS, REFUSED["precision"]),
        "gradient_accumulation_steps": f.integer("gradient_accumulation_steps", 1),
        "sync_each_batch": f.flag("sync_each_batch"),
        "debug": f.flag("debug"),
        "check_collectives": f.flag("check_collectives"),
        "cpu": f.flag("cpu"),
        "backend": f.choice("backend", DIST_BACKENDS),
        "timeout": f.number("timeout", "600"),
        "strategy": f.choice("strategy", STRATEGIES),
        "fsdp_wrap": f.get("fsdp_wrap", (str, list), "class names (a list, or comma-separated)", "[Block]"),
        "fsdp_min_params": f.integer("fsdp_min_params", 0, example=1_000_000),
        "fsdp_reshard_after_forward": f.flag("fsdp_reshard_after_forward"),
        "fsdp_cpu_offload": f.flag("fsdp_cpu_offload"),
        "deepspeed_config": f.get("deepspeed_config", (str, dict), "a JSON file path or a mapping", "ds.json"),
        "dp_replicate": f.integer("dp_replicate", 1, example=2),
        "dp_shard": f.integer("dp_shard", -1, example=2),
        "tp": f.integer("tp", 1, example=2),
        "cp": f.integer("cp", 1, example=1),
        "activation_checkpointing": f.get(
            "activation_checkpointing", (str, list), "class names (a list, or comma-separated)", "[Block]"
        ),
        "comm_hook": f.choice("comm_hook", COMM_HOOKS, NO_ALIAS),
        "comm_wrapper": f.choice("comm_wrapper", COMM_WRAPPERS, NO_ALIAS),
        "comm_hook_options": f.get("comm_hook_options", (str, dict), "a mapping", "{matrix_approximation_rank: 2}"),
        "log_with": f.get("log_with", (str, list), "tracker names (a list, or comma-separated)", "[tensorboard, csv]"),
        "project_dir": f.text("project_dir", "runs"),
    }
    state = f.state({k: v for k, v in checked.items() if v is not None})
    launch: dict[str, object] = {
        "num_processes": f.integer("num_processes", 1, example=2),
        "num_nodes": f.integer("num_nodes", 1, example=2),
        "node_rank": f.integer("node_rank", 0, example=0),
        "main_process_ip": f.text("main_process_ip", "10.0.0.1"),
        "main_process_port": f.integer("main_process_port", 1, 65535, example=29500),
        "max_restarts": f.integer("max_restarts", 0, example=0),
        "rdzv_backend": f.choice("rdzv_backend", RDZV_BACKENDS),
        "rdzv_timeout": f.number("rdzv_timeout", "900"),
        "mpirun": f.flag("mpirun"),
        "hostfile": f.text("hostfile", "/etc/mpi/hostfile"),
        "gpu_ids": f.gpu_ids("gpu_ids"),
    }
    launch = {k: v for k, v in launch.items() if v is not None}
    return state, launch
