"""The README's Python blocks run as written: each one, saved as a script, runs to its end.

A block that is not meant to run (a fragment) says so on the line before it, with the marker
``<!-- not run -->``; every other ```` ```python ```` block is run here, in a subprocess with a timeout.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from processes import subprocess_env

README = Path(__file__).parent.parent / "README.md"
NOT_RUN = "<!-- not run -->"


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """Each ```` ```python ```` block of ``text``: its first line's number, its code, whether it is meant to run."""
    lines = text.splitlines()
    blocks = []
    for start, line in enumerate(lines):
        if line.strip() != "```python":
            continue
        indent = line[: len(line) - len(line.lstrip())]
        end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "```")
        code = "".join(f"{row.removeprefix(indent)}\n" for row in lines[start + 1 : end])
        before = next((lines[i].strip() for i in range(start - 1, -1, -1) if lines[i].strip()), "")
        blocks.append((start + 1, code, before != NOT_RUN))
    return blocks


BLOCKS = [pytest.param(code, id=f"README.md:{line}") for line, code, runs in python_blocks(README.read_text()) if runs]


def test_the_readme_has_blocks_to_run_and_the_marker_leaves_a_block_out() -> None:
    assert BLOCKS, "no runnable ```python block found in README.md"
    text = f"{NOT_RUN}\n```python\nfragment(x)\n```\n\n- a list item:\n\n  ```python\n  y = 1\n  ```\n"
    assert python_blocks(text) == [(2, "fragment(x)\n", False), (8, "y = 1\n", True)]


@pytest.mark.distributed
@pytest.mark.parametrize("code", BLOCKS)
def test_a_python_block_of_the_readme_runs_as_written(code: str, tmp_path: Path) -> None:
    script = tmp_path / "train.py"  # as the README says to save it
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    if "print(train(" in code:  # the first block: rank 0's loss, once, on a task it learns
        assert re.fullmatch(r"\d+\.\d+(e-\d+)?\n", done.stdout), done.stdout
        assert float(done.stdout) < 0.5
