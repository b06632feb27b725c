"""Background saves on a torch without DCP's DefaultStager (before 2.9): the state is staged by hand.

``_async._HostCopy`` must give the background writer a copy that training cannot change (tensors
already on the CPU copied too), keep tensors that share a storage sharing one (as torch.save would
write them), and copy every other value.
"""

from __future__ import annotations

import pytest
import torch

from accelkit._checkpoint import _async


@pytest.mark.smoke
def test_the_copy_by_hand_is_apart_from_the_state_and_keeps_shared_storages_shared() -> None:
    weight = torch.arange(4.0)
    view = weight[1:3]  # shares weight's storage, as a tied parameter does
    state = {"model": {"w": weight, "view": view, "tied": [weight]}, "rng": (torch.zeros(2, dtype=torch.uint8),)}
    state["extra"] = {"epoch": 3, "names": ["a", "b"]}

    staged = _async._HostCopy().stage(state)
    weight.add_(100)  # training goes on while the copy is written
    state["extra"]["names"].append("c")

    assert torch.equal(staged["model"]["w"], torch.arange(4.0))
    assert torch.equal(staged["model"]["view"], torch.tensor([1.0, 2.0]))
    assert staged["model"]["tied"][0] is staged["model"]["w"]
    w, v = staged["model"]["w"], staged["model"]["view"]
    assert v.untyped_storage().data_ptr() == w.untyped_storage().data_ptr() and v.storage_offset() == 1
    assert isinstance(staged["rng"], tuple) and staged["extra"] == {"epoch": 3, "names": ["a", "b"]}


def test_background_saves_stage_with_dcp_where_torch_has_its_stager() -> None:
    stager = _async.Saving(pin_memory=False).stager
    if torch.__version__ >= "2.9":
        from torch.distributed.checkpoint.staging import DefaultStager

        assert isinstance(stager, DefaultStager)
    else:
        assert isinstance(stager, _async._HostCopy)
    stager.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_copy_by_hand_moves_device_tensors_to_the_host() -> None:
    weight = torch.arange(4.0, device="cuda")
    staged = _async._HostCopy().stage({"model": {"w": weight, "tied": [weight]}})
    weight.add_(100)
    assert staged["model"]["w"].device.type == "cpu" and torch.equal(staged["model"]["w"], torch.arange(4.0))
    assert staged["model"]["tied"][0] is staged["model"]["w"]
