"""The ``accelkit`` command's help texts, pinned: a change to a flag shows up as a diff to review."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from accelkit._cli import main

SNAPSHOTS = Path(__file__).parent / "snapshots"


@pytest.mark.parametrize("command", ["", "launch", "config", "env", "test"])
def test_help_snapshot(command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps to the terminal's width
    with pytest.raises(SystemExit) as done:
        main([command, "--help"] if command else ["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    snapshot = SNAPSHOTS / f"{command or 'accelkit'}_help.txt"
    if os.environ.get("UPDATE_SNAPSHOTS") == "1":
        snapshot.parent.mkdir(exist_ok=True)
        snapshot.write_text(text)
    assert text == snapshot.read_text(), f"`accelkit {command} --help` changed: rerun with UPDATE_SNAPSHOTS=1, review"
