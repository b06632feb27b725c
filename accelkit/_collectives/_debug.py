"""Debug mode: before each collective the ranks compare what they are about to do.

Each rank describes its call (the operation, the arguments that must agree, and the
structure, dtypes and shapes of its input, or the error its input raised) and the
descriptions are exchanged in one small all-gather over the call's process group. Every
rank of it then reaches the same verdict from the same descriptions, so on a mismatch each
raises :class:`~accelkit.DistributedOperationError` with the same per-process table, instead
of hanging, aborting in the backend, or silently mixing up bytes.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import torch

from .. import _tree
from ..errors import DistributedOperationError
from . import _exchange

__all__ = ["check", "leaf_text"]

_RULES = {
    "gather": "every process must pass the same structure, dtypes and shapes; to gather tensors whose "
    "first dimension differs, pad them with accelkit.pad_across_processes(data) first, or use "
    "accelkit.gather_object",
    "pad_across_processes": "every process must pass the same structure and dtypes, with shapes that "
    "differ only along the padded dimension",
}


def check(
    device: torch.device,
    group: Any,
    ranks: Sequence[int],
    op: str,
    params: dict[str, Any],
    shapes: Sequence[tuple[torch.dtype, Sequence[int]]] | None = None,
    spec: _tree.TreeSpec | None = None,
    free_dim: int | None = None,
    problem: BaseException | None = None,
    seq: int = 0,
) -> None:
    """Exchange this rank's description of the call with the other ranks of ``group`` (``ranks``: their global
    ranks, in the group's order; None: every process); raise if they disagree.

    ``shapes``: the input's leaves as (dtype, shape). Every rank of the group must call it. With ``problem``
    (this rank's input was invalid) it returns after the exchange so that the caller raises its
    own error, while the other ranks raise a :class:`DistributedOperationError` that quotes it.
    ``seq`` (the call's number, when the caller knows it) tells ranks that are out of step.
    """
    mine = _describe(op, params, shapes, spec, free_dim, problem)
    mine["seq"] = seq
    blobs = _exchange.gather_bytes(pickle.dumps(mine), device, len(ranks), group)
    everyone: list[dict[str, Any]] = [_exchange.loads(b) for b in blobs]
    if problem is not None:
        return
    where = "" if group is None else f" over the process group of processes {', '.join(map(str, ranks))}"
    message = _verdict(op, everyone, spec, list(ranks), where)
    if message:
        raise DistributedOperationError(message)


def _describe(
    op: str,
    params: dict[str, Any],
    shapes: Sequence[tuple[torch.dtype, Sequence[int]]] | None,
    spec: _tree.TreeSpec | None,
    free_dim: int | None,
    problem: BaseException | None,
) -> dict[str, Any]:
    args = ", ".join(f"{k}={v!r}" for k, v in params.items())
    if problem is not None or shapes is None or spec is None:
        error = f"{type(problem).__name__}: {problem}" if problem is not None else None
        return {"op": op, "args": args, "structure": None, "key": (), "text": "", "error": error}
    texts = [leaf_text(dtype, size) for dtype, size in shapes]
    key = []
    for dtype, size in shapes:
        shape: list[int | None] = list(size)
        ndim = len(shape)
        if free_dim is not None and -ndim <= free_dim < ndim:
            shape[free_dim % ndim] = None  # free to differ across processes
        elif free_dim is not None:
            shape = [None]  # no such dim: the leaf comes back as it is, whatever its shape
        key.append((str(dtype), tuple(shape)))
    structure = _tree.describe(spec, ["*"] * len(shapes))
    return {"op": op, "args": args, "structure": structure, "key": tuple(key), "text": _tree.describe(spec, texts),
            "leaf_texts": texts, "error": None}  # fmt: skip


def leaf_text(dtype: torch.dtype, shape: Sequence[int]) -> str:
    """A tensor as the tables show it: ``float32 [2, 3]``."""
    return f"{str(dtype).removeprefix('torch.')} {list(shape)}"


def _verdict(op: str, everyone: list[dict[str, Any]], spec: _tree.TreeSpec | None, ranks: list[int], where: str) -> str:
    head = f"Cannot apply accelkit.{op}{where}"

    def _table(headline: str, rows: list[str], rule: str, extra: str = "") -> str:
        return _rows(headline, ranks, rows, rule, extra)

    if len({d["op"] for d in everyone}) > 1:
        return _table(
            f"{head}: the processes called different operations.",
            [f"accelkit.{d['op']}({d['args']}) {d['text']}".rstrip() for d in everyone],
            "every process must call the same collectives in the same order",
        )
    failed = [ranks[r] for r, d in enumerate(everyone) if d["error"]]
    if failed:
        names = ", ".join(map(str, failed))
        return _table(
            f"{head}: process {names} could not apply it to its input.",
            [d["error"] or d["text"] for d in everyone],
            f"make the input of process {names} valid; every process must pass valid, matching inputs",
        )
    if len({d["args"] for d in everyone}) > 1:
        return _table(
            f"{head}: the processes passed different arguments.",
            [f"accelkit.{d['op']}({d['args']}) {d['text']}".rstrip() for d in everyone],
            "every process must pass the same arguments",
        )
    if len({(d["structure"], d["key"]) for d in everyone}) > 1:
        return _table(
            f"{head}: the inputs differ across processes.",
            [d["text"] for d in everyone],
            _RULES.get(op, "every process must pass the same structure, dtypes and shapes") + _args(everyone[0]),
            _first_difference(everyone, spec, ranks),
        )
    seqs = {d.get("seq", 0) for d in everyone}
    if len(seqs) > 1:
        return _table(
            f"{head}: the processes are out of step: they make the same call, as different collectives of "
            f"their program.",
            [f"accelkit.{d['op']}({d['args']}) {d['text']} as call #{d.get('seq', 0)}".rstrip() for d in everyone],
            "every process must call the same collectives in the same order (a collective that only some "
            "processes called puts them out of step)",
        )
    return ""


def _first_difference(everyone: list[dict[str, Any]], spec: _tree.TreeSpec | None, ranks: list[int]) -> str:
    base, first_rank = everyone[0], ranks[0]
    for rank, d in zip(ranks[1:], everyone[1:], strict=True):
        if d["structure"] != base["structure"]:
            return (
                f"The structure differs: {base['structure']} on process {first_rank}, {d['structure']} on "
                f"process {rank}."
            )
        for i, (a, b) in enumerate(zip(base["key"], d["key"], strict=False)):
            if a != b and spec is not None and spec.kind != "leaf":
                path, first, other = _tree.leaf_paths(spec)[i], base["leaf_texts"][i], d["leaf_texts"][i]
                return f"First difference: {path} is {first} on process {first_rank}, {other} on process {rank}."
    return ""


def _args(description: dict[str, Any]) -> str:
    return f" ({description['args']})" if description["args"] else ""


def _rows(headline: str, ranks: list[int], rows: list[str], rule: str, extra: str) -> str:
    lines = [headline, *(f"  - Process {rank}: {row}" for rank, row in zip(ranks, rows, strict=True))]
    if extra:
        lines.append(extra)
    lines.append(f"Fix: {rule[0].upper()}{rule[1:]}.")
    return "\n".join(lines)
