"""``split_between_processes``: give each rank its contiguous slice of some inputs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

from . import _state

T = TypeVar("T")

__all__ = ["split_between_processes"]


@contextlib.contextmanager
def split_between_processes(inputs: T, apply_padding: bool = False) -> Iterator[T]:
    """Yield this rank's contiguous slice of ``inputs`` (in rank order).

    The first ``len % world_size`` ranks take one extra item, unless ``apply_padding`` evens
    the lengths out, so that results can be gathered.

    Args:
        inputs: a list, tuple, tensor (split on dim 0) or dict of equal-length values.
        apply_padding: give every rank the same length, padded with the last item.

    Example:
        >>> import accelkit as ak
        >>> with ak.split_between_processes(["a", "b", "c"]) as mine:
        ...     mine
        ['a', 'b', 'c']
    """
    st = _state.get()
    yield rank_slice(inputs, st.rank, st.world_size, apply_padding)


def rank_slice(inputs: T, rank: int, world_size: int, apply_padding: bool = False) -> T:
    """The slice ``split_between_processes`` yields on ``rank`` of ``world_size``."""
    if isinstance(inputs, Mapping):
        lengths = {k: _length(v) for k, v in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"accelkit.split_between_processes: the dict's values have different lengths "
                f"{lengths}; give every value the same length"
            )
        return type(inputs)({k: rank_slice(v, rank, world_size, apply_padding) for k, v in inputs.items()})  # type: ignore[call-arg]
    total = _length(inputs)
    base, extra = divmod(total, world_size)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    piece: Any = inputs[start:stop]  # type: ignore[index]
    if not apply_padding:
        return piece  # type: ignore[no-any-return]
    if total == 0:
        raise ValueError("accelkit.split_between_processes(apply_padding=True): nothing to pad an empty input with")
    missing = base + (1 if extra else 0) - (stop - start)
    if missing:
        last = inputs[-1:]  # type: ignore[index]
        if isinstance(piece, torch.Tensor):
            piece = torch.cat([piece, *([last] * missing)])
        else:
            piece = piece + type(piece)(last) * missing
    return piece  # type: ignore[no-any-return]


def _length(value: object) -> int:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError(
                "accelkit.split_between_processes cannot split a 0-d tensor; pass a tensor with a first dimension"
            )
        return value.shape[0]
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return len(value)
    raise TypeError(
        f"accelkit.split_between_processes cannot split {type(value).__name__} {value!r:.60}; "
        f"pass a list, tuple, tensor or dict of them"
    )
