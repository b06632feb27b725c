"""What ``ak.prepare`` returns, to a type checker: each object's own type, in the same order.

A prepared model, optimizer, scheduler or loader forwards what it does not define to the object
it wraps, so code written against ``torch.optim.AdamW`` keeps working on the prepared one; these
overloads say so (``model, opt, loader = ak.prepare(model, opt, loader)`` keeps the three types,
where the call used to be ``Any``). ``accelkit/__init__.py`` gives type checkers this signature;
at run time ``ak.prepare`` is :func:`accelkit.training.prepare`, which this delegates to.
"""

from __future__ import annotations

from typing import Any, TypeVar, overload

__all__ = ["prepare"]

A = TypeVar("A")
B = TypeVar("B")
C = TypeVar("C")
D = TypeVar("D")
E = TypeVar("E")
F = TypeVar("F")


@overload
def prepare(a: A, /, **options: Any) -> A: ...
@overload
def prepare(a: A, b: B, /, **options: Any) -> tuple[A, B]: ...
@overload
def prepare(a: A, b: B, c: C, /, **options: Any) -> tuple[A, B, C]: ...
@overload
def prepare(a: A, b: B, c: C, d: D, /, **options: Any) -> tuple[A, B, C, D]: ...
@overload
def prepare(a: A, b: B, c: C, d: D, e: E, /, **options: Any) -> tuple[A, B, C, D, E]: ...
@overload
def prepare(a: A, b: B, c: C, d: D, e: E, f: F, /, **options: Any) -> tuple[A, B, C, D, E, F]: ...
@overload
def prepare(*objects: Any, **options: Any) -> tuple[Any, ...]: ...
def prepare(*objects: Any, **options: Any) -> Any:
    """Make each object ready for this process; see :func:`accelkit.training.prepare`."""
    from .training import prepare as prepare_objects

    return prepare_objects(*objects, **options)
