"""Entry points: ``@ak.distributed`` and ``ak.launch`` start workers, or just run inside one."""

from __future__ import annotations

import functools
import multiprocessing
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar, cast, overload

from typing_extensions import ParamSpec

from .. import _env, _frames, _state
from .._options import CODE_LAUNCH_NAMES, LaunchOptions, Options, StartMethod, is_int, validate
from ..errors import ConfigurationError

if TYPE_CHECKING:
    from typing_extensions import Unpack

P = ParamSpec("P")
R = TypeVar("R")

__all__ = ["distributed", "launch"]


@functools.cache
def _distributed_function() -> Any:
    """The class of what ``@ak.distributed`` returns: the function, keeping its signature and name
    (wrapt is imported where one is made)."""
    import wrapt

    class DistributedFunction(wrapt.FunctionWrapper):  # type: ignore[type-arg]
        pass

    return DistributedFunction


@overload
def distributed(fn: Callable[P, R], /) -> Callable[P, R]: ...
@overload
def distributed(
    num_processes: int | None = None, /, **options: Unpack[LaunchOptions]
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...
def distributed(fn: Any = None, /, **options: Any) -> Any:
    """Run the decorated function on every process of a job; return rank 0's value.

    Inside a worker a launcher started (torchrun, ``accelkit launch``, MPI, SLURM) the
    function just runs. Otherwise, with ``num_processes`` > 1 it starts that many workers
    per node on PyTorch's elastic agent, runs the function in each and returns rank 0's
    return value; a failing worker raises :class:`ak.WorkerError` after the others stopped.
    ``num_processes`` may be given positionally or by keyword; left out, it comes from the
    config file, else one process per GPU (one on a CPU-only machine).
    Call it under ``if __name__ == "__main__":`` (workers import the main module).

    Args:
        fn: the function to run; or the number of processes per node (``@ak.distributed(2)``).
        **options: ``num_processes`` (per node), the launch settings (``num_nodes``, ``node_rank``,
            ``master_addr``, ``master_port``, ``max_restarts``, ``start_method``) and the state options
            of :func:`init` (``precision``, ``cpu``, ...), each checked when the function is called.

    Example:
        >>> import accelkit as ak
        >>> @ak.distributed(num_processes=2, cpu=True)
        ... def world() -> int:
        ...     return ak.world_size()
        >>> world()  # doctest: +SKIP
        2
    """
    if fn is None or is_int(fn):
        if fn is not None:
            if options.get("num_processes") not in (None, fn):
                raise TypeError(
                    f"@accelkit.distributed({fn!r}, num_processes={options['num_processes']!r}): "
                    f"give num_processes once"
                )
            options["num_processes"] = fn
        given = _check_options(options, "accelkit.distributed")
        return lambda f: _wrap(f, given)
    if not callable(fn):
        raise TypeError(
            f"@accelkit.distributed expects a function or num_processes, got {fn!r}; "
            f"write @ak.distributed or @ak.distributed(num_processes=2)"
        )
    return _wrap(fn, {})


def launch(
    fn: Callable[..., R],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    **options: Unpack[LaunchOptions],
) -> R:
    """Call ``fn(*args, **kwargs)`` on every process, as a ``@ak.distributed`` function would.

    Takes the options of :func:`distributed`. Returns rank 0's return value (on a node other
    than node 0 of a multi-node launch, which has no rank 0: ``None``).

    In a notebook (an interactive ``__main__``) the workers are forked, so ``fn`` may be
    defined in a cell; each worker's prints reach the cell as whole lines while it runs.
    Before forking it refuses, with :class:`ak.StateError`, when CUDA or a
    ``torch.distributed`` process group already exists in this process: forked workers
    cannot use either. A world-size-1 accelkit state is simply reset. In debug mode
    (``debug=True`` or ``ACCELKIT_DEBUG=1``) a dry launch with the same options first
    checks that the workers start, form their process group and meet at a barrier.

    Args:
        fn: the function to run in every process.
        args: its positional arguments.
        kwargs: its keyword arguments.
        **options: those of :func:`distributed` (``num_processes``, ``precision``, ...).

    Example:
        >>> import accelkit as ak
        >>> ak.launch(print, ("hello",), num_processes=1)
        hello
    """
    if not callable(fn):
        raise TypeError(f"accelkit.launch(fn={fn!r}): fn must be callable, e.g. a function defined with def")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"accelkit.launch(args={args!r}): args must be a tuple, e.g. args=({args!r},)")
    given = _check_options(dict(options), "accelkit.launch")
    return _call(fn, tuple(args), dict(kwargs or {}), given)


