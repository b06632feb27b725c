"""The config file (accelkit's own YAML or an Accelerate ``config.yaml``), writing one, and the
one precedence of settings: given > ``ACCELKIT_*`` > config file > default."""

from ._basic import proposed_num_processes, write_basic_config
from ._file import ConfigFile, config_in_effect, config_path, default_config_path, load_config, write_config
from ._resolve import Resolved, Source, resolve

__all__ = [
    "ConfigFile",
    "Resolved",
    "Source",
    "config_in_effect",
    "config_path",
    "default_config_path",
    "load_config",
    "proposed_num_processes",
    "resolve",
    "write_basic_config",
    "write_config",
]
