"""Entry points: ``@ak.distributed`` and ``ak.launch`` start workers, or just run inside one."""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar, cast, overload

import wrapt
from typing_extensions import ParamSpec

from .. import _env, _state
from .._options import Options, validate
from ..errors import ConfigurationError

P = ParamSpec("P")
R = TypeVar("R")

__all__ = ["distributed", "launch"]


@dataclass(frozen=True)
class LaunchOptions:
    """How many workers to start and where; validated when built."""

    num_processes: int | None = None
    num_nodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    max_restarts: int = 0
    start_method: str | None = None

    def __post_init__(self) -> None:
        call = "accelkit.distributed"
        if self.num_processes is not None and (not _is_int(self.num_processes) or self.num_processes < 1):
            raise ConfigurationError(
                f"{call}(num_processes={self.num_processes!r}): expected a positive number of "
                f"processes per node; use 1 to run in this process, 2 or more to start workers"
            )
        if not _is_int(self.num_nodes) or self.num_nodes < 1:
            raise ConfigurationError(f"{call}(num_nodes={self.num_nodes!r}): expected an integer >= 1")
        if not _is_int(self.node_rank) or not 0 <= self.node_rank < self.num_nodes:
            raise ConfigurationError(
                f"{call}(node_rank={self.node_rank!r}): expected 0 <= node_rank < num_nodes={self.num_nodes}"
            )
        if self.master_port is not None and (not _is_int(self.master_port) or not 0 < self.master_port < 65536):
            raise ConfigurationError(f"{call}(master_port={self.master_port!r}): expected a TCP port in 1..65535")
        if self.num_nodes > 1 and self.master_port is None:
            raise ConfigurationError(
                f"{call}(num_nodes={self.num_nodes}) needs master_port: every node must meet at "
                f"the same master_addr:master_port, e.g. master_port=29500"
            )
        if not _is_int(self.max_restarts) or self.max_restarts < 0:
            raise ConfigurationError(f"{call}(max_restarts={self.max_restarts!r}): expected an integer >= 0")
        methods = multiprocessing.get_all_start_methods()
        if self.start_method is not None and self.start_method not in methods:
            raise ConfigurationError(f"{call}(start_method={self.start_method!r}): expected one of {methods}")


class _DistributedFunction(wrapt.FunctionWrapper):  # type: ignore[type-arg]
    """What ``@ak.distributed`` returns: the function, keeping its signature and name."""


