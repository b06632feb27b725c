"""Random programs of collectives on 2 and 4 gloo processes, each call against raw torch.distributed.

A program is a list of steps drawn by hypothesis, the same on every rank: a collective, the process
group it runs over (every process; on 4 processes also this rank's row or column of a 2 x 2 mesh), a
tree of tensors (every dtype, 0-d to 3-d, empty, transposed, offset views, stride-0 views, tensors
that require grad, conjugate views, RNG states) and, now and then, a call that every rank makes with
an invalid argument. Each rank builds its own inputs from the step, its rank and a seed, and checks
every result against the same job done with raw torch.distributed in the same group: bit-identical
values, the same dtype and shape, storage of its own (no offset, no extra bytes, shared with no
input and no other result), no autograd history, inputs untouched, and refused calls refused on
every rank without disturbing the calls after them. Values are small integers, so that sums come
out the same in any order of the ranks (4 processes) and a bit-for-bit comparison is fair. Each
program runs twice, so that its calls also travel in the messages planned from the first run. The
same programs run over the device wire too (compared "on the device", each verdict read at the next
collective), here on the CPU.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import pickle
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from meshes import row_and_column

import accelkit as ak
from accelkit.testing import WorkerPool

DTYPES = ("float32", "float64", "float16", "bfloat16", "complex64", "complex128", "int8", "uint8", "int16",
          "int32", "int64", "bool", "float8_e4m3fn")  # fmt: skip
LAYOUTS = ("contiguous", "transposed", "offset", "expanded", "grad", "conj")
OPS = ("gather", "reduce", "broadcast", "pad_across_processes")
REDUCE_OPS = ("sum", "mean", "max", "min", "product")
REFUSALS = ("mean of integers", "unknown op", "not a tensor", "complex max")


@dataclasses.dataclass(frozen=True)
class Leaf:
    dtype: str
    shape: tuple[int, ...]
    layout: str


@dataclasses.dataclass(frozen=True)
class Step:
    op: str  # a collective, "rng state" (a generator's state broadcast and set), or "refuse"
    tree: Any  # a Leaf, or a list / dict of them
    arg: Any  # reduce's op, broadcast's src (its index in the group), pad's dim, or the refusal
    group: str = "world"  # "world", or this rank's "row" or "column" of a 2 x 2 mesh


def _leaves(draw_dtypes: tuple[str, ...] = DTYPES) -> st.SearchStrategy[Leaf]:
    shape = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
    return st.builds(Leaf, st.sampled_from(draw_dtypes), shape, st.sampled_from(LAYOUTS))


def _trees() -> st.SearchStrategy[Any]:
    leaf = _leaves()
    return st.one_of(
        leaf,
        st.lists(leaf, min_size=1, max_size=3),
        st.dictionaries(st.sampled_from("abcde"), leaf, min_size=1, max_size=3),
        st.dictionaries(st.sampled_from("xy"), st.lists(leaf, min_size=1, max_size=2), min_size=1, max_size=2),
    )


@st.composite
def _steps(draw: Any, world: int, groups: tuple[str, ...] = ("world",)) -> Step:
    kind = draw(st.sampled_from((*OPS, *OPS, "rng state", "refuse")))
    tree = draw(_trees())
    group = draw(st.sampled_from(groups))
    size = world if group == "world" else 2
    if kind == "reduce":
        return Step(kind, tree, draw(st.sampled_from(REDUCE_OPS)), group)
    if kind in ("broadcast", "rng state"):
        return Step(kind, tree, draw(st.integers(0, size - 1)), group)
    if kind == "pad_across_processes":
        return Step(kind, tree, draw(st.integers(-2, 2)), group)
    if kind == "refuse":
        return Step(kind, tree, draw(st.sampled_from(REFUSALS)), group)
    return Step(kind, tree, None, group)


def _build(leaf: Leaf, rank: int, seed: int, index: int, vary: int | None = None) -> torch.Tensor:
    """This rank's tensor for ``leaf`` (the same on every call with the same arguments)."""
    dtype = getattr(torch, leaf.dtype)
    shape = list(leaf.shape)
    if vary is not None and shape and -len(shape) <= vary < len(shape):
        shape[vary] += rank  # pad_across_processes: the padded dimension differs across ranks
    g = torch.Generator().manual_seed(seed * 7919 + index * 104729 + rank)
    numel = 1
    for n in shape:
        numel *= n
    values = torch.randint(-6, 7, (numel + 8,), generator=g)
    if dtype == torch.bool:
        base = values > 0
    elif dtype.is_complex:
        base = torch.complex(values[: numel + 8].double(), values.flip(0).double()).to(dtype)
    elif dtype in (torch.uint8,):
        base = values.abs().to(dtype)
    else:
        base = values.to(dtype)
    layout = leaf.layout
    if layout == "transposed" and len(shape) >= 2:
        flipped = [*shape[:-2], shape[-1], shape[-2]]
        return base[:numel].reshape(flipped).transpose(-1, -2)
    if layout == "offset":
        return base[3 : 3 + numel].reshape(shape)
    if layout == "expanded" and shape and shape[0] > 1:
        one = base[: numel // shape[0]].reshape([1, *shape[1:]])
        return one.expand(shape)
    x = base[:numel].reshape(shape).clone()
    if layout == "grad" and (dtype.is_floating_point or dtype.is_complex) and dtype.itemsize > 1:
        return x.requires_grad_()
    if layout == "conj" and dtype.is_complex:
        return x.conj()
    return x


def _tree(tree: Any, rank: int, seed: int, vary: int | None = None) -> Any:
    counter = iter(range(1000))

    def walk(node: Any) -> Any:
        if isinstance(node, Leaf):
            return _build(node, rank, seed, next(counter), vary)
        if isinstance(node, dict):
            return {k: walk(v) for k, v in sorted(node.items())}
        return [walk(v) for v in node]

    return walk(tree)


def _flat(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree) for t in _flat(tree[k])]
    return [t for v in tree for t in _flat(v)]


