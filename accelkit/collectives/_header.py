"""The 64-byte header that starts every collective's first message, and the call it describes.

``magic, op, flags, dtype, ndim, chain, seq, fingerprint, length, dims[7]``: what every rank must
share (``AGREE`` bytes: the operation, an invalid input's flag, the call's number and the digest of
every call before it, a fingerprint of the arguments, structure, dtypes and shapes), then what may
differ between ranks (the payload's length, the shape shown in error messages). The fixed parts of a
kind of call are computed once (:func:`pieces`); a call costs two small ``struct.pack`` and a join.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from typing import Any, NamedTuple

import torch

from .. import _tree
from . import _debug

__all__ = ["AGREE", "CODES", "DTYPES", "ERROR", "FORMAT", "HEADER", "LENGTH", "MAGIC", "ONE_WAY", "OPS", "TREE",
           "Arrival", "Call"]  # fmt: skip

HEADER = 64
ONE_WAY = ("broadcast", "broadcast_object")
OPS = ("gather", "reduce", "broadcast", "pad_across_processes", "gather_object", "broadcast_object",
       "wait_for_everyone", "check_breakpoint")  # fmt: skip
CODES = {op: i + 1 for i, op in enumerate(OPS)}
# magic, op, flags, dtype, ndim, chain, seq, fingerprint, payload bytes, up to 7 dims: 64 bytes.
FORMAT = struct.Struct("<4sBBBBIQQQ7I")
HEAD, MOVING, LENGTH, DIMS = (
    struct.Struct("<4sBBBB"),
    struct.Struct("<IQ"),
    struct.Struct("<Q"),
    struct.Struct("<7I"),
)
MAGIC = b"akc1"
AGREE = 28  # the header's bytes every rank must share: magic .. fingerprint (not the length, not the dims)
ERROR = 1  # flag: this rank's input was invalid; its slot holds the error's text
TREE = 255  # dtype / ndim code of a call with several tensors, or none
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
          torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool)  # fmt: skip
PROBLEM_TEXT = 180  # bytes of an invalid input's error that travel with its header (fits the smallest slot)


class Call:
    """This rank's side of one collective: what it is, and the bytes it carries.

    ``payload``: bytes, or tensors at their byte offsets (see ``_bytes.parts``), ``length`` bytes in
    all. A ``problem`` (this rank's input was invalid) travels as its text: the others quote it.
    """

    __slots__ = ("free_dim", "leaves", "length", "op", "params", "payload", "problem", "sent", "spec")

    def __init__(
        self,
        op: str,
        params: dict[str, Any],
        leaves: list[torch.Tensor] | None = None,
        spec: _tree.TreeSpec | None = None,
        *,
        free_dim: int | None = None,
        payload: bytes | list[tuple[int, torch.Tensor]] = b"",
        length: int = -1,
        problem: BaseException | None = None,
    ) -> None:
        self.op, self.params, self.leaves, self.spec, self.free_dim = op, params, leaves or [], spec, free_dim
        self.problem = problem
        if problem is not None:
            payload = f"{type(problem).__name__}: {problem}".encode()[:PROBLEM_TEXT]
        self.payload = payload
        self.length = len(payload) if isinstance(payload, bytes) else length
        self.sent = b""  # the header this rank sent

    def signature(self) -> str:
        """What two ranks in the same call share: operation and fingerprint (not the number, nor the digest)."""
        return (self.sent[4:8] + self.sent[20:28]).hex()

    def header(self, chain: int, seq: int) -> bytes:
        """This rank's 64-byte header for call number ``seq``, after calls whose digest is ``chain``."""
        if self.problem is not None:
            head, fingerprint, dims = pieces(self.op, None)
        elif self.spec is not None and self.spec.kind == "leaf":
            x = self.leaves[0]
            head, fingerprint, dims = pieces(self.op, (tuple(self.params.values()), x.dtype, x.shape, self.free_dim))
        else:
            shapes = tuple((x.dtype, x.shape) for x in self.leaves)
            structure = _tree.signature(self.spec) if self.spec is not None else None
            head, fingerprint, dims = pieces(self.op, (tuple(self.params.values()), structure, shapes, self.free_dim))
        return head + MOVING.pack(chain, seq) + fingerprint + LENGTH.pack(self.length) + dims

    def describe(self) -> str:
        """The call as debug mode's tables show it: ``accelkit.reduce(op='sum') float32 [4]``."""
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        text = f"accelkit.{self.op}({args})"
        if self.problem is not None:
            return f"{text} raised {type(self.problem).__name__}: {self.problem}"
        if self.spec is None:
            return text
        return f"{text} {_tree.describe(self.spec, [_debug.leaf_text(x) for x in self.leaves])}"


class Arrival(NamedTuple):
    """What the first message brought: every rank's slot (a broadcast: the source's) and their payload lengths."""

    buffer: torch.Tensor  # uint8: the slots, one after the other (a broadcast: the source's only)
    stride: int  # bytes per slot
    lengths: list[int]  # each slot's payload bytes
    fits: bool  # every payload came whole in its slot

    @property
    def rows(self) -> torch.Tensor:
        """The slots as a (ranks, stride) uint8 matrix."""
        return self.buffer[: len(self.lengths) * self.stride].view(-1, self.stride)


@functools.lru_cache(maxsize=4096)
def pieces(op: str, what: tuple[Any, ...] | None) -> tuple[bytes, bytes, bytes]:
    """A header's fixed parts for a call: (magic .. ndim, fingerprint, dims), computed once per kind of call.

    ``what``: None for an invalid input; (params, dtype, shape, free dim) for one tensor;
    (params, structure, ((dtype, shape), ...), free dim) for a tree, or a call without tensors.
    """
    if what is None:
        return HEAD.pack(MAGIC, CODES[op], ERROR, TREE, 0), bytes(8), bytes(28)
    params, kind, shapes, free_dim = what
    if isinstance(kind, torch.dtype):  # one tensor
        key: tuple[Any, ...] = (op, params, kind, shape_key(shapes, free_dim))
        dtype = DTYPES.index(kind) if kind in DTYPES else TREE - 1
        dims = tuple(min(d, 0xFFFFFFFF) for d in shapes[:7])
        ndim = len(shapes)
    else:
        key = (op, params, kind, tuple((d, shape_key(s, free_dim)) for d, s in shapes))
        dtype, ndim, dims = TREE, (TREE if kind is not None else 0), (len(shapes),) if kind is not None else ()
    # Stable across processes (unlike hash()): dtypes, shapes and names have the same repr everywhere.
    fingerprint = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return (
        HEAD.pack(MAGIC, CODES[op], 0, dtype, min(ndim, TREE)),
        fingerprint,
        DIMS.pack(*dims, *(0,) * (7 - len(dims))),
    )


def shape_key(shape: tuple[int, ...], free_dim: int | None) -> tuple[int, ...]:
    if free_dim is None:
        return tuple(shape)
    if not -len(shape) <= free_dim < len(shape):  # no such dim: the leaf comes back as it is, any shape
        return (-2,)
    free = free_dim % len(shape)
    return tuple(-1 if i == free else n for i, n in enumerate(shape))
