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

__all__ = ["TreeSpec", "apply_to_tensors", "describe", "flatten", "leaf_paths", "map_tensors", "signature", "structure",
           "unflatten"]  # fmt: skip


class TreeSpec(NamedTuple):
    """How to rebuild a tree from its leaves, which come in :func:`flatten` order."""

    kind: str  # "leaf", "list", "tuple", "namedtuple", "mapping" or "dataclass"
    type: type | None = None
    keys: tuple[Any, ...] = ()  # mapping keys / field names, in flatten order
    children: tuple[TreeSpec, ...] = ()
    template: Any = None  # mapping: its keys in their original order; dataclass: the instance (_Instance)

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
    try:
        return leaves, _flatten(data, leaves)
    except _NotATensor:  # the walk again, naming the paths this time (only a failing call pays for them)
        path, bad = _first_not_a_tensor(data, root)
        raise TypeError(
            f"{call}: {path} is {type(bad).__name__} {bad!r:.80}, not a tensor. Pass a tensor or a "
            f"list/tuple/dict/namedtuple/dataclass of tensors (convert numbers with torch.tensor(...)); "
            f"for arbitrary Python objects use accelkit.gather_object or accelkit.broadcast_object."
        ) from None


class _NotATensor(Exception):
    pass


def _flatten(x: Any, leaves: list[torch.Tensor]) -> TreeSpec:
    kind = type(x)
    if kind is dict:  # the common containers first, by their type alone (an isinstance of Mapping is slow)
        return _mapping(x, kind, leaves)
    if isinstance(x, torch.Tensor):
        leaves.append(x)
        return LEAF
    if kind is list or kind is tuple or isinstance(x, (list, tuple)):
        children = tuple([_flatten(v, leaves) for v in x])
        if kind is list or kind is tuple:
            return TreeSpec("list" if kind is list else "tuple", kind, children=children)
        if getattr(kind, "_fields", None) is not None:  # a namedtuple
            return TreeSpec("namedtuple", kind, children=children)
        return TreeSpec("list" if isinstance(x, list) else "tuple", kind, children=children)
    if isinstance(x, Mapping):
        return _mapping(x, kind, leaves)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        names = tuple(f.name for f in dataclasses.fields(x) if f.init)
        children = tuple([_flatten(getattr(x, n), leaves) for n in names])
        return TreeSpec("dataclass", kind, names, children, _Instance(kind, x))
    raise _NotATensor


class _Instance:
    """A dataclass instance as its spec's template: equal to any instance of the same class (the tree's structure
    is in the spec's fields and children), so that every spec is hashable and compares as its structure does."""

    __slots__ = ("cls", "value")

    def __init__(self, cls: type, value: Any) -> None:
        self.cls, self.value = cls, value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Instance) and other.cls is self.cls

    def __hash__(self) -> int:
        return hash(self.cls)


def structure(spec: TreeSpec) -> TreeSpec:
    """``spec`` as a key to keep: equal to it, without the dataclass instances it was made from (their tensors)."""
    if spec.kind == "leaf":
        return spec
    children = tuple([structure(c) for c in spec.children])
    template = spec.template
    if spec.kind == "dataclass":
        template = _Instance(spec.template.cls, None)
    elif all(mine is theirs for mine, theirs in zip(children, spec.children, strict=True)):
        return spec
    return spec._replace(children=children, template=template)


def _mapping(x: Mapping[Any, Any], kind: type, leaves: list[torch.Tensor]) -> TreeSpec:
    order = tuple(x)
    keys = _flatten_order(order)
    children = tuple([_flatten(x[k], leaves) for k in keys])
    template = (order, x.default_factory) if isinstance(x, defaultdict) else (order,)
    return TreeSpec("mapping", kind, keys, children, template)


def _flatten_order(order: tuple[Any, ...]) -> tuple[Any, ...]:
    """A mapping's keys in flatten order: sorted, or the mapping's own order where they do not sort (mixed types)."""
    try:
        return tuple(sorted(order))
    except TypeError:
        return order


def _first_not_a_tensor(x: Any, path: str) -> tuple[str, Any]:
    """The path of the first leaf of ``x`` that is no tensor, in :func:`flatten`'s order, and that leaf."""
    if isinstance(x, torch.Tensor):
        return "", None
    if isinstance(x, (list, tuple)):
        fields = getattr(type(x), "_fields", None)
        parts = [f".{f}" for f in fields] if fields is not None else [f"[{i}]" for i in range(len(x))]
        children = list(zip(parts, x, strict=False))
    elif isinstance(x, Mapping):
        children = [(f"[{k!r}]", x[k]) for k in _flatten_order(tuple(x))]
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        children = [(f".{f.name}", getattr(x, f.name)) for f in dataclasses.fields(x) if f.init]
    else:
        return path, x
    for part, child in children:
        found = _first_not_a_tensor(child, path + part)
        if found[0]:
            return found
    return "", None


def unflatten(spec: TreeSpec, leaves: list[torch.Tensor]) -> Any:
    """Rebuild the tree ``spec`` describes, with ``leaves`` in flatten order."""
    if spec.kind == "leaf":
        return leaves[0]
    it = iter(leaves)
    return _build(spec, it)


def _build(spec: TreeSpec, it: Any) -> Any:
    kind = spec.kind
    if kind == "leaf":
        return next(it)
    values = [next(it) if c is LEAF else _build(c, it) for c in spec.children]
    cls: Any = spec.type
    if kind == "mapping":
        keys, order = spec.keys, spec.template[0]
        items = dict(zip(keys, values, strict=True))
        if keys != order:  # the user's own order of keys
            items = {k: items[k] for k in order}
        if cls is dict:
            return items
        return cls(spec.template[1], items) if len(spec.template) > 1 else cls(items)
    if kind == "namedtuple":
        return cls(*values)
    if kind in ("list", "tuple"):
        return values if cls is list else tuple(values) if cls is tuple else cls(values)
    return dataclasses.replace(spec.template.value, **dict(zip(spec.keys, values, strict=True)))


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
