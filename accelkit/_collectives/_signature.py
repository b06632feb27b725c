"""What a collective call is, as every rank can compare it: a signature, a token, a 64-byte header.

A call's :class:`Signature` is computed once per kind of call (cached): a 64-bit fingerprint of
the operation, its arguments, the tree's structure, the dtypes and the shapes (a padded dimension
left out), and the call as the error tables show it. Its *token* for call number ``seq`` mixes the
fingerprint with ``seq``: two ranks have equal tokens when they make the same call as the same
collective of their program. The header carries the token's parts and what a one-way receiver needs
to describe the sender's call: ``magic, op, flags, dtype, ndim, seq, fingerprint, length, dims[7]``.
A :class:`Call` is one rank's side of one collective: its signature, its number, the tensors it moves.
"""

import functools
import hashlib
import struct
from typing import Any, NamedTuple

import torch

from .. import _tree
from ._debug import leaf_text

__all__ = ["AGREE", "CODES", "DTYPES", "ERROR", "FORMAT", "HEADER", "MAGIC", "OPS", "TREE", "Call", "Signature",
           "describe_header", "signature", "token"]  # fmt: skip

OPS = ("gather", "reduce", "broadcast", "pad_across_processes", "gather_object", "broadcast_object",
       "wait_for_everyone", "check_breakpoint")  # fmt: skip
CODES = {op: i + 1 for i, op in enumerate(OPS)}
# magic, op, flags, dtype, ndim, seq, fingerprint, payload bytes, 7 dims, 4 spare: 64 bytes.
FORMAT = struct.Struct("<4sBBBBQQQ7I4x")
HEADER = FORMAT.size
AGREE = 24  # the bytes every rank must share: magic .. fingerprint (not the length, nor the dims)
_NUMBER = 8  # where the header holds the call's number (after magic, op, flags, dtype, ndim)
MAGIC = b"akc2"
ERROR = 1  # flag: this rank's input was invalid
TREE = 255  # dtype / ndim code of a call with several tensors, or none
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
          torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)  # fmt: skip
_MIX = 0x9E3779B97F4A7C15  # spreads the call number over the token's bits
_MASK = (1 << 64) - 1


class Signature(NamedTuple):
    """One kind of call, as every rank can compare it (immutable: the heartbeat may read it)."""

    op: str
    fingerprint: int  # 64 bits: operation, arguments, structure, dtypes, shapes
    flags: int
    dtype: int  # code in DTYPES, or TREE
    ndim: int
    dims: tuple[int, ...]
    text: str  # the call as the tables show it: accelkit.reduce(op='sum') float32 [4]

    def header(self, seq: int, length: int = 0) -> bytes:
        """The 64-byte header of this call as number ``seq``, with a payload of ``length`` bytes."""
        return FORMAT.pack(MAGIC, CODES[self.op], self.flags, self.dtype, self.ndim, seq, self.fingerprint, length,
                           *self.dims)  # fmt: skip

    def framing(self) -> tuple[bytes, bytes, bytes]:
        """The header's bytes around the call's number: ``header(seq)`` is ``before + number + after`` (the number
        as 8 little-endian bytes), and its first :data:`AGREE` bytes are ``before + number + agreed``."""
        header = self.header(0)
        before, after = header[:_NUMBER], header[_NUMBER + 8 :]
        return before, after, after[: AGREE - _NUMBER - 8]


def token(sig: Signature, seq: int) -> int:
    """The 64-bit token of call number ``seq`` of kind ``sig``: equal on two ranks when they make the same call."""
    return (sig.fingerprint ^ (seq * _MIX)) & _MASK


class Call:
    """This rank's side of one collective: what it is, the tensors it moves, what the tables show.

    ``seq`` and ``token`` are set as the call begins on its channel (its number there)."""

    __slots__ = ("data", "free_dim", "op", "params", "problem", "seq", "shapes", "sig", "spec", "token")

    def __init__(
        self,
        sig: Signature,
        data: list[torch.Tensor],
        params: dict[str, Any],
        spec: _tree.TreeSpec | None = None,
        free_dim: int | None = None,
        problem: BaseException | None = None,
    ) -> None:
        self.sig, self.seq, self.token, self.data = sig, 0, 0, data
        self.op, self.params, self.spec, self.free_dim, self.problem = sig.op, params, spec, free_dim, problem
        self.shapes: list[tuple[torch.dtype, torch.Size]] | None = None  # the user's leaves for the tables (or data's)

    def leaf_shapes(self) -> list[tuple[torch.dtype, torch.Size]]:
        return self.shapes if self.shapes is not None else [(x.dtype, x.shape) for x in self.data]


