"""Shared fixtures: a SeaweedFS S3 server and a Prefect test harness, both session-scoped because
each costs seconds to start on the 2-core CI machines."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")


@pytest.fixture(scope="session")
def s3_env(tmp_path_factory):
    """A running SeaweedFS on 127.0.0.1; yields its AWS_* variables, which are also exported so that
    storage.fs (and therefore every stage) reaches it through the standard environment."""
    from tests.s3_server import seaweedfs

    with seaweedfs(tmp_path_factory.mktemp("s3")) as env:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield env
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
