"""The config file: accelkit's own flat YAML, or an existing Accelerate ``config.yaml``.

:func:`load_config` reads either kind into one :class:`ConfigFile`: process-state options
(validated like ``ak.init``'s) and launch settings (processes *per node*). Every problem is a
:class:`~accelkit.errors.ConfigurationError` naming ``file:line``, the key, what was expected
and a fix, raised before anything starts. PyYAML is imported only when a file is read or
written, so :func:`state_options` costs a ``stat`` when there is no config file.
"""

from __future__ import annotations

import difflib
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .. import _env
from .._options import DIST_BACKENDS, PRECISIONS, STRATEGIES, Options, validate
from .._version import __version__
from ..errors import ConfigurationError

Kind = Literal["accelkit", "accelerate"]
# Launch keys of accelkit's format: the `accelkit launch` flags, with underscores.
LAUNCH_KEYS = (
    "num_processes", "num_nodes", "node_rank", "main_process_ip", "main_process_port",
    "max_restarts", "rdzv_backend", "rdzv_timeout", "mpirun", "hostfile", "gpu_ids",
)  # fmt: skip
RDZV_BACKENDS = ("static", "c10d")
_LAUNCH_NAMES = {"main_process_ip": "master_addr", "main_process_port": "master_port"}  # file key -> launch key
_INSTALL = 'pip install "accelkit[yaml]"'


@dataclass(frozen=True)
class ConfigFile:
    """A config file, read and validated.

    ``state`` holds process-state options (``Options`` names); ``launch`` holds
    ``num_processes`` (per node), ``num_nodes``, ``node_rank``, ``master_addr``,
    ``master_port``, ``max_restarts``, ``rdzv_backend``, ``rdzv_timeout``, ``mpirun``,
    ``hostfile`` and ``gpu_ids``: only those the file sets. ``ignored`` lists keys that have
    no effect here; ``notes`` says why for those whose value asked for something.
    """

    path: Path
    kind: Kind
    state: dict[str, object]
    launch: dict[str, object]
    ignored: tuple[str, ...] = ()
    lines: dict[str, int] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

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
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigurationError(
            f"config file {str(path)!r} (from {given_by}) {what}; "
            f"write one with `accelkit config --config-file {path}`, or point to an existing file"
        )
    return path


_cached: tuple[tuple[str, int, int], dict[str, object]] | None = None


def state_options() -> dict[str, object]:
    """Process-state options of the config file in effect, ``{}`` without one (cached by mtime)."""
    global _cached
    path = config_path(None)
    if path is None:
        return {}
    stat = path.stat()
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    if _cached is None or _cached[0] != key:
        _cached = (key, load_config(path).state)
    return dict(_cached[1])


def load_config(path: str | os.PathLike[str]) -> ConfigFile:
    """Reads and validates accelkit's YAML or an Accelerate ``config.yaml`` (told apart by its keys)."""
    file = Path(os.fspath(path)).expanduser()
    values, lines = _read_yaml(file)
    fields_ = _Fields(str(file), values, lines)
    if _ACCELERATE_MARKERS & set(values):
        from ._accelerate import from_accelerate

        state, launch = from_accelerate(fields_, file)
        kind: Kind = "accelerate"
    else:
        state, launch = _from_accelkit(fields_)
        kind = "accelkit"
    launch = {_LAUNCH_NAMES.get(k, k): v for k, v in launch.items()}
    return ConfigFile(file, kind, state, launch, tuple(fields_.ignored), lines, dict(fields_.notes))


def write_config(
    values: Mapping[str, object], path: str | os.PathLike[str] | None = None, *, written_by: str = "write_config"
) -> Path:
    """Validates ``values`` (accelkit's keys) and writes them atomically; returns the path."""
    file = Path(os.fspath(path)).expanduser() if path is not None else default_config_path()
    given = {k: v for k, v in values.items() if v is not None}
    fields_ = _Fields("accelkit.write_config()", dict(given), {})
    state, launch = _from_accelkit(fields_)
    merged = {**launch, **state}
    order = [k for k in (*LAUNCH_KEYS, *Options.names()) if k in merged]
    out = {k: list(v) if isinstance(v := merged[k], tuple) else v for k in order}  # YAML lists, not tuples
    text = yaml_module().safe_dump(out, sort_keys=False, default_flow_style=False)
    header = f"# accelkit {__version__} config, written by {written_by}; edit freely, or rerun `accelkit config`.\n"
    _write_atomic(file, header + text)
    return file


