"""Where a checkpoint call reads or writes: a local folder, or an object store; never a URL taken for a path.

``Path("s3://bucket/run")`` is the local path ``s3:/bucket/run``: taken as one, a save to a bucket
would write a folder on the local disk and return as if saved. Every checkpoint call asks
:func:`storage_for` first, before any work: a URL goes to fsspec (``_remote``), and one that nothing
installed serves is refused there, saying what would serve it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ._local import LocalStorage
from ._storage import Storage

__all__ = ["storage_for", "url_scheme"]

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*)://")  # RFC 3986's scheme, then "://"
_LOCAL = ("file", "local")  # fsspec's names for the local filesystem


def url_scheme(directory: str | os.PathLike[str]) -> str | None:
    """The scheme of ``directory`` when it is a URL (``"s3"`` for ``s3://bucket/run``), else None.

    Example:
        >>> url_scheme("s3://bucket/run"), url_scheme("runs/step-1")
        ('s3', None)
    """
    found = _URL.match(os.fspath(directory))
    return found.group(1).lower() if found else None


def storage_for(call: str, directory: str | os.PathLike[str]) -> Storage:
    """Where ``directory`` is: a local folder, or an object store through fsspec; refused before any work when
    nothing serves it (ValueError, or ImportError naming what to install)."""
    scheme = url_scheme(directory)
    if scheme is None:
        return LocalStorage(Path(directory))
    text = os.fspath(directory)
    if scheme in _LOCAL:
        return LocalStorage(Path(text.split("://", 1)[1] or "/"))
    from ._remote import RemoteStorage

    return RemoteStorage.open(call, text, scheme)
