"""A URL is never a local path: every checkpoint call refuses a scheme:// it cannot serve, before any work.

(URLs that fsspec serves are tested in test_checkpoint_remote.py.)"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import accelkit as ak

URL = "nosuchscheme://bucket/run/step-1"  # a scheme nothing serves

CALLS: dict[str, Callable[[str], Any]] = {
    "save_state": lambda where: ak.save_state(where, model=nn.Linear(2, 1), step=1),
    "load_state": lambda where: ak.load_state(where, model=nn.Linear(2, 1)),
    "latest_checkpoint": lambda where: ak.latest_checkpoint(where.rsplit("/", 1)[0]),
    "save_model": lambda where: ak.save_model(nn.Linear(2, 1), where, safe_serialization=False),
    "read_checkpoint": lambda where: ak.read_checkpoint(where),
}


def _everything_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_url_is_refused_before_anything_is_written(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"'nosuchscheme://bucket/run(/step-1)?' is a URL \(nosuchscheme://\)"):
        CALLS[name](URL)
    assert _everything_under(tmp_path) == []  # no ./nosuchscheme:/bucket/... folder
    assert not ak.is_initialized()  # before any work: not even the process state


@pytest.mark.parametrize("name", ["load_state", "latest_checkpoint", "read_checkpoint"])
def test_a_local_folder_named_like_the_url_is_not_read(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What a save to the URL used to leave: ./nosuchscheme:/bucket/run/step-1, a local checkpoint. The URL never
    # reads it.
    monkeypatch.chdir(tmp_path)
    ak.save_state(os.path.join("nosuchscheme:", "bucket", "run", "step-1"), model=nn.Linear(2, 1), step=1)
    with pytest.raises(ValueError, match=r"is a URL \(nosuchscheme://\)"):
        CALLS[name](URL)


def test_the_message_says_what_would_serve_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as raised:
        ak.save_state(URL, model=nn.Linear(2, 1))
    message = str(raised.value)
    assert message.startswith(f"accelkit.save_state({URL!r}): ")
    assert "nothing was read or written" in message
    assert "Pass a local directory, or a URL fsspec serves (s3://, gs://, az://, memory://, ...)" in message


@pytest.mark.parametrize("name", sorted(CALLS))
def test_without_fsspec_a_url_names_the_extra_to_install(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "fsspec", None)  # as if it were not installed: importing it fails
    with pytest.raises(
        ImportError, match=r"through fsspec, which is not installed: pip install \"accelkit\[fsspec\]\""
    ):
        CALLS[name]("s3://bucket/run/step-1")
    assert _everything_under(tmp_path) == [] and not ak.is_initialized()


def test_a_path_with_a_colon_is_still_a_path(tmp_path: Path) -> None:
    # Only scheme:// at the start is a URL: local names with colons and slashes are saved as before.
    where = tmp_path / "runs" / "a:b" / "step-1"
    assert ak.save_state(where, weights=torch.ones(2), step=1) == where
    assert ak.read_checkpoint(where)["step"] == 1
