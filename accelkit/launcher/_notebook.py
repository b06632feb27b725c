"""Launching from a notebook: forking safely, and each rank's prints reaching the cell whole."""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any

from .. import _state
from ..errors import StateError, WorkerError

if TYPE_CHECKING:
    from ._agent import AgentConfig


# Imported by users before a launch, these initialise CUDA in the importing process (or may).
_CUDA_INITIALISERS = ("bitsandbytes", "deepspeed", "apex", "xformers", "flash_attn", "vllm", "cupy", "pycuda", "jax")


def refuse_unsafe_fork(world_size: int) -> None:
    """Forked workers inherit this process: refuse what they cannot use (CUDA, a process group)."""
    import torch

    cannot = f"accelkit.launch cannot fork {world_size} worker processes"
    if torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        raise StateError(
            f"{cannot}: CUDA was already initialised in this process{_cuda_suspects()}, and forked "
            f"workers cannot use it. Restart the kernel (or interpreter) and keep all CUDA work "
            f"(.cuda(), .to('cuda'), ak.prepare, torch.cuda calls) inside the launched function."
        )
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        user = ""
        if _state.is_initialized():
            st = _state.get()
            where = f"rank {st.rank} of {st.world_size}, created at {_state._origin}"
            user = f"; accelkit's state in this process ({where}) uses it"
        raise StateError(
            f"{cannot}: a torch.distributed process group already exists in this process{user}, and "
            f"forked workers cannot share it. Call torch.distributed.destroy_process_group() and "
            f"ak.reset_state() first, or restart the kernel; keep process-group work inside the launched function."
        )


def _cuda_suspects() -> str:
    found = [name for name in _CUDA_INITIALISERS if name in sys.modules]
    if _state.is_initialized() and _state.get().device.type == "cuda":
        found.insert(0, f"accelkit (its state uses {_state.get().device}, created at {_state._origin})")
    if found:
        return f" (likely by {', '.join(found)})"
    return " (by a cell run earlier: .cuda(), .to('cuda'), a torch.cuda call or an import that does so)"


def _preflight() -> None:
    """Debug mode's dry run in every worker: join the process group, meet at a barrier."""
    from ..process import wait_for_everyone

    _state.get()
    wait_for_everyone()


def preflight_launch(config: AgentConfig, env: dict[str, str]) -> None:
    from ._agent import run_workers

    try:
        run_workers(_preflight, (), {}, config, env)
    except WorkerError as exc:
        if sys.version_info >= (3, 11):
            exc.add_note("(debug mode's pre-flight launch failed: no user code ran)")
        raise
    world = config.num_processes * config.num_nodes
    print(f"accelkit: pre-flight launch OK ({world} processes formed a group and met at a barrier)", file=sys.stderr)


class _LineWriter:
    """Passes whole lines (and whatever is pending at ``flush``) on to ``stream``."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._pending = ""

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending:
            lines, _, self._pending = self._pending.rpartition("\n")
            self._stream.write(lines + "\n")
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if self._pending:
            self._stream.write(self._pending)
            self._pending = ""
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # encoding, fileno, isatty, ... of the stream
        return getattr(self._stream, name)


def whole_lines_to_notebook() -> None:
    # In a process forked from a Jupyter kernel, ipykernel's OutStream sends every write as
    # its own message, so print("loss", x) from two ranks arrives interleaved word by word.
    # Handing it whole lines keeps each rank's lines intact; they still reach the cell at once.
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if type(stream).__module__.startswith("ipykernel."):
            setattr(sys, name, _LineWriter(stream))


def flush_std_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
