"""The config file: accelkit's own YAML or an Accelerate ``config.yaml``, and writing one."""

from ._basic import write_basic_config
from ._file import ConfigFile, config_path, default_config_path, load_config, write_config

__all__ = ["ConfigFile", "config_path", "default_config_path", "load_config", "write_basic_config", "write_config"]