@overload
def distributed(fn: Callable[P, R], /) -> Callable[P, R]: ...
@overload
def distributed(
    num_processes: int | None = None,
    /,
    *,
    num_nodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    max_restarts: int = 0,
    precision: str | None = None,
    gradient_accumulation_steps: int | None = None,
    debug: bool | None = None,
    cpu: bool | None = None,
    backend: str | None = None,
    timeout: float | None = None,
    start_method: str | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...
def distributed(fn: Any = None, /, **options: Any) -> Any:
    """Run the decorated function on every process of a job; return rank 0's value.

    Inside a worker a launcher started (torchrun, ``accelkit launch``, MPI, SLURM) the
    function just runs. Otherwise, with ``num_processes`` > 1 it starts that many workers
    per node on PyTorch's elastic agent, runs the function in each and returns rank 0's
    return value; a failing worker raises :class:`ak.WorkerError` after the others stopped.
    Call it under ``if __name__ == "__main__":`` (workers import the main module).

    Example:
        >>> import accelkit as ak
        >>> @ak.distributed(num_processes=2, cpu=True)
        ... def world() -> int:
        ...     return ak.world_size()
        >>> world()  # doctest: +SKIP
        2
    """
    if fn is None or _is_int(fn):
        if fn is not None:
            options["num_processes"] = fn
        launch_options, state_options = _split_options(options, "accelkit.distributed")
        return lambda f: _wrap(f, launch_options, state_options)
    if not callable(fn):
        raise TypeError(
            f"@accelkit.distributed expects a function or num_processes, got {fn!r}; "
            f"write @ak.distributed or @ak.distributed(num_processes=2)"
        )
    return _wrap(fn, LaunchOptions(), {})


def launch(
    fn: Callable[..., R],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> R | None:
    """Call ``fn(*args, **kwargs)`` on every process, as a ``@ak.distributed`` function would.

    Takes the options of :func:`distributed`. Returns rank 0's return value.

    In a notebook (an interactive ``__main__``) the workers are forked, so ``fn`` may be
    defined in a cell; each worker's prints reach the cell as whole lines while it runs.
    Before forking it refuses, with :class:`ak.StateError`, when CUDA or a
    ``torch.distributed`` process group already exists in this process: forked workers
    cannot use either. A world-size-1 accelkit state is simply reset. In debug mode
    (``debug=True`` or ``ACCELKIT_DEBUG=1``) a dry launch with the same options first
    checks that the workers start, form their process group and meet at a barrier.

    Example:
        >>> import accelkit as ak
        >>> ak.launch(print, ("hello",), num_processes=1)
        hello
    """
    if not callable(fn):
        raise TypeError(f"accelkit.launch(fn={fn!r}): fn must be callable, e.g. a function defined with def")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"accelkit.launch(args={args!r}): args must be a tuple, e.g. args=({args!r},)")
    launch_options, state_options = _split_options(options, "accelkit.launch")
    return _call(fn, tuple(args), dict(kwargs or {}), launch_options, state_options)


def _wrap(fn: Callable[P, R], launch_options: LaunchOptions, state_options: dict[str, Any]) -> Callable[P, R]:
    if not callable(fn):
        raise TypeError(f"@accelkit.distributed(...) must decorate a function, got {fn!r}")

    def wrapper(wrapped: Callable[..., R], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R | None:
        target: Any = proxy if instance is None else wrapped.__get__(instance)
        return _call(
            target, args, kwargs, launch_options, state_options, direct=wrapped if instance is None else target
        )

    proxy = _DistributedFunction(fn, wrapper)
    return cast("Callable[P, R]", proxy)


def _call(
    fn: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    launch_options: LaunchOptions,
    state_options: dict[str, Any],
    direct: Callable[..., R] | None = None,
) -> R | None:
    run = direct or fn
    if _env.detect_launch().launcher != "none" or (launch_options.num_processes == 1 and launch_options.num_nodes == 1):
        _state.init(**state_options)
        return run(*args, **kwargs)
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            f"{_name(fn)} was called while a worker process was importing the main module; "
            f"call it under `if __name__ == '__main__':` so that workers do not run it again"
        )
    num_processes = launch_options.num_processes or _default_num_processes(state_options)
    if num_processes == 1 and launch_options.num_nodes == 1:
        _state.init(**state_options)
        return run(*args, **kwargs)
    start_method = launch_options.start_method or _default_start_method()
    if start_method == "fork":
        from ._notebook import refuse_unsafe_fork

        refuse_unsafe_fork(num_processes * launch_options.num_nodes)
    if _state.is_initialized():
        # Workers build their own state; a live one here would be duplicated by fork.
        _state.reset_state()
    from ._agent import AgentConfig, FunctionRef, run_workers  # only the launching process needs it

    debug = Options.resolve(state_options, "accelkit.launch").debug  # ACCELKIT_DEBUG included

    target: Any = (
        FunctionRef(fn.__module__, getattr(fn, "__qualname__", "")) if isinstance(fn, _DistributedFunction) else fn
    )
    config = AgentConfig(
        num_processes=num_processes,
        num_nodes=launch_options.num_nodes,
        node_rank=launch_options.node_rank,
        master_addr=launch_options.master_addr,
        master_port=launch_options.master_port,
        max_restarts=launch_options.max_restarts,
        start_method=start_method,
        quiet=not debug,
    )
    env = _env.option_env(state_options)
    if debug:
        from ._notebook import preflight_launch

        preflight_launch(config, env)
    results = run_workers(target, args, kwargs, config, env)
    return results.get(0)


def _split_options(options: dict[str, Any], call: str) -> tuple[LaunchOptions, dict[str, Any]]:
    launch_names = set(asdict(LaunchOptions()))
    state_options = {k: v for k, v in options.items() if k not in launch_names and v is not None}
    launch_kw = {k: v for k, v in options.items() if k in launch_names}
    unknown = [k for k in state_options if k not in Options.names()]
    if unknown:
        valid = sorted(launch_names | set(Options.names()))
        raise TypeError(f"{call}() got an unexpected option {unknown[0]!r}; valid options: {', '.join(valid)}")
    return LaunchOptions(**launch_kw), validate(state_options, call)


def _default_num_processes(state_options: dict[str, Any]) -> int:
    if state_options.get("cpu") or _env.read_bool(_env.CPU):
        return 1
    import torch

    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def _default_start_method() -> str:
    # A notebook's functions live in an interactive __main__ that spawned workers cannot import.
    main = sys.modules.get("__main__")
    return "spawn" if getattr(main, "__file__", None) else "fork"


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__qualname__', repr(fn))}()"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