# --- raw torch.distributed references ---------------------------------------------------------------------


def _plain(x: torch.Tensor) -> torch.Tensor:
    return x.detach().resolve_conj().resolve_neg().contiguous()


def _raw_bytes(x: torch.Tensor) -> torch.Tensor:
    return _plain(x).reshape(-1).view(torch.uint8)


def _raw_gather(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    world = dist.get_world_size(group)
    shape = (world * x.shape[0], *x.shape[1:]) if x.dim() else (world,)
    data = _raw_bytes(x)
    out = torch.empty(world * data.numel(), dtype=torch.uint8)
    if data.numel():
        _single(out, data, group=group)
    return out.view(x.dtype).view(shape) if x.numel() else torch.empty(shape, dtype=x.dtype)


def _raw_broadcast(x: torch.Tensor, src: int, group: Any = None) -> torch.Tensor:
    data = _raw_bytes(x).clone() if dist.get_rank() == src else torch.empty(x.nbytes, dtype=torch.uint8)
    if data.numel():
        dist.broadcast(data, src, group)
    return data.view(x.dtype).view(x.shape) if x.numel() else torch.empty(x.shape, dtype=x.dtype)


_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_RAW_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}  # fmt: skip
_WIDE = {torch.int16: torch.int32, torch.float8_e4m3fn: torch.float32}


def _raw_reduce(x: torch.Tensor, op: str, group: Any = None) -> torch.Tensor:
    world = dist.get_world_size(group)
    wide = _WIDE.get(x.dtype)
    if wide is None:  # the backend reduces it
        out = _plain(x).clone()
        if out.numel():
            dist.all_reduce(out, _RAW_OPS[op], group)
        return out / world if op == "mean" else out
    rows = _raw_gather(x.reshape(1, *x.shape), group).to(wide)  # every rank's input, in rank order
    combine = {"sum": torch.sum, "mean": torch.sum, "max": torch.amax, "min": torch.amin, "product": torch.prod}
    out = combine[op](rows, 0) if rows.numel() else rows.sum(0)
    if op == "mean":
        out = out / world
    return out.to(x.dtype)


def _raw_pad(x: torch.Tensor, dim: int, group: Any = None) -> torch.Tensor:
    if not -x.dim() <= dim < x.dim():
        return _plain(x).clone()
    d = dim % x.dim()
    sizes = _raw_gather(torch.tensor([x.shape[d]]), group)
    shape = (*x.shape[:d], int(sizes.max()), *x.shape[d + 1 :])
    if x.dtype.itemsize == 1 and x.dtype.is_floating_point:  # float8: torch 2.4 cannot fill an empty one
        out = torch.zeros(shape, dtype=torch.uint8).view(x.dtype)
    else:
        out = x.new_zeros(shape).detach()
    out.narrow(d, 0, x.shape[d]).copy_(x.detach())
    return out


