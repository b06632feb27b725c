"""A real S3 API on 127.0.0.1 for the tests and the benchmark: moto's server mode, reached through s3fs.

:func:`serving` starts ``python -m moto.server`` on a free port, waits until it answers, and
stops it by its pid at the end; the environment it yields (credentials, endpoint, region) is what
a process needs to reach it. Without moto's server or s3fs installed (the ``test`` extra has both)
the tests that need it skip, saying what to install.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # never wait for an instance's metadata service
}


def missing() -> str | None:
    """What must be installed for the server and its client, or None."""
    for module, package in (("moto.server", "moto[server]"), ("s3fs", "s3fs"), ("flask", "moto[server]")):
        try:
            __import__(module)
        except ImportError:
            return f'pip install "{package}" (the test extra has it)'
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(timeout: float = 60.0) -> Iterator[dict[str, str]]:
    """A moto S3 server on 127.0.0.1 for the block; the environment that reaches it."""
    port = _free_port()
    log = tempfile.TemporaryFile()  # a file, not a pipe: the server logs every request, and a full pipe stops it
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=log,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
            if server.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                said = log.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"moto's S3 server did not start on port {port}: {said}")
            time.sleep(0.1)
        yield {**CREDENTIALS, "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}"}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(server.pid, signal.SIGKILL)
        server.wait()
        log.close()


def use(env: dict[str, str]) -> None:
    """Reach the server from this process (a worker's first step)."""
    os.environ.update(env)


def make_bucket(name: str) -> None:
    """Create the bucket ``name`` on the server this process reaches (no error if it exists)."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    with contextlib.suppress(FileExistsError):
        fs.mkdir(name)
