"""Where a checkpoint call reads or writes: a local directory, and never a URL taken for one.

``Path("s3://bucket/run")`` is the local path ``s3:/bucket/run``: without this check a save to a
bucket would write a folder on the local disk and return as if saved. Every checkpoint call asks
here first, before any work, and a URL it cannot serve is refused, saying what would serve it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

__all__ = ["local_path", "url_scheme"]

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*)://")  # RFC 3986's scheme, then "://"


def url_scheme(directory: str | os.PathLike[str]) -> str | None:
    """The scheme of ``directory`` when it is a URL (``"s3"`` for ``s3://bucket/run``), else None.

    Example:
        >>> url_scheme("s3://bucket/run"), url_scheme("runs/step-1")
        ('s3', None)
    """
    found = _URL.match(os.fspath(directory))
    return found.group(1).lower() if found else None


def local_path(call: str, directory: str | os.PathLike[str]) -> Path:
    """``directory`` as a local path; ValueError, before any work, if it is a URL.

    Example:
        >>> local_path("accelkit.save_state('runs/step-1')", "runs/step-1")
        PosixPath('runs/step-1')
    """
    scheme = url_scheme(directory)
    if scheme is None:
        return Path(directory)
    text = os.fspath(directory)
    if scheme == "file":
        instead = f"pass the local path itself, {text[len('file://') :]!r}"
    else:
        instead = (
            f"keep checkpoints in a local directory (e.g. 'checkpoints/{Path(text).name or 'step-1'}') and copy "
            f"committed ones to {scheme}:// yourself"
        )
    raise ValueError(
        f"{call}: {text!r} is a URL ({scheme}://), not a local directory, and accelkit reads and writes checkpoints "
        f"in local directories: nothing was read or written (a URL taken for a path would be a local folder "
        f"{os.path.join('.', text.replace('://', ':/', 1))!r}, lost with the machine); {instead}"
    )
