"""Hypothesis strategies shared by the tests, and the builders that turn their draws into tensors.

A draw is a *blueprint*: a nested list/tuple/dict/namedtuple/dataclass whose leaves are
:class:`Leaf` (a dtype name and a shape). It is plain picklable data, so the test process
sends it to the workers, and every process can build every rank's tensors from the
blueprint, the rank and a shared seed with :func:`build` — the reference for a collective
is then computed from all ranks' inputs without any communication.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple
from typing import Any

import torch
from hypothesis import strategies as st

DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool")
FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")

Pair = namedtuple("Pair", ["first", "second"])


@dataclasses.dataclass
class Box:
    """A dataclass container, to check that dataclasses keep their type."""

    value: Any
    extra: Any


@dataclasses.dataclass(frozen=True)
class Leaf:
    """One tensor of a blueprint: its dtype (a torch attribute name) and shape."""

    dtype: str
    shape: tuple[int, ...]


def shapes(min_dims: int = 0, max_dims: int = 3, max_side: int = 4) -> st.SearchStrategy[tuple[int, ...]]:
    return st.lists(st.integers(0, max_side), min_size=min_dims, max_size=max_dims).map(tuple)


def leaves(dtypes: tuple[str, ...] = DTYPES, min_dims: int = 0) -> st.SearchStrategy[Leaf]:
    return st.builds(Leaf, st.sampled_from(dtypes), shapes(min_dims=min_dims))


def blueprints(leaf: st.SearchStrategy[Leaf] | None = None, max_leaves: int = 6) -> st.SearchStrategy[Any]:
    """A tensor alone, or a tree of them in every container type the collectives accept."""
    keys = st.text("abcxyz_", min_size=1, max_size=4)

    def containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.lists(children, min_size=1, max_size=3),
            st.lists(children, min_size=1, max_size=3).map(tuple),
            st.dictionaries(keys, children, min_size=1, max_size=3),
            st.dictionaries(keys, children, min_size=1, max_size=2).map(OrderedDict),
            st.builds(Pair, children, children),
            st.builds(Box, children, children),
        )

    return st.recursive(leaf if leaf is not None else leaves(), containers, max_leaves=max_leaves)


def objects() -> st.SearchStrategy[Any]:
    """Picklable Python objects, including ones larger than a first message (1 KiB)."""
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20))
    big = st.integers(1000, 5000).map(lambda n: "x" * n)
    return st.recursive(
        st.one_of(scalars, big),
        lambda children: st.one_of(
            st.lists(children, max_size=4), st.dictionaries(st.text(max_size=5), children, max_size=4)
        ),
        max_leaves=8,
    )


def build(blueprint: Any, rank: int, seed: int, vary_dim: int | None = None) -> Any:
    """Rank ``rank``'s input for ``blueprint``, deterministic in (blueprint, rank, seed).

    With ``vary_dim`` each leaf's size along that dimension depends on the rank (for
    ``pad_across_processes``); otherwise every rank gets the same shapes.
    """
    counter = iter(range(1_000_000))

    def make(leaf: Leaf) -> torch.Tensor:
        index = next(counter)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + index)
        shape = list(leaf.shape)
        if vary_dim is not None:
            shape[vary_dim] = int(torch.randint(0, 5, (1,), generator=gen))
        dtype = getattr(torch, leaf.dtype)
        if dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=gen).bool()
        if dtype.is_floating_point:
            return torch.randn(shape, generator=gen).to(dtype)
        low = 0 if dtype == torch.uint8 else -4
        return torch.randint(low, 5, shape, generator=gen).to(dtype)

    return _map_blueprint(blueprint, make)


def _map_blueprint(node: Any, make: Any) -> Any:
    if isinstance(node, Leaf):
        return make(node)
    if isinstance(node, Pair):
        return Pair(*(_map_blueprint(v, make) for v in node))
    if isinstance(node, Box):
        return Box(_map_blueprint(node.value, make), _map_blueprint(node.extra, make))
    if isinstance(node, (dict, OrderedDict)):
        return type(node)((k, _map_blueprint(v, make)) for k, v in node.items())
    return type(node)(_map_blueprint(v, make) for v in node)


def tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors of a tree built by :func:`build`, in :func:`rebuild` order."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Box):
        return tensors(tree.value) + tensors(tree.extra)
    values = tree.values() if isinstance(tree, dict) else tree
    return [t for v in values for t in tensors(v)]


def rebuild(blueprint: Any, values: list[torch.Tensor]) -> Any:
    """``blueprint``'s structure with ``values`` as its leaves (the expected result of a collective)."""
    it = iter(values)
    return _map_blueprint(blueprint, lambda leaf: next(it))
