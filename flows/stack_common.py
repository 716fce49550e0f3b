"""What the local stack's servers share (flows/stack.py starts them, flows/stack_postgres.py is the database):
the error a part that did not start raises, free ports on 127.0.0.1, detached process groups and their logs,
and secrets files that are mode 0600 from their creation on."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path


class StackError(RuntimeError):
    """A part of the stack did not start; the message names it and its log file."""


# -- ports and processes --------------------------------------------------------------------------------


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(preferred: int | None = None) -> int:
    if preferred and port_free(preferred):
        return preferred
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def beside_python(name: str) -> str | None:
    """A console script installed with this interpreter (a virtualenv whose bin/ is not on PATH), or on PATH."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else shutil.which(name)


def spawn(cmd: list[str], log_path: Path, env: Mapping[str, str], cwd: Path | None = None) -> subprocess.Popen:
    """A detached process (its own session: the terminal's Ctrl-C and this command's exit leave it running)."""
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            cmd,
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of this process is not alive
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def stop_group(pid: int, grace: float = 15.0) -> None:
    """SIGTERM to the process group `pid` leads, SIGKILL after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            if not alive(pid):
                return
            time.sleep(0.1)


def tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def wait_ready(what: str, ready, timeout: float, proc: subprocess.Popen | None, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise StackError(f"{what} exited with status {proc.returncode} (log: {log_path}): {tail(log_path, 400)}")
        try:
            if ready():
                return
        except Exception:  # not up yet
            pass
        if time.monotonic() > deadline:
            raise StackError(f"{what} was not ready after {timeout:.0f}s (log: {log_path}): {tail(log_path, 400)}")
        time.sleep(0.3)


def private_json(path: Path, make: Callable[[], dict[str, str]]) -> dict[str, str]:
    """A secrets file: `make()` written on first use, mode 0600 from its creation on (never briefly wider), and
    set back to 0600 when found wider (a copy restored by hand)."""
    if not path.exists():
        tmp = path.with_name(path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(make(), f)
        tmp.replace(path)
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
    try:
        return json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise StackError(f"{path}: not a readable credentials file ({e})") from None
