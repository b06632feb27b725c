"""What a checkpoint saves for each rank without being told: RNG states, grad scaler, loader positions.

:func:`capture` returns it as JSON-able data (tensors as base64); :func:`decode` turns that
back into ready-to-apply values, raising ``ValueError`` on anything malformed, so that a
damaged file is refused before :func:`apply` changes anything.
"""

import base64
import random
from typing import Any, NamedTuple

import torch

from .. import _state

__all__ = ["RankState", "apply", "capture", "decode", "live_loaders", "numpy_missing", "pending_window"]


def live_loaders() -> list[Any]:
    """The prepared dataloaders still alive, in the order they were prepared."""
    training = _state.training
    alive = [loader for loader in (ref() for ref in training.loaders) if loader is not None]
    return alive


def pending_window() -> str | None:
    """Where this rank is inside an ``ak.accumulate`` window with gradients pending, or None when it may save.

    A checkpoint holds neither the accumulated gradients nor the window's position (a resumed run
    counts its micro-steps from 0), so only a save between windows resumes exactly: after the
    optimizer step of a window's last micro-step, or before any ``ak.backward``. Local: each rank
    knows its own window, the same on every rank of a correct loop, so all refuse alike, before
    any collective.
    """
    training = _state.training
    if training.sync_gradients or not training.backward_calls:
        return None
    if training.accumulating:  # inside the region: its steps are known
        steps = training.accumulation_steps
        return f"micro-step {training.micro_step % steps} of {steps} of an ak.accumulate(steps={steps}) window"
    # After the region its steps are gone (each region is an object of its own): say what the count says.
    return (
        f"an unfinished ak.accumulate window (ak.sync_gradients() is False: the last region, micro-step "
        f"{training.micro_step} counted since the start or the last epoch's end, did not close it)"
    )


def _device_module(device: torch.device) -> Any:
    return None if device.type == "cpu" else torch.get_device_module(device.type)


def _b64(t: torch.Tensor) -> str:
    # Through a bytearray, not Tensor.numpy(): numpy is optional (torch's CPU wheel does not need it).
    flat = t.detach().reshape(-1).view(torch.uint8)
    data = bytearray(flat.numel())
    if data:
        torch.frombuffer(data, dtype=torch.uint8).copy_(flat)
    return base64.b64encode(bytes(data)).decode()


def numpy_missing() -> bool:
    """Whether numpy cannot be imported here (its RNG state can be neither saved nor restored)."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        return True
    return False


def capture() -> dict[str, Any]:
    """This rank's RNG states, grad scaler state and prepared-loader positions, JSON-able."""
    st = _state.get()
    version, keys, gauss = random.getstate()
    out: dict[str, Any] = {"rank": st.rank, "python": [version, list(keys), gauss], "numpy": None}
    try:
        import numpy
    except ImportError:
        pass
    else:
        name, np_keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
        out["numpy"] = [name, np_keys.tolist(), pos, has_gauss, cached]  # type: ignore[union-attr]
    out["torch"] = _b64(torch.get_rng_state())
    module = _device_module(st.device)
    out["device"] = None if module is None else [st.device.type, _b64(module.get_rng_state(st.device).cpu())]
    out["scaler"] = _state.strategy().scaler_state_dict() or None  # an unused scaler's state is {}
    out["loaders"] = [loader.state_dict() for loader in live_loaders()]
    return out


class RankState(NamedTuple):
    python: tuple[Any, ...]
    numpy: tuple[Any, ...] | None
    cpu: torch.Tensor
    device: tuple[str, torch.Tensor] | None
    scaler: dict[str, Any] | None
    loaders: list[dict[str, int]]


def _bytes(text: Any, what: str) -> torch.Tensor:
    if not isinstance(text, str):
        raise ValueError(f"{what} is {type(text).__name__}, expected base64 text")
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def decode(raw: Any, rank: int) -> RankState:
    """``raw`` (what :func:`capture` returned, read back) checked and converted; ValueError if malformed."""
    if not isinstance(raw, dict) or raw.get("rank") != rank:
        raise ValueError(f"expected the state of rank {rank}, found {str(raw)[:80]!r}")
    py = raw.get("python")
    if not (isinstance(py, list) and len(py) == 3 and isinstance(py[1], list) and len(py[1]) == 625):
        raise ValueError("the Python RNG state is malformed")
    python = (py[0], tuple(py[1]), py[2])
    numpy_state = None
    if raw.get("numpy") is not None:
        name, keys, pos, has_gauss, cached = raw["numpy"]
        if not (isinstance(keys, list) and len(keys) == 624):
            raise ValueError("the NumPy RNG state is malformed")
        numpy_state = (name, keys, pos, has_gauss, cached)
    cpu = _bytes(raw.get("torch"), "the torch CPU RNG state")
    if cpu.numel() != torch.get_rng_state().numel():
        raise ValueError(f"the torch CPU RNG state has {cpu.numel()} bytes, expected {torch.get_rng_state().numel()}")
    device = None
    if raw.get("device") is not None:
        kind, text = raw["device"]
        device = (str(kind), _bytes(text, f"the {kind} RNG state"))
    scaler, loaders = raw.get("scaler"), raw.get("loaders")
    if scaler is not None and not isinstance(scaler, dict):
        raise ValueError(f"the grad scaler state is {type(scaler).__name__}, expected a mapping")
    if not (isinstance(loaders, list) and all(isinstance(x, dict) for x in loaders)):
        raise ValueError("the dataloader positions are malformed")
    return RankState(python, numpy_state, cpu, device, scaler, loaders)


def check_fits(state: RankState) -> str | None:
    """Why ``state`` cannot be applied in this process (different loaders, scaler, device), or None."""
    have = len(live_loaders())
    if have != len(state.loaders):
        return (
            f"it holds the positions of {len(state.loaders)} prepared dataloader(s) but this process prepared "
            f"{have}; ak.prepare the same dataloaders, in the same order, before ak.load_state"
        )
    if state.scaler is not None and _state.strategy().scaler_state_dict() is None:
        return (
            "it holds an fp16 grad scaler state but no optimizer was prepared under fp16 here; "
            "ak.init(precision='fp16') and ak.prepare(optimizer) before ak.load_state"
        )
    device = _state.get().device
    if state.device is not None and state.device[0] != device.type:
        kind = state.device[0]
        return f"it holds a {kind} RNG state but this process runs on {device}; resume on a {kind}"
    return None


def apply(state: RankState) -> None:
    """Restore ``state`` (checked by :func:`check_fits`) into this process."""
    for loader, position in zip(live_loaders(), state.loaders, strict=True):
        loader.load_state_dict(position)
    if state.scaler is not None:
        _state.strategy().load_scaler_state_dict(state.scaler)
    random.setstate(state.python)
    if state.numpy is not None:  # numpy is importable here: check_numpy said so, or it was dropped
        import numpy

        name, keys, pos, has_gauss, cached = state.numpy
        numpy.random.set_state((name, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state.cpu)
    if state.device is not None:
        device = _state.get().device
        _device_module(device).set_rng_state(state.device[1], device)
