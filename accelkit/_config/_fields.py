"""Reading the keys of a config file: typed getters whose errors say ``file:line: key``, and the key tables.

Shared by accelkit's own format (:mod:`._file`) and Accelerate's (:mod:`._accelerate`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from .._options import LaunchSettings, suggest, validate
from ..errors import ConfigurationError

# Launch settings under the names the files use (Accelerate's, and `accelkit launch`'s flags).
FILE_NAMES = {"master_addr": "main_process_ip", "master_port": "main_process_port"}
LAUNCH_KEYS: tuple[str, ...] = tuple(FILE_NAMES.get(n, n) for n in LaunchSettings.names() if n != "start_method")
# YAML 1.1 reads a bare `no` as false: `precision: no` means the string.
NO_ALIAS: dict[object, str] = {False: "no"}


class Fields:
    """The keys of one mapping of a file, with typed getters whose errors say ``file:line: key``."""

    def __init__(self, origin: str, values: dict[str, Any], lines: Mapping[str, int], prefix: str = "") -> None:
        self.origin, self.values, self.lines, self.prefix = origin, values, lines, prefix
        self.ignored: list[str] = []
        self.notes: dict[str, str] = {}

    def nested(self, key: str) -> Fields:
        value = self.get(key, (dict,), "a mapping of `key: value` lines", "{}") or {}
        sub = Fields(self.origin, value, self.lines, f"{self.prefix}{key}.")
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
                hint = suggest(key, known)[2:] or f"valid keys: {', '.join(sorted(known))}"
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

    def choice(
        self,
        key: str,
        choices: Iterable[str],
        aliases: Mapping[object, str] | None = None,
        refused: Mapping[object, str] | None = None,
    ) -> str | None:
        """``key``'s value, one of ``choices``; ``refused``: values that cannot run, and what each needs."""
        choices = tuple(choices)
        value = self.values.get(key)
        value = (aliases or {}).get(value, value) if isinstance(value, (str, bool, int)) else value
        if value is None or value in choices:
            return value
        why = (refused or {}).get(value) if isinstance(value, str) else None
        hint = why or suggest(value, choices)[2:] or f"e.g. `{key}: {choices[0]}`"
        raise self.error(key, f"expected one of {', '.join(map(repr, choices))}, found {value!r}; {hint}")

    def gpu_ids(self, key: str) -> str | None:
        """``all`` or comma-separated device indices, as a string."""
        value = self.values.get(key)
        if value is None:
            return None
        try:
            return validate({"gpu_ids": value}, "config", LaunchSettings.names())["gpu_ids"]  # type: ignore[return-value]
        except ConfigurationError:
            expected = f"expected `all` or device indices like `0,1`, found {value!r}; e.g. `{key}: all`"
            raise self.error(key, expected) from None

    def state(self, checked: Mapping[str, object]) -> dict[str, object]:
        """State options through their own validation; a failure names the file and key."""
        out: dict[str, object] = {}
        for name, value in checked.items():
            try:
                out.update(validate({name: value}, "config"))
            except (ConfigurationError, TypeError) as err:
                raise self.error(name, str(err).split("): ", 1)[-1]) from None
        return out


def json_text(config: Mapping[str, object]) -> str:
    return json.dumps(config, sort_keys=True)