def signature(
    op: str,
    params: dict[str, Any],
    leaves: list[torch.Tensor] | None = None,
    spec: _tree.TreeSpec | None = None,
    free_dim: int | None = None,
    problem: BaseException | None = None,
) -> Signature:
    """The signature of a call (cached per kind of call: a handful of dictionary lookups)."""
    args = tuple(params.items())
    if problem is not None:
        return _error(op, args)
    if spec is not None and spec.kind == "leaf" and leaves:
        x = leaves[0]
        return _one(op, args, x.dtype, x.shape, free_dim)
    shapes = tuple([(x.dtype, x.shape) for x in leaves]) if leaves else ()
    return _tree_signature(op, args, spec, shapes, free_dim)


@functools.lru_cache(maxsize=4096)
def _one(op: str, args: tuple[Any, ...], dtype: torch.dtype, shape: torch.Size, free_dim: int | None) -> Signature:
    key = (op, args, dtype, _shape_key(tuple(shape), free_dim))
    code = DTYPES.index(dtype) if dtype in DTYPES else TREE - 1
    dims = tuple(min(d, 0xFFFFFFFF) for d in shape[:7])
    text = f"{_call_text(op, args)} {leaf_text(dtype, shape)}"
    return Signature(op, _hash(key), 0, code, min(len(shape), TREE), dims + (0,) * (7 - len(dims)), text)


_TREES: dict[Any, Signature] = {}  # tree calls by (op, args, spec, shapes, free dim); bounded


def _tree_signature(
    op: str, args: tuple[Any, ...], spec: _tree.TreeSpec | None, shapes: tuple[Any, ...], free_dim: int | None
) -> Signature:
    key = (op, args, spec, shapes, free_dim)  # (a spec compares and hashes as its structure does)
    found = _TREES.get(key)
    if found is not None:
        return found
    structure = _tree.signature(spec) if spec is not None else None
    ndim, dims = (TREE, (len(shapes),)) if spec is not None else (0, ())
    text = _call_text(op, args)
    if spec is not None:
        text += " " + _tree.describe(spec, [leaf_text(d, s) for d, s in shapes])
    fingerprint = _hash((op, args, structure, tuple((d, _shape_key(tuple(s), free_dim)) for d, s in shapes)))
    if len(_TREES) >= 4096:
        _TREES.clear()
    key = (op, args, _tree.structure(spec) if spec is not None else None, shapes, free_dim)  # (no tensor kept)
    sig = _TREES[key] = Signature(op, fingerprint, 0, TREE, ndim, dims + (0,) * (7 - len(dims)), text)
    return sig


@functools.lru_cache(maxsize=256)
def _error(op: str, args: tuple[Any, ...]) -> Signature:
    return Signature(op, _hash((op, "invalid input")), ERROR, TREE, 0, (0,) * 7, _call_text(op, args))


def describe_header(header: bytes) -> str:
    """Another rank's call, as its header shows it (``accelkit.reduce #4 float32 [4]``)."""
    if header[:4] != MAGIC:
        return "a message that is no accelkit collective's (a torch.distributed call made directly?)"
    _, code, flags, dtype, ndim, seq, _, length, *dims = FORMAT.unpack(header)
    op = OPS[code - 1] if 0 < code <= len(OPS) else "?"
    if flags & ERROR:
        return f"accelkit.{op} #{seq} could not apply it to its input"
    if dtype == TREE:
        what = f"{dims[0]} tensors" if ndim else f"{length} bytes"
    else:
        name = str(DTYPES[dtype]).removeprefix("torch.") if dtype < len(DTYPES) else "tensor"
        what = f"{name} {list(dims[:ndim])}" if ndim <= 7 else f"{name} of {ndim} dimensions"
    return f"accelkit.{op} #{seq} {what}"


def _call_text(op: str, args: tuple[Any, ...]) -> str:
    return f"accelkit.{op}({', '.join(f'{k}={v!r}' for k, v in args)})"


def _hash(key: Any) -> int:
    # Stable across processes (unlike hash()): dtypes, shapes and names have the same repr everywhere.
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


def _shape_key(shape: tuple[int, ...], free_dim: int | None) -> tuple[int, ...]:
    if free_dim is None:
        return shape
    if not -len(shape) <= free_dim < len(shape):  # no such dim: the leaf comes back as it is, any shape
        return (-2,)
    free = free_dim % len(shape)
    return tuple(-1 if i == free else n for i, n in enumerate(shape))