# --- one step ---------------------------------------------------------------------------------------------


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:  # gloo's sum of booleans leaves counts in the bytes; accelkit's are 0 or 1
        return torch.equal(_raw_bytes(a), _raw_bytes(b).clamp(max=1))
    return torch.equal(_raw_bytes(a), _raw_bytes(b))


def _owns(t: torch.Tensor) -> bool:
    # Its data at offset 0 of a storage no other result or input shares (checked below): bytes after it
    # (a broadcast's or a reduction's token, in the fresh message the result was received in) are allowed.
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() >= t.numel() * t.element_size()


def _pickles(t: torch.Tensor) -> bool:
    """Whether torch pickles a tensor of this dtype at all (not uint16/32/64, float8, complex32)."""
    try:
        pickle.loads(pickle.dumps(t))
    except AttributeError:
        return False
    return True


def _refuse(kind: str, data: Any, group: Any) -> None:
    if kind == "mean of integers":
        ak.reduce(torch.ones(3, dtype=torch.int32), op="mean", group=group)
    elif kind == "unknown op":
        ak.reduce(data, op="avg", group=group)  # type: ignore[arg-type]
    elif kind == "not a tensor":
        ak.gather({"x": torch.zeros(2), "y": "text"}, group=group)
    else:
        ak.reduce(torch.ones(2, dtype=torch.complex64), op="max", group=group)


def _check_step(step: Step, seed: int) -> list[str]:
    """In a worker: run one step with accelkit and raw torch.distributed over its group; what differs."""
    rank = ak.rank()
    group = None if step.group == "world" else row_and_column()[step.group]
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(ak.world_size()))
    src = ranks[step.arg] if step.op in ("broadcast", "rng state") else None  # a global rank
    vary = step.arg if step.op == "pad_across_processes" else None
    data = _tree(step.tree, rank, seed, vary)
    pristine = [_plain(t).clone() for t in _flat(data)]
    problems: list[str] = []
    if step.op == "refuse":
        try:
            _refuse(step.arg, data, group)
        except (TypeError, ValueError):
            return problems
        return [f"{step.arg}: not refused"]
    if step.op == "rng state":
        state = torch.Generator().manual_seed(seed + rank).get_state()
        out = ak.broadcast(state, src=src, group=group)
        torch.Generator().set_state(out)  # refuses a tensor that does not own its storage
        expected = torch.Generator().manual_seed(seed + src).get_state()
        return [] if _same(out, expected) and _owns(out) else ["rng state: broadcast differs"]
    if step.op == "reduce":
        floats_only = step.arg == "mean"
        ordered = step.arg in ("max", "min", "product")
        leaves = _flat(data)
        if (floats_only and any(not (t.is_floating_point() or t.is_complex()) for t in leaves)) or (
            ordered and any(t.is_complex() for t in leaves)
        ):
            try:
                ak.reduce(data, op=step.arg, group=group)
            except TypeError:
                return problems
            return [f"reduce {step.arg} of {[t.dtype for t in leaves]}: not refused"]
        out = ak.reduce(data, op=step.arg, group=group)
        refs = [_raw_reduce(t, step.arg, group) for t in leaves]
    elif step.op == "gather":
        out = ak.gather(data, group=group)
        refs = [_raw_gather(t, group) for t in _flat(data)]
    elif step.op == "broadcast":
        assert src is not None
        out = ak.broadcast(data, src=src, group=group)
        refs = [_raw_broadcast(t, src, group) for t in _flat(data)]
    else:
        out = ak.pad_across_processes(data, dim=step.arg, group=group)
        refs = [_raw_pad(t, step.arg, group) for t in _flat(data)]
    results = _flat(out)
    inputs = {t.untyped_storage().data_ptr() for t in _flat(data) if t.numel()} | _reused_buffers()
    seen: set[int] = set()
    for i, (got, ref) in enumerate(zip(results, refs, strict=True)):
        where = f"{step.op}({step.arg}) over {step.group} leaf {i} {ref.dtype} {list(ref.shape)}"
        if not _same(got, ref):
            problems.append(f"{where}: {got} != raw {ref}")
        if not _owns(got):
            problems.append(f"{where}: a view (offset {got.storage_offset()}, {got.untyped_storage().nbytes()} bytes)")
        if got.requires_grad:
            problems.append(f"{where}: has autograd history")
        if _pickles(ref) and not _same(pickle.loads(pickle.dumps(got)), ref):
            problems.append(f"{where}: differs once pickled")
        ptr = got.untyped_storage().data_ptr()
        if got.numel() and (ptr in inputs or ptr in seen):
            problems.append(f"{where}: shares storage with an input, another result or a buffer accelkit reuses")
        seen.add(ptr)
    if not all(_same(a, b) for a, b in zip(_flat(data), pristine, strict=True)):  # (bytes: no float8 equal on 2.4)
        problems.append(f"{step.op}: an input was modified")
    return problems


