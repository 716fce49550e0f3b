"""The gang launcher: one multi-host stage = one JAX job of N processes, run, watched and stopped as a unit.

No orchestrator starts a multi-process JAX job as one pipeline step (Prefect runs one process per flow run;
Kubernetes needs a JobSet or an indexed Job, which infra/jobset renders by hand). `run_gang` does it on one
machine: it starts N copies of a command with the coordinator address, process count and process id set
(`JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>`, `JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`), each in its own
process group, with `FORGELINE_GANG_PARENT` naming the launcher so that a member dies with it
(tasks/member.py: `die_with_launcher`; no `preexec_fn`, which is unsafe in a multithreaded JAX process), and
then

- streams every process's output, line by line and tagged with its index (`[p1] ...`), to `on_line`
  (the stage's Prefect logs);
- fails the whole gang as soon as any process exits with an error, or when some processes finished and
  the rest did not follow within `finish_grace` (a peer waiting on a coordinator that is gone): the
  others are stopped (SIGTERM, then SIGKILL after `kill_grace`), and `GangFailed` names the process, its
  exit status and its last line. JAX's own failure detection would take minutes (the init timeout, the
  coordination service's heartbeat timeout); the launcher needs the time it takes to notice an exit;
- stops every process when it is interrupted itself (Ctrl-C, SIGTERM from Prefect's cancellation).

A retry of the stage starts a new gang, which resumes from the stage's last committed checkpoint
(tasks/training/checkpoints.py), exactly as a single-process stage does.

The same contract as torchrun's elastic agent with `max_restarts=0` (any worker failure tears the group
down) and JobSet's `failurePolicy` (a failed pod fails the whole set).
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

log = logging.getLogger("forgeline.gang")

ROOT = Path(__file__).resolve().parent.parent


class GangFailed(RuntimeError):
    """A process of the gang failed (or the gang hung); every other process has been stopped."""

    def __init__(self, message: str, process: int | None = None, returncode: int | None = None,
                 last_line: str = ""):
        super().__init__(message)
        self.process, self.returncode, self.last_line = process, returncode, last_line


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _stop(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM to every live process group, SIGKILL to what is left after `grace` seconds."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while any(p.poll() is None for p in live) and time.monotonic() < deadline:
        time.sleep(0.05)
    for p in live:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


def gang_env(index: int, hosts: int, address: str, base: Mapping[str, str] | None = None,
             extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Process `index`'s environment: `base` (default: this process's), the repository importable, the JAX
    multi-process variables, then `extra` (per-process settings such as CUDA_VISIBLE_DEVICES)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update({"JAX_COORDINATOR_ADDRESS": address, "JAX_NUM_PROCESSES": str(hosts),
                "JAX_PROCESS_ID": str(index), "PYTHONUNBUFFERED": "1", "FORGELINE_GANG_PARENT": str(os.getpid())})
    env.setdefault("JAX_INIT_TIMEOUT", "300")
    return {**env, **(extra or {})}


def run_gang(
    argv: Sequence[str],
    hosts: int,
    *,
    env: Mapping[str, str] | None = None,
    per_process_env: Sequence[Mapping[str, str]] | None = None,
    on_line: Callable[[int, str], None] | None = None,
    timeout: float | None = None,
    finish_grace: float = 60.0,
    kill_grace: float = 10.0,
    cwd: str | os.PathLike[str] | None = None,
) -> None:
    """Run `argv` as processes 0..hosts-1 of one JAX job on this machine; return when all exit 0.

    Raises GangFailed (after stopping the rest) when a process fails, when the others do not finish within
    `finish_grace` seconds of the first that did, or after `timeout` seconds in all."""
    if hosts < 1:
        raise ValueError(f"hosts={hosts}: must be >= 1")
    if per_process_env is not None and len(per_process_env) != hosts:
        raise ValueError(f"per_process_env has {len(per_process_env)} entries for {hosts} processes")
    address = f"127.0.0.1:{free_port()}"
    lines: queue.Queue[tuple[int, str | None]] = queue.Queue()
    tails = [collections.deque(maxlen=20) for _ in range(hosts)]
    procs: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []

    def read(i: int, stream) -> None:
        for raw in stream:
            lines.put((i, raw.rstrip("\n")))
        lines.put((i, None))

    def drain(block: float = 0.0) -> None:
        try:
            item = lines.get(timeout=block) if block else lines.get_nowait()
            while True:
                i, line = item
                if line is not None and line.strip():
                    tails[i].append(line)
                    if on_line is not None:
                        on_line(i, line)
                item = lines.get_nowait()
        except queue.Empty:
            pass

    def last_line(i: int) -> str:
        """The process's last line, preferring its `error:` line over what a dying runtime printed after."""
        errors = [t for t in tails[i] if t.startswith("error:")]
        return errors[-1] if errors else (tails[i][-1] if tails[i] else "(no output)")

    log.info("gang: starting %d processes of `%s` (coordinator %s)", hosts, " ".join(argv), address)
    started = time.monotonic()
    try:
        for i in range(hosts):
            p = subprocess.Popen(list(argv), env=gang_env(i, hosts, address, env,
                                                          per_process_env[i] if per_process_env else None),
                                 cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, bufsize=1, process_group=0)
            procs.append(p)
            readers.append(threading.Thread(target=read, args=(i, p.stdout), daemon=True, name=f"gang-p{i}"))
            readers[-1].start()
        first_done: float | None = None
        while True:
            drain(0.2)
            codes = [p.poll() for p in procs]
            failed = [i for i, rc in enumerate(codes) if rc not in (None, 0)]
            if failed:
                i = failed[0]
                _stop(procs, kill_grace)
                for t in readers:
                    t.join(timeout=5)
                drain()
                raise GangFailed(f"process {i} of {hosts} {_describe(codes[i])}; its last line: {last_line(i)}",
                                 process=i, returncode=codes[i], last_line=last_line(i))
            if all(rc == 0 for rc in codes):
                break
            now = time.monotonic()
            if first_done is None and any(rc == 0 for rc in codes):
                first_done = now
            if first_done is not None and now - first_done > finish_grace:
                i = next(i for i, rc in enumerate(codes) if rc is None)
                _stop(procs, kill_grace)
                raise GangFailed(f"process {i} of {hosts} was still running {finish_grace:.0f}s after the others "
                                 f"finished; stopped. Its last line: {last_line(i)}", process=i,
                                 last_line=last_line(i))
            if timeout is not None and now - started > timeout:
                _stop(procs, kill_grace)
                raise GangFailed(f"the gang ran past its {timeout:.0f}s limit; stopped")
        for t in readers:
            t.join(timeout=5)
        drain()
        log.info("gang: %d processes finished in %.1fs", hosts, time.monotonic() - started)
    finally:
        _stop(procs, kill_grace)  # interrupted (KeyboardInterrupt, SIGTERM -> SystemExit): nothing left behind