def _wrap(fn: Callable[P, R], given: dict[str, Any]) -> Callable[P, R]:
    if not callable(fn):
        raise TypeError(f"@accelkit.distributed(...) must decorate a function, got {fn!r}")

    def wrapper(wrapped: Callable[..., R], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        if instance is None:  # the proxy is what spawned workers import by name
            target: Callable[..., R] = proxy
            return _call(target, args, kwargs, given, direct=wrapped)
        bound: Callable[..., R] = wrapped.__get__(instance)
        return _call(bound, args, kwargs, given, direct=bound)

    proxy = _distributed_function()(fn, wrapper)
    return cast("Callable[P, R]", proxy)


def _call(
    fn: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    given: dict[str, Any],
    direct: Callable[..., R] | None = None,
) -> R:
    run = direct or fn
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        _missing_main_guard(fn)  # a spawned worker runs the main script again: its launch is unguarded
    if _env.detect_launch().launcher != "none":  # a worker: the launcher started the processes
        return run(*args, **kwargs)  # the options arrived as ACCELKIT_* variables, set by the launcher
    call = "accelkit.launch" if direct is None else "accelkit.distributed"
    given = {**_parent_options(given, call), **given}
    from ._launch_plan import plan_launch  # the config files' merge: what a launching process needs

    plan = plan_launch(given, call=call)
    settings = plan.launch._replace(num_processes=plan.local_processes())
    if settings.num_processes == 1 and settings.num_nodes == 1:
        state_options = {k: v for k, v in given.items() if k in Options.names()}
        _state.configure(state_options, f"{call} at {_frames.call_site()}")
        return run(*args, **kwargs)
    settings = settings._replace(start_method=settings.start_method or _default_start_method())
    if settings.start_method == "fork":
        from ._notebook import refuse_unsafe_fork

        refuse_unsafe_fork(settings.world_size)
    if _state.is_initialized():
        # Workers build their own state; a live one here would be duplicated by fork.
        _state.reset_state()
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from ._agent import run_workers  # only the launching process needs it
    from ._spec import FunctionRef

    target: Any = (
        FunctionRef(fn.__module__, getattr(fn, "__qualname__", "")) if isinstance(fn, _distributed_function()) else fn
    )
    # Options given here are explicit in every worker: an ak.init there that differs is an error naming both.
    env = plan.worker_env()
    debug = bool(plan.options.get("debug"))  # ACCELKIT_DEBUG and the config file included
    try:
        if debug:
            from ._notebook import preflight_launch

            preflight_launch(settings, env)
        results = run_workers(target, args, kwargs, settings, env, quiet=not debug)
    except (KeyboardInterrupt, SignalException) as exc:  # Ctrl-C or kill: the agent stopped every worker
        _interrupted(exc)
    return cast("R", results.get(0))


def _parent_options(given: dict[str, Any], call: str) -> dict[str, Any]:
    """Options ``ak.init`` set in this process before the launch: they reach the workers too."""
    parent = _state.explicit_options()
    for name, value in parent.items():
        if name in given and given[name] != value:
            raise ConfigurationError(
                f"{call}({name}={given[name]!r}), but {name}={value!r} was set earlier in this process "
                f"({_state.get().origins.get(name, 'by a launcher flag')}); pass it in one place only"
            )
    return parent


def _missing_main_guard(fn: Any) -> NoReturn:
    """A spawned worker re-ran the script's unguarded launch while importing it: say so, in the summary too."""
    exc = RuntimeError(
        f"{_name(fn)} was called while a worker process was importing the main module; "
        f"call it under `if __name__ == '__main__':` so that workers do not run it again"
    )
    from .._rundir import record_failure

    record_failure(exc)
    raise exc


def _interrupted(exc: BaseException) -> NoReturn:
    """Interrupted (Ctrl-C, SIGTERM): end like ``accelkit launch`` does, not with the agent's traceback."""
    from ._failures import report_stop

    code = report_stop(exc)  # as `accelkit launch` says it
    main = sys.modules.get("__main__")
    if not getattr(main, "__file__", None):  # a notebook or a REPL: the interrupt reaches the cell
        raise KeyboardInterrupt from None
    raise SystemExit(code) from None


def _check_options(options: dict[str, Any], call: str) -> dict[str, Any]:
    """The options, validated (names and values); Nones dropped."""
    return validate(options, call, (*CODE_LAUNCH_NAMES, *Options.names()))


def _default_start_method() -> StartMethod:
    # A notebook's functions live in an interactive __main__ that spawned workers cannot import.
    main = sys.modules.get("__main__")
    return "spawn" if getattr(main, "__file__", None) else "fork"


def _name(fn: Any) -> str:
    return f"{getattr(fn, '__qualname__', repr(fn))}()"
