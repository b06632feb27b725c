"""Writing accelkit's config file from Python: the notebook and script recipe.

``accelkit launch``, ``@ak.distributed`` and ``ak.init`` read the file; options given in code
or by ``ACCELKIT_*`` variables take precedence over it.
"""

from __future__ import annotations

import os
from pathlib import Path

from .._options import is_int, validate
from ..errors import ConfigurationError
from ._file import default_config_path, write_config

__all__ = ["CPU_PROCESSES", "proposed_num_processes", "write_basic_config"]

# Processes per machine proposed where there is no accelerator (or cpu=True): what the examples start,
# so that `accelkit test` after `accelkit config default` checks a real group, not one process.
CPU_PROCESSES = 2


def proposed_num_processes(accelerators: int, cpu: bool = False) -> int:
    """The processes per machine a config file gets by default: one per accelerator, else :data:`CPU_PROCESSES`.

    Example:
        >>> proposed_num_processes(0), proposed_num_processes(4), proposed_num_processes(4, cpu=True)
        (2, 4, 2)
    """
    return (0 if cpu else accelerators) or CPU_PROCESSES


def write_basic_config(
    precision: str = "no",
    config_file: str | os.PathLike[str] | None = None,
    *,
    num_processes: int | None = None,
    cpu: bool = False,
    overwrite: bool = False,
    written_by: str = "ak.write_basic_config",
) -> Path:
    """Writes a config file for this machine and returns its path.

    Args:
        precision: ``"no"``, ``"fp16"`` or ``"bf16"``.
        config_file: where to write; the default path
            (``${XDG_CONFIG_HOME:-~/.config}/accelkit/default_config.yaml``) when ``None``.
        num_processes: processes per machine; when ``None``, one per GPU (or other accelerator),
            else 2 CPU processes (also with ``cpu=True``), as the examples start.
        cpu: run on CPU even when GPUs are present.
        overwrite: replace an existing file (otherwise that is an error).
        written_by: what the file's header says wrote it.

    Example:
        >>> import tempfile, pathlib, accelkit as ak
        >>> target = pathlib.Path(tempfile.mkdtemp()) / "accelkit.yaml"
        >>> path = ak.write_basic_config("bf16", target, num_processes=2, cpu=True)
        >>> "precision: bf16" in path.read_text()
        True
    """
    call = "accelkit.write_basic_config"
    state = validate({"precision": precision, "cpu": cpu}, call)
    if num_processes is not None and (not is_int(num_processes) or num_processes < 1):
        raise ConfigurationError(
            f"{call}(num_processes={num_processes!r}): expected an integer >= 1 (processes per machine); "
            f"leave it out for one per GPU"
        )
    path = Path(os.fspath(config_file)).expanduser() if config_file is not None else default_config_path()
    if path.exists() and not overwrite:
        raise ConfigurationError(
            f"{call}(): the config file {str(path)!r} already exists; pass overwrite=True "
            f"(`accelkit config default --force`) to replace it, or choose another config_file"
        )
    if num_processes is None:
        from .._backends import accelerator_count  # imports torch: only when asked to count

        num_processes = proposed_num_processes(0 if cpu else accelerator_count(), cpu)
    values = {"num_processes": num_processes, "num_nodes": 1, **state, "gradient_accumulation_steps": 1}
    return write_config(values, path, written_by=written_by)