def _reused_buffers() -> set[int]:
    """The storages of the buffers this thread's collectives reuse from call to call."""
    from accelkit._collectives import _scratch

    found = _scratch.mine()
    if found is None:
        return set()
    return {found.tensor.untyped_storage().data_ptr(), found.heads[torch.uint8].untyped_storage().data_ptr()}


def _program(steps: list[Step], seed: int) -> list[str]:
    """The steps twice over: the second time, each call rides in the message planned at its point of the program
    (after the same call as the first time)."""
    faulthandler.enable()
    problems = []
    for round in range(2):
        for i, step in enumerate(steps):
            problems += [f"round {round} step {i}: {p}" for p in _check_step(step, seed)]
    problems += [] if ak.reduce(torch.ones(2)).tolist() == [ak.world_size()] * 2 else ["a last reduce differs"]
    return problems


def _on_the_device_wire(steps: list[Step], seed: int) -> list[str]:
    """The program over the device wire, here on the CPU: messages compared "on the device" and each verdict
    read at the next collective (a reader that holds it). The channels are forgotten before and after, alike on
    every rank."""
    from accelkit import _state
    from accelkit._collectives import _channel, _device

    st = ak.state()
    assert st.hardware is not None

    def later(flag: torch.Tensor) -> Any:
        value = bool(flag)
        return lambda: value

    _state.group.channels = None
    try:
        channels = _state.group.channels = _channel.Channels(st)
        channels.wire = channels.world.wire = _device.DeviceWire(st.device, later, st.hardware.to_device)
        problems = _program(steps, seed)
        ak.wait_for_everyone()  # reads the last verdict
        return problems
    finally:
        _state.group.channels = None


FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.mark.distributed
@pytest.mark.slow
@FUZZ
@given(steps=st.lists(_steps(2), min_size=10, max_size=40), seed=st.integers(0, 2**16))
def test_random_programs_match_raw_torch_distributed_on_two_processes(
    pool: WorkerPool, steps: list[Step], seed: int
) -> None:
    for rank, problems in enumerate(pool.run(_program, steps, seed, task_timeout=120)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


@pytest.mark.distributed
@pytest.mark.slow
@settings(FUZZ, max_examples=20)
@given(steps=st.lists(_steps(2), min_size=10, max_size=30), seed=st.integers(0, 2**16))
def test_random_programs_over_the_device_wire(pool: WorkerPool, steps: list[Step], seed: int) -> None:
    for rank, problems in enumerate(pool.run(_on_the_device_wire, steps, seed, task_timeout=120)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


@pytest.mark.distributed
@pytest.mark.slow
@settings(FUZZ, max_examples=20)
@given(steps=st.lists(_steps(4), min_size=10, max_size=30), seed=st.integers(0, 2**16))
def test_random_programs_match_raw_torch_distributed_on_four_processes(
    pool4: WorkerPool, steps: list[Step], seed: int
) -> None:
    for rank, problems in enumerate(pool4.run(_program, steps, seed)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


@pytest.mark.distributed
@pytest.mark.slow
@settings(FUZZ, max_examples=12)
@given(steps=st.lists(_steps(4, ("column",)), min_size=10, max_size=25), seed=st.integers(0, 2**16))
def test_random_programs_over_a_group_of_two_of_four_processes(pool4: WorkerPool, steps: list[Step], seed: int) -> None:
    # Processes 0 and 2 run the program over their group while 1 and 3 run it over theirs.
    for rank, problems in enumerate(pool4.run(_program, steps, seed)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


@pytest.mark.distributed
@pytest.mark.slow
@settings(FUZZ, max_examples=12)
@given(steps=st.lists(_steps(4, ("row", "column", "world")), min_size=10, max_size=25), seed=st.integers(0, 2**16))
def test_random_programs_over_two_groups_in_turn(pool4: WorkerPool, steps: list[Step], seed: int) -> None:
    # Each rank's calls go over its row, its column and every process in turn: three sequences that interleave.
    for rank, problems in enumerate(pool4.run(_program, steps, seed)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
