"""The one precedence of settings: given (code or flags) > ``ACCELKIT_*`` > config file > default.

Used by the process state (``ak.init``, first use), ``@ak.distributed`` / ``ak.launch``,
``accelkit launch`` and ``accelkit test``, so that the same inputs give the same settings
everywhere; :class:`Resolved` also says where each value came from, for messages.
"""

from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, cast

from .. import _env, _frames
from .._options import LaunchSettings, Options, env_overrides, validate
from ..errors import ConfigurationError
from ._file import ConfigFile, config_in_effect

Source = Literal["code", "flag", "environment", "config", "default"]
_IN_EFFECT: Any = object()  # the config file in effect (ACCELKIT_CONFIG_FILE, else the default path)


class Resolved(NamedTuple):
    """Settings with their sources: ``sources[name]`` for every state option and launch setting."""

    options: Options
    launch: LaunchSettings
    sources: Mapping[str, Source]

    def given(self, *sources: Source) -> dict[str, object]:
        """The state options that came from ``sources`` (e.g. ``"config"``), by name."""
        return {n: getattr(self.options, n) for n in Options.names() if self.sources[n] in sources}


def resolve(
    given: Mapping[str, object] | None = None,
    *,
    call: str,
    source: Literal["code", "flag"] = "code",
    config: ConfigFile | None = _IN_EFFECT,
    env: Mapping[str, str] | None = None,
) -> Resolved:
    """Merge the layers; each is validated once, and errors name the layer's origin.

    ``given`` holds state options and launch settings by name (``None`` values mean unset).
    With ``source="code"``, an option that ``accelkit launch`` received as a flag (listed in
    ``ACCELKIT_LAUNCH_FLAGS``) must agree with the code: a conflict is an error naming both.

    Example:
        >>> r = resolve({"precision": "bf16"}, call="ak.init", config=None, env={})
        >>> r.options.precision, r.sources["precision"], r.sources["debug"]
        ('bf16', 'code', 'default')
    """
    names = (*Options.names(), *LaunchSettings.names())
    top = validate(dict(given or {}), call, names)
    file = config_in_effect() if config is _IN_EFFECT else config
    from_env = env_overrides(env)
    if source == "code":
        _check_flag_conflicts(top, from_env, call, env)
    layers: list[tuple[Source, Mapping[str, object]]] = [
        ("config", {**file.state, **file.launch} if file is not None else {}),
        ("environment", from_env),
        (source, top),
    ]
    merged: dict[str, object] = {}
    sources: dict[str, Source] = dict.fromkeys(names, "default")
    for origin, values in layers:
        merged.update(values)
        sources.update(dict.fromkeys(values, origin))
    for name in _env.launch_flags(env):  # `accelkit launch` flags reach the workers as variables
        if sources.get(name) == "environment":
            sources[name] = "flag"
    state = {k: v for k, v in merged.items() if k in Options.names()}
    launch = {k: v for k, v in merged.items() if k in LaunchSettings.names()}
    return Resolved(
        Options()._replace(**cast("dict[str, Any]", state)),
        LaunchSettings()._replace(**cast("dict[str, Any]", launch)),
        sources,
    )


def _check_flag_conflicts(
    given: Mapping[str, object], from_env: Mapping[str, object], call: str, env: Mapping[str, str] | None
) -> None:
    launcher = _env.read_str(_env.LAUNCHED_BY, env)
    for name in _env.launch_flags(env):
        if name in given and name in from_env and given[name] != from_env[name]:
            flag = "--" + name.replace("_", "-")
            by = f"{launcher}({name}={from_env[name]!r})" if launcher else f"`accelkit launch {flag}`"
            raise ConfigurationError(
                f"{name} is set twice with different values: {given[name]!r} in code ({call}({name}=...) "
                f"at {_frames.call_site()}) and {from_env[name]!r} by {by}. "
                f"Remove one of them (the command line is the usual place for per-run settings)."
            )
