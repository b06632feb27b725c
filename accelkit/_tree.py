"""Trees of tensors: flatten nested containers to a list of leaves, and rebuild them.

A tree is a tensor, or a list / tuple / namedtuple / mapping (dict, OrderedDict,
defaultdict, ``UserDict``-like) / dataclass instance whose values are trees. Every
collective flattens its input once, moves the leaves, and rebuilds the same structure
with the same container types. ``gather_for_metrics`` trims gathered leaves with
:func:`map_tensors`.

Mapping keys are visited in sorted order when they sort (the original order is kept
in the output): two processes that built the same dict in a different order (string
hashing differs between processes) still line up leaf for leaf.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

import torch

T = TypeVar("T")

__all__ = ["TreeSpec", "apply_to_tensors", "describe", "flatten", "leaf_paths", "map_tensors", "signature", "unflatten"]


class TreeSpec(NamedTuple):
    """How to rebuild a tree from its leaves, which come in :func:`flatten` order."""

    kind: str  # "leaf", "list", "tuple", "namedtuple", "mapping" or "dataclass"
    type: type | None = None
    keys: tuple[Any, ...] = ()  # mapping keys / field names, in flatten order
    children: tuple[TreeSpec, ...] = ()
    template: Any = None  # mapping: its keys in their original order; dataclass: the instance

    @property
    def num_leaves(self) -> int:
        return 1 if self.kind == "leaf" else sum(c.num_leaves for c in self.children)


LEAF = TreeSpec("leaf")


def flatten(data: Any, call: str, root: str = "data") -> tuple[list[torch.Tensor], TreeSpec]:
    """The tensors of ``data`` in a fixed order, and the spec that rebuilds it.

    Raises:
        TypeError: a leaf is not a tensor; the message names its path, e.g.
            ``data['labels'][2]``, and the ``call`` that received it.
    """
    if isinstance(data, torch.Tensor):  # the common case, kept cheap
        return [data], LEAF
    leaves: list[torch.Tensor] = []
    return leaves, _flatten(data, leaves, call, root)


def _flatten(x: Any, leaves: list[torch.Tensor], call: str, path: str) -> TreeSpec:
    if isinstance(x, torch.Tensor):
        leaves.append(x)
        return LEAF
    if isinstance(x, (list, tuple)):
        fields = getattr(type(x), "_fields", None)
        if fields is not None:  # a namedtuple: name the field in paths
            children = tuple(_flatten(v, leaves, call, f"{path}.{f}") for f, v in zip(fields, x, strict=True))
            return TreeSpec("namedtuple", type(x), children=children)
        children = tuple(_flatten(v, leaves, call, f"{path}[{i}]") for i, v in enumerate(x))
        return TreeSpec("list" if isinstance(x, list) else "tuple", type(x), children=children)
    if isinstance(x, Mapping):
        order = tuple(x)
        try:
            keys = tuple(sorted(order))
        except TypeError:  # keys of mixed types: keep the mapping's own order
            keys = order
        children = tuple(_flatten(x[k], leaves, call, f"{path}[{k!r}]") for k in keys)
        template = (order, x.default_factory) if isinstance(x, defaultdict) else (order,)
        return TreeSpec("mapping", type(x), keys, children, template)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        names = tuple(f.name for f in dataclasses.fields(x) if f.init)
        children = tuple(_flatten(getattr(x, n), leaves, call, f"{path}.{n}") for n in names)
        return TreeSpec("dataclass", type(x), names, children, x)
    raise TypeError(
        f"{call}: {path} is {type(x).__name__} {x!r:.80}, not a tensor. Pass a tensor or a "
        f"list/tuple/dict/namedtuple/dataclass of tensors (convert numbers with torch.tensor(...)); "
        f"for arbitrary Python objects use accelkit.gather_object or accelkit.broadcast_object."
    )


def unflatten(spec: TreeSpec, leaves: list[torch.Tensor]) -> Any:
    """Rebuild the tree ``spec`` describes, with ``leaves`` in flatten order."""
    if spec.kind == "leaf":
        return leaves[0]
    it = iter(leaves)
    return _build(spec, it)


def _build(spec: TreeSpec, it: Any) -> Any:
    if spec.kind == "leaf":
        return next(it)
    values = [_build(c, it) for c in spec.children]
    cls: Any = spec.type
    if spec.kind == "namedtuple":
        return cls(*values)
    if spec.kind in ("list", "tuple"):
        return values if cls is list else tuple(values) if cls is tuple else cls(values)
    if spec.kind == "mapping":
        by_key = dict(zip(spec.keys, values, strict=True))
        items = {k: by_key[k] for k in spec.template[0]}
        if cls is dict:
            return items
        return cls(spec.template[1], items) if len(spec.template) > 1 else cls(items)
    return dataclasses.replace(spec.template, **dict(zip(spec.keys, values, strict=True)))


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], data: T, call: str) -> T:
    """``data`` with ``fn`` applied to every tensor, same structure and container types."""
    leaves, spec = flatten(data, call)
    return unflatten(spec, [fn(t) for t in leaves])  # type: ignore[no-any-return]


def apply_to_tensors(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """``data`` with ``fn`` applied to the tensors in its dicts, lists, tuples and namedtuples.

    Unlike :func:`map_tensors`, any other leaf (a string, ``None``, a custom object) passes
    through unchanged: for batches and model outputs, which may hold more than tensors.
    """
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, Mapping):
        moved = {k: apply_to_tensors(fn, v) for k, v in data.items()}
        cls: Any = type(data)
        try:
            return cls(moved)
        except TypeError:  # e.g. a defaultdict, which wants its factory first
            return moved
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(apply_to_tensors(fn, v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(apply_to_tensors(fn, v) for v in data)
    return data


def leaf_paths(spec: TreeSpec, root: str = "data") -> list[str]:
    """Each leaf's path (``data['x'][0]``), in flatten order; for error messages."""
    if spec.kind == "leaf":
        return [root]
    paths: list[str] = []
    for key, child in zip(_keys(spec), spec.children, strict=True):
        part = f".{key}" if spec.kind in ("namedtuple", "dataclass") else f"[{key!r}]"
        paths.extend(leaf_paths(child, root + part))
    return paths


