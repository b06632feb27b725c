"""The device wire: messages on the device, compared there, the verdict read at the rank's next collective.

Reading a verdict at once would make the host wait for the device. Here each comparison runs on the
device, and its one-byte result goes to the Backend's ``read_later``, which copies it to host memory
without blocking: the reader it returns is called at the rank's next collective, barrier or
``ak.end_training`` (by then the copy, issued a whole call before, is done). A gather's message is
fresh (every rank's bytes, then its header); the results are copied out of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _check, _exchange
from ._signature import AGREE, HEADER
from ._wire import Verdict, Wire

__all__ = ["DeviceWire"]


class DeviceWire(Wire):
    def __init__(
        self,
        device: torch.device,
        read_later: Callable[[torch.Tensor], Verdict],
        to_device: Callable[[torch.Tensor, torch.device], torch.Tensor],
    ) -> None:
        super().__init__(device)
        self.read_later, self.to_device = read_later, to_device  # the Backend's

    def judge_bits(self, bits: torch.Tensor, token: int, world: int, logic: bool) -> Verdict:
        return self.read_later(_check.bits_agree_on_device(bits, world, logic))

    def gather(
        self, leaves: list[torch.Tensor], header: bytes, group: Any, size: int
    ) -> tuple[list[torch.Tensor], Verdict]:
        world = size
        parts = [_exchange.as_bytes(x) for x in leaves]
        mine = self.header(header)
        width = sum(p.numel() for p in parts) + HEADER
        message = torch.cat([*parts, mine])
        gathered = message.new_empty(world * width)
        _exchange.all_gather(gathered, message, group)
        verdict = self.read_later(_check.headers_agree_on_device(gathered, world, width, width - HEADER, mine))
        out, offset = [], 0
        for x, part in zip(leaves, parts, strict=True):
            n = part.numel()  # each rank's bytes of this leaf, copied out of every rank's message
            rows = gathered.as_strided((world, n), (width, 1), offset).clone()
            out.append(_exchange.from_bytes(rows, x, world))
            offset += n
        return out, verdict

    def header(self, header: bytes) -> torch.Tensor:
        """A header as a uint8 tensor on the device of its own (copied there without waiting for it)."""
        return self.to_device(torch.frombuffer(bytearray(header), dtype=torch.uint8), self.device)

    def header_out(self, header: bytes, dtype: torch.dtype) -> torch.Tensor:
        return self.header(header).view(dtype)

    def header_in(self, tail: torch.Tensor, header: bytes) -> tuple[Verdict, torch.Tensor]:
        # The source's header stays on the device (a view of the message: no copy); read only for a table.
        theirs = tail.view(torch.uint8)
        return self.read_later((theirs[:AGREE] == self.header(header)[:AGREE]).all()), theirs
