"""Leases: at most one process computes a stage at a time, across hosts, with only the store to agree on.

A lease on `name` is the newest generation `<root>/leases/<name>/<generation>.json`. Taking a lease
means creating the next generation with the store's exclusive create (`storage.fs.create_bytes`: S3
`If-None-Match: *`, O_EXCL on local disk), so when two processes race for the same generation exactly
one wins. The holder rewrites its own generation file every `ttl / 3` seconds with a new expiry
(heartbeat); nobody else ever writes it. Another process takes the lease over only when it is free:
released by its holder, expired (the holder stopped heartbeating: killed, preempted, cut off), or held
by a process on this host that no longer runs (the local case of a killed run, which needs no wait).
A holder that finds a newer generation than its own has lost the lease; `check()` says so, and the
commit protocol calls it just before writing a manifest, so a holder that slept through its expiry
cannot commit over the process that took over.

The same pattern as a lease on a key-value store (etcd, Consul) or Chubby's sequencer, reduced to
the two object-store primitives every backend has: conditional create and single-object overwrite.
Expiry compares wall clocks of different hosts, so `ttl` must exceed any clock skew between them.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from storage import fs

log = logging.getLogger("forgeline.storage")

DEFAULT_TTL = float(os.environ.get("FORGELINE_LEASE_TTL", "120"))
_HELD: set[str] = set()  # tokens of the leases this process holds now


def _clock() -> float:
    """Wall-clock seconds that expiries are written and compared in (one seam, so tests can move time)."""
    return time.time()


class LeaseLost(RuntimeError):
    """The lease expired and another process took it over; this holder must not commit."""


def _start_time(pid: int) -> str | None:
    """A process's start time (Linux /proc), so that a reused pid is not taken for the old holder."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return started is None or _start_time(pid) in (None, started)


class Lease:
    """An exclusive, expiring claim on `name` under `root` (a store URL)."""

    def __init__(self, root: str, name: str, *, ttl: float = DEFAULT_TTL):
        self.folder = fs.join(root, f"leases/{name}")
        self.ttl = ttl
        self.token = uuid.uuid4().hex
        self.generation: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost = False

    # -- reading the lease folder ----------------------------------------------------------------

    def _generations(self) -> list[int]:
        try:
            names = [u.rsplit("/", 1)[-1] for u in fs.list_files(self.folder)]
        except FileNotFoundError:
            return []
        return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())

    def _read(self, generation: int) -> dict[str, Any] | None:
        try:
            return json.loads(fs.read_bytes(self._url(generation)))
        except FileNotFoundError:
            return None
        except ValueError:  # a torn or foreign file: treat as expired rather than block forever
            return {"expires_at": 0}

    def _url(self, generation: int) -> str:
        return fs.join(self.folder, f"{generation:010d}.json")

    def current(self) -> tuple[int, dict[str, Any] | None]:
        """(newest generation, its body) -- (0, None) when nobody ever held the lease."""
        gens = self._generations()
        return (gens[-1], self._read(gens[-1])) if gens else (0, None)

    @staticmethod
    def _free(body: dict[str, Any] | None) -> bool:
        if body is None or body.get("released") or body.get("expires_at", 0) < _clock():
            return True
        if body.get("host") != socket.gethostname():
            return False
        if body.get("pid") == os.getpid():
            return body.get("token") not in _HELD  # left behind by an earlier attempt in this process
        return not _alive(int(body.get("pid", -1)), body.get("pid_start"))

    @staticmethod
    def describe(body: dict[str, Any] | None) -> str:
        if body is None:
            return "nobody"
        left = body.get("expires_at", 0) - _clock()
        return f"pid {body.get('pid')} on {body.get('host')} (lease renewed, expires in {left:.0f}s)"

    # -- taking, renewing and giving back ---------------------------------------------------------

    def _body(self, **extra: Any) -> bytes:
        return json.dumps({"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                           "pid_start": _start_time(os.getpid()), "expires_at": _clock() + self.ttl,
                           **extra}).encode()

    def try_acquire(self) -> bool:
        """Take the lease if it is free; True when this process now holds it."""
        generation, body = self.current()
        if not self._free(body):
            return False
        if not fs.create_bytes(self._url(generation + 1), self._body()):
            return False  # another process took this generation first
        self.generation, self._lost = generation + 1, False
        _HELD.add(self.token)
        for old in self._generations():  # earlier generations are history now
            if old < self.generation:
                fs.rm(self._url(old))
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, name="lease-heartbeat", daemon=True)
        self._thread.start()
        return True

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.check()
                fs.write_bytes(self._url(self.generation), self._body())
            except LeaseLost:
                log.warning("lease %s lost to another process", self.folder)
                return
            except Exception as e:  # the store is briefly unreachable: keep trying until the lease expires
                log.warning("lease %s: heartbeat failed (%s)", self.folder, fs._first_line(e))

    def check(self) -> None:
        """Raise LeaseLost unless this process still holds the lease (newest generation, its token)."""
        if self.generation is None or self._lost:
            raise LeaseLost(f"lease {self.folder} is not held")
        generation, body = self.current()
        if generation != self.generation or body is None or body.get("token") != self.token:
            self._lost = True
            raise LeaseLost(f"lease {self.folder} was taken over by {self.describe(body)}")

    def release(self, *, remove: bool = False) -> None:
        """Give the lease back: mark it released, or (`remove`, once the work is committed and no one
        needs the lease any more) delete the lease folder. Never raises: an unreachable store only
        means others wait for the expiry."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        _HELD.discard(self.token)
        if self.generation is None:
            return
        try:
            if remove:
                fs.rm(self.folder)
            elif not self._lost:
                fs.write_bytes(self._url(self.generation), self._body(released=True))
        except Exception as e:
            log.warning("lease %s: could not release (%s); it expires in %.0fs", self.folder, fs._first_line(e),
                        self.ttl)
        self.generation = None