def signature(spec: TreeSpec) -> tuple[Any, ...]:
    """The tree's shape without its leaves, as a hashable tuple: equal for equal structures.

    Example:
        >>> signature(flatten({"x": torch.zeros(1)}, "doc")[1])
        ('mapping', 'dict', ('x',), (('leaf',),))
    """
    if spec.kind == "leaf":
        return ("leaf",)
    name = getattr(spec.type, "__qualname__", "?")
    return (spec.kind, name, spec.keys, tuple(signature(c) for c in spec.children))


def describe(spec: TreeSpec, leaves: list[str]) -> str:
    """The tree as text with each leaf replaced by its text, e.g. ``{'x': float32 [2, 3]}``."""
    return _describe(spec, iter(leaves))


def _describe(spec: TreeSpec, it: Any) -> str:
    if spec.kind == "leaf":
        return str(next(it))
    parts = [_describe(c, it) for c in spec.children]
    name = getattr(spec.type, "__name__", "?")
    if spec.kind in ("namedtuple", "dataclass"):
        return f"{name}({', '.join(f'{k}={p}' for k, p in zip(_keys(spec), parts, strict=True))})"
    if spec.kind == "mapping":
        body = "{" + ", ".join(f"{k!r}: {p}" for k, p in zip(spec.keys, parts, strict=True)) + "}"
        return body if spec.type is dict else f"{name}({body})"
    body = ", ".join(parts) + ("," if len(parts) == 1 and spec.kind == "tuple" else "")
    if spec.kind == "list":
        return f"[{body}]" if spec.type is list else f"{name}([{body}])"
    return f"({body})" if spec.type is tuple else f"{name}(({body}))"


def _keys(spec: TreeSpec) -> tuple[Any, ...]:
    if spec.kind == "namedtuple":
        return tuple(spec.type._fields)  # type: ignore[union-attr]
    return spec.keys if spec.kind in ("mapping", "dataclass") else tuple(range(len(spec.children)))