def _write_atomic(file: Path, text: str) -> None:
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.", suffix=".tmp")
    except OSError as err:
        raise ConfigurationError(f"cannot write the config file {file}: {err}; choose another path") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the file from other users of a shared setup
        os.replace(tmp, file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def yaml_module() -> Any:
    """PyYAML, or an ImportError giving the install line."""
    try:
        import yaml  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        raise ImportError(f"reading or writing accelkit config files needs PyYAML: {_INSTALL}") from None
    return yaml


# --- reading YAML with line numbers -------------------------------------------------------------


def _read_yaml(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    yaml = yaml_module()
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


# --- checking values ----------------------------------------------------------------------------


class _Fields:
    """The keys of one mapping of a file, with typed getters whose errors say ``file:line: key``."""

    def __init__(self, origin: str, values: dict[str, Any], lines: Mapping[str, int], prefix: str = "") -> None:
        self.origin, self.values, self.lines, self.prefix = origin, values, lines, prefix
        self.ignored: list[str] = []
        self.notes: dict[str, str] = {}

    def nested(self, key: str) -> _Fields:
        value = self.get(key, (dict,), "a mapping of `key: value` lines", "{}") or {}
        sub = _Fields(self.origin, value, self.lines, f"{self.prefix}{key}.")
        sub.ignored, sub.notes = self.ignored, self.notes  # one report for the whole file
        return sub

    def error(self, key: str, message: str) -> ConfigurationError:
        name = self.prefix + key
        line = self.lines.get(name)
        return ConfigurationError(f"{self.origin}{f':{line}' if line else ''}: {name}: {message}")

    def check_known(self, known: Iterable[str]) -> None:
        known = list(known)
        for key in self.values:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
                hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(sorted(known))}"
                raise self.error(key, f"unknown key; {hint}")

    def ignore(self, key: str, note: str | None = None) -> None:
        if key in self.values:
            self.ignored.append(self.prefix + key)
            if note:
                self.notes[self.prefix + key] = note

    def get(self, key: str, types: tuple[type, ...], expected: str, example: str) -> Any:
        value = self.values.get(key)
        if value is None:
            return None
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise self.error(key, f"expected {expected}, found {value!r}; e.g. `{key}: {example}`")
        return value

    def flag(self, key: str) -> bool | None:
        return self.get(key, (bool,), "true or false", "true")  # type: ignore[no-any-return]

    def integer(self, key: str, low: int, high: int | None = None, example: int = 1) -> int | None:
        span = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"
        value = self.get(key, (int,), span, str(example))
        if value is not None and not (low <= value and (high is None or value <= high)):
            raise self.error(key, f"expected {span}, found {value!r}; e.g. `{key}: {example}`")
        return value  # type: ignore[no-any-return]

    def number(self, key: str, example: str) -> float | None:
        value = self.get(key, (int, float), "a positive number of seconds", example)
        if value is not None and not value > 0:
            raise self.error(key, f"expected a positive number of seconds, found {value!r}; e.g. `{key}: {example}`")
        return None if value is None else float(value)

    def text(self, key: str, example: str) -> str | None:
        return self.get(key, (str,), "a string", example)  # type: ignore[no-any-return]

    def choice(self, key: str, choices: Iterable[str], aliases: Mapping[object, str] | None = None) -> str | None:
        choices = tuple(choices)
        value = self.values.get(key)
        value = (aliases or {}).get(value, value) if isinstance(value, (str, bool, int)) else value
        if value is None or value in choices:
            return value
        close = difflib.get_close_matches(str(value), choices, n=1) if isinstance(value, str) else []
        hint = f"did you mean {close[0]!r}?" if close else f"e.g. `{key}: {choices[0]}`"
        raise self.error(key, f"expected one of {', '.join(map(repr, choices))}, found {value!r}; {hint}")


# YAML 1.1 reads a bare `no` as false: `precision: no` means the string.
_NO: dict[object, str] = {False: "no"}
# Keys only an Accelerate config has.
_ACCELERATE_MARKERS = {"compute_environment", "distributed_type", "mixed_precision", "num_machines", "machine_rank"}


def state_from(f: _Fields, checked: dict[str, object]) -> dict[str, object]:
    """Runs the options' own validation; a failure names the file and key."""
    try:
        return validate(checked, "config")
    except (ConfigurationError, TypeError) as err:
        key = next(iter(checked), "")
        raise f.error(key, str(err).split("): ", 1)[-1]) from None


def _from_accelkit(f: _Fields) -> tuple[dict[str, object], dict[str, object]]:
    f.check_known((*LAUNCH_KEYS, *Options.names()))
    checked: dict[str, object] = {
        "precision": f.choice("precision", PRECISIONS, _NO),
        "gradient_accumulation_steps": f.integer("gradient_accumulation_steps", 1),
        "debug": f.flag("debug"),
        "cpu": f.flag("cpu"),
        "backend": f.choice("backend", DIST_BACKENDS),
        "timeout": f.number("timeout", "600"),
        "strategy": f.choice("strategy", STRATEGIES),
        "fsdp_wrap": f.get("fsdp_wrap", (str, list), "class names (a list, or comma-separated)", "[Block]"),
        "fsdp_min_params": f.integer("fsdp_min_params", 0, example=1_000_000),
        "fsdp_reshard_after_forward": f.flag("fsdp_reshard_after_forward"),
        "fsdp_cpu_offload": f.flag("fsdp_cpu_offload"),
        "deepspeed_config": f.get("deepspeed_config", (str, dict), "a JSON file path or a mapping", "ds.json"),
    }
    state: dict[str, object] = {}
    for name, value in checked.items():
        if value is not None:
            state.update(state_from(f, {name: value}))
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
        "gpu_ids": gpu_ids(f, "gpu_ids"),
    }
    launch = {k: v for k, v in launch.items() if v is not None}
    check_node_rank(f, launch.get("node_rank"), launch.get("num_nodes"), "node_rank", "num_nodes")
    return state, launch


def gpu_ids(f: _Fields, key: str) -> str | None:
    """``all`` or comma-separated device indices, as a string."""
    value = f.values.get(key)
    if value is None:
        return None
    items = value if isinstance(value, list) else str(value).split(",")
    text = ",".join(str(i).strip() for i in items)
    if text != "all" and not all(i.isdigit() for i in text.split(",")):
        raise f.error(key, f"expected `all` or device indices like `0,1`, found {value!r}; e.g. `{key}: all`")
    return text


def check_node_rank(f: _Fields, rank: object, nodes: object, rank_key: str, nodes_key: str) -> None:
    if isinstance(rank, int) and rank >= (nodes if isinstance(nodes, int) else 1):
        raise f.error(rank_key, f"{rank} must be below {nodes_key} ({nodes or 1}); node ranks count from 0")


def json_text(config: Mapping[str, object]) -> str:
    return json.dumps(config, sort_keys=True)
