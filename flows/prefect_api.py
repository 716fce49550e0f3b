"""The Prefect API a forgeline command talks to: the server PREFECT_API_URL names, or an ephemeral server of the
command's own (`_EphemeralServer`), which runs Prefect's own command line for it (uvicorn on
`prefect.server.api.server:create_app`, as `prefect.server.api.server.SubprocessASGIServer` does) in a process
group of its own, so that a terminal's Ctrl-C reaches the command, not the server its unwinding reports to."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

# The server's process, before it runs uvicorn (Linux): SIGTERM when the command that started it dies, however
# it died -- a SIGKILLed CLI must not leave its ephemeral Prefect server running -- and exit at once if the
# command is already gone. The child sets this itself: a `preexec_fn` would run Python in a fork of this
# multithreaded (JAX) process, which can deadlock, and JAX warns on the user's terminal when one runs.
_SERVE = """import ctypes, os, runpy, signal, sys
if sys.platform == "linux":
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(sys.argv[1]):
        sys.exit(0)
sys.argv = ["uvicorn", *sys.argv[2:]]
runpy.run_module("uvicorn", run_name="__main__", alter_sys=True)
"""


class _EphemeralServer:
    """A Prefect API server of this command's own, for when PREFECT_API_URL names none: Prefect's own command
    line for its ephemeral server (`prefect.server.api.server.SubprocessASGIServer`: uvicorn on
    `create_app`, UI off), started here rather than lazily by Prefect so that it runs in its own process
    group, and without importing Prefect's server package into this process (3-4 s of imports on 2 cores,
    for a server that runs in another process).

    Prefect's lazy ephemeral server shares the CLI's process group, so a terminal's Ctrl-C stopped it at
    once, and the unwinding run then spent minutes retrying to report its crashed state to a server that
    was gone. This one does not get the terminal's signals; it outlives the unwinding (the run is recorded
    as crashed) and is stopped when the command exits, after Prefect has flushed its events and logs to it
    (atexit runs last what registered first), or with the CLI's own death (PR_SET_PDEATHSIG).
    `launch()` returns at once: the server boots while the command imports the flow; `api_url()` waits
    for its health check."""

    PORT_IN_USE = 3  # uvicorn's exit status when it cannot bind: another port is tried, as Prefect does

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.port = 0

    def launch(self) -> None:
        import socket

        import prefect
        from prefect.settings import get_current_settings

        with socket.socket() as s:  # a free port now; if it is taken before uvicorn binds it, api_url retries
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE, str(os.getpid()), "--app-dir", str(prefect.__module_path__.parent),
             "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
             "--log-level", "error", "--lifespan", "on"],
            env={**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                 "PREFECT__SERVER_FINAL": "1", **get_current_settings().to_environment_variables(exclude_unset=True)},
            process_group=0)

    def api_url(self) -> str:
        """The server's API URL once it answers its health check (within Prefect's ephemeral startup timeout)."""
        import urllib.error
        import urllib.request

        from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

        if self.proc is None:
            self.launch()
        deadline = time.monotonic() + PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
        while time.monotonic() < deadline:
            if self.proc.poll() == self.PORT_IN_USE:
                self.launch()
                continue
            if self.proc.poll() is not None:
                raise RuntimeError(f"the ephemeral Prefect API server exited with status {self.proc.returncode} "
                                   "(its own output is above)")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/api/health", timeout=5) as r:
                    if r.status == 200:
                        return f"http://127.0.0.1:{self.port}/api"
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise RuntimeError("timed out while waiting for the ephemeral Prefect API server to answer "
                           "(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS)")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


_SERVER: _EphemeralServer | None = None  # one per process, like Prefect's own


def launch_prefect_server() -> None:
    """Start this command's ephemeral Prefect server now, when PREFECT_API_URL names none, so that it boots
    while the command goes on importing; `prefect_api` waits for it."""
    global _SERVER
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value() or _SERVER is not None:
        return
    import atexit

    _SERVER = _EphemeralServer()
    _SERVER.launch()
    atexit.register(_SERVER.stop)  # registered before Prefect's own exit handlers, so it runs after them


@contextlib.contextmanager
def prefect_api() -> Iterator[None]:
    """The Prefect API for one command: PREFECT_API_URL's server when set, else the command's ephemeral server
    (`_EphemeralServer`), waited for here."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        yield
        return
    launch_prefect_server()
    url = _SERVER.api_url()
    with temporary_settings({PREFECT_API_URL: url}):
        os.environ["PREFECT_API_URL"] = url  # threads that Prefect starts read the environment
        try:
            yield
        finally:
            os.environ.pop("PREFECT_API_URL", None)
