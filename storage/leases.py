"""Leases: at most one process computes a stage at a time, across hosts, with only the store to agree on;
and a holder that lost its lease cannot commit, because the store itself refuses its commit.

A lease on `name` is the newest generation `<root>/leases/<name>/<generation>.json`. Taking a lease
means creating the next generation with the store's exclusive create (`storage.fs.create_bytes`: S3
`If-None-Match: *`, link(2) on local disk), so when two processes race for the same generation exactly
one wins. The holder rewrites its own generation file every `ttl / 3` seconds with a new expiry
(heartbeat); nobody else ever writes it. Another process takes the lease over only when it is free:
released by its holder, expired (the holder stopped heartbeating: killed, preempted, cut off), or held
by a process on this host that no longer runs (the local case of a killed run, which needs no wait).

Fencing. Checking the lease just before writing the manifest is not enough: a holder can pause (a
stop-the-world pause, a suspended VM, a partition) between its check and its write, sleep through its
expiry while another process takes over and commits, then wake and write over the newer commit. The
cure is a fencing token that the *store* checks as part of the write (Martin Kleppmann, "How to do
distributed locking", 2016: https://martin.kleppmann.com/2016/02/08/how-to-do-distributed-locking.html).
An object store cannot make a write to one key conditional on another key (S3's conditional writes,
https://docs.aws.amazon.com/AmazonS3/latest/userguide/conditional-writes.html, compare one object
with itself), so the decision for each generation `g` lives in one key, its fence `<g>.fence`, and
the token `g` is part of that key's name. The fence is created exactly once, with the same exclusive
create, by whichever comes first:

* holder `g` committing (`publish`): the fence records "committed", with the key and bytes of the
  manifest, and only then is the manifest written (itself with an exclusive create);
* a process taking the lease over from `g` (`try_acquire`): the fence records "superseded", and only
  then does the taker create generation `g + 1`.

So a paused holder cannot publish over a newer holder: generation `g + 1` exists only after fence
`g` says "superseded", and from then on holder `g`'s create of its fence fails, whenever it wakes
(before or after the newer holder's commit), and it raises LeaseLost without writing the manifest.
Conversely, once fence `g` says "committed" nobody takes generation `g` over: that record is the
commit point, and the manifest its published copy. A holder that dies between the two leaves a
record that the next process to find the lease free completes (rolls forward: it writes the recorded
bytes with an exclusive create, only under the lease's own `name/`), so nothing waits forever.
Fences stay until the lease folder is removed after a commit; a holder that wakes after that can
create its old fence again, but its manifest create then fails on the newer holder's manifest
(manifests are never overwritten by a commit), and it withdraws its fence and raises LeaseLost.

What the store fences is the commit point, not every byte: a holder paused in the middle of its
uploads can still write files under the artifact's prefix after a takeover (`Store.commit` checks
the lease before clearing and uploading, which narrows that window without closing it). The manifest
that stands is the newer holder's, so `forgeline verify` names any file a late writer changed.

The same pattern as a lease on a key-value store (etcd, Consul) or Chubby's sequencer, reduced to
the two object-store primitives every backend has: conditional create and single-object overwrite.
Expiry compares wall clocks of different hosts, so `ttl` must exceed any clock skew between them.
"""

from __future__ import annotations

import base64
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
    """An exclusive, expiring claim on `name` under `root` (a store URL); `publish` is its fenced commit."""

    def __init__(self, root: str, name: str, *, ttl: float = DEFAULT_TTL):
        self.root = fs.normalize_url(root)
        self.name = fs.check_key(name.strip("/"))
        self.folder = fs.join(self.root, f"leases/{self.name}")
        self.ttl = ttl
        self.token = uuid.uuid4().hex
        self.generation: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lost = False

    # -- reading the lease folder ----------------------------------------------------------------

    def _generations(self) -> list[int]:
        """Every generation that has a body or a fence (a fence alone still uses its number up)."""
        try:
            names = [u.rsplit("/", 1)[-1] for u in fs.list_files(self.folder)]
        except FileNotFoundError:
            return []
        stems = (n.rsplit(".", 1) for n in names if n.endswith((".json", ".fence")))
        return sorted({int(stem) for stem, _ in stems if stem.isdigit()})

    def _read(self, generation: int) -> dict[str, Any] | None:
        try:
            return json.loads(fs.read_bytes(self._url(generation)))
        except FileNotFoundError:
            return None
        except ValueError:  # a torn or foreign file: treat as expired rather than block forever
            return {"expires_at": 0}

    def _url(self, generation: int) -> str:
        return fs.join(self.folder, f"{generation:010d}.json")

    def _fence_url(self, generation: int) -> str:
        return fs.join(self.folder, f"{generation:010d}.fence")

    def _fence(self, generation: int) -> dict[str, Any] | None:
        """How generation `generation` ended: None while undecided; a committed record (`token`, `key`,
        `data`: the publication's key under the store root and its bytes) when its holder committed;
        otherwise {"outcome": "superseded", ...}. Anything that is not a well-formed commit of a key
        under this lease's name counts as superseded: the store is input, and a crafted record must
        neither block the lease nor make a taker write outside `name/`."""
        try:
            raw = fs.read_bytes(self._fence_url(generation))
        except FileNotFoundError:
            return None
        try:
            record = json.loads(raw)
            if record.get("outcome") == "committed":
                key, token = record["key"], record["token"]
                if isinstance(key, str) and isinstance(token, str) and self._owns(key):
                    return {**record, "data": base64.b64decode(record["data"], validate=True)}
            return {**record, "outcome": "superseded"}
        except (ValueError, TypeError, KeyError, AttributeError, fs.StorageKeyError):  # not a dict, bad base64
            return {"outcome": "superseded"}

    def _owns(self, key: str) -> bool:
        """Whether `key` (relative to the store root) is one this lease guards: under `name/`."""
        fs.check_key(key)  # no `..`, no absolute path, no scheme
        return key.startswith(self.name + "/") and key != self.name + "/"

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

    def _me(self) -> dict[str, Any]:
        return {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                "pid_start": _start_time(os.getpid())}

    def _body(self, **extra: Any) -> bytes:
        return json.dumps({**self._me(), "expires_at": _clock() + self.ttl, **extra}).encode()

    def try_acquire(self) -> bool:
        """Take the lease if it is free; True when this process now holds it. Taking it over from
        generation g first decides fence g as superseded (so holder g can no longer commit); if holder
        g committed first, its commit is completed instead and the lease stays where it is (False)."""
        generation, body = self.current()
        if not self._free(body):
            return False
        if generation:
            superseded = {"outcome": "superseded", "generation": generation, "by": self._me(), "at": _clock()}
            if not fs.create_bytes(self._fence_url(generation), json.dumps(superseded).encode()):
                fence = self._fence(generation)
                if fence is None:
                    return False  # withdrawn while we looked: try again on the next poll
                if fence["outcome"] == "committed":
                    self._roll_forward(fence)
                    return False
        if not fs.create_bytes(self._url(generation + 1), self._body()):
            return False  # another process took this generation first
        self.generation, self._lost = generation + 1, False
        _HELD.add(self.token)
        for old in self._generations():  # earlier bodies are history now; their fences stay (see above)
            if old < self.generation:
                fs.rm(self._url(old))
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, name="lease-heartbeat", daemon=True)
        self._thread.start()
        return True

    def _roll_forward(self, fence: dict[str, Any]) -> None:
        """Complete a commit whose holder stopped between its fence and its publication."""
        url = fs.join(self.root, fence["key"])
        if fs.create_bytes(url, fence["data"]):
            log.warning("lease %s: completed the commit of %s left by pid %s on %s", self.folder, url,
                        fence.get("pid"), fence.get("host"))

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
        """Raise LeaseLost unless this process still holds the lease (newest generation, its token, its
        fence undecided or decided by this holder's own commit). An early answer, not the guarantee:
        `publish` is what the store fences."""
        if self.generation is None or self._lost:
            raise LeaseLost(f"lease {self.folder} is not held")
        generation, body = self.current()
        if generation != self.generation or body is None or body.get("token") != self.token:
            self._lost = True
            raise LeaseLost(f"lease {self.folder} was taken over by {self.describe(body)}")
        fence = self._fence(self.generation)
        if fence is not None and not (fence["outcome"] == "committed" and fence.get("token") == self.token):
            self._lost = True
            raise LeaseLost(f"lease {self.folder} was taken over by {self._by(fence)}")

    @staticmethod
    def _by(fence: dict[str, Any]) -> str:
        by = fence.get("by") if isinstance(fence.get("by"), dict) else fence
        return f"pid {by.get('pid')} on {by.get('host')}"

    def publish(self, url: str, data: bytes) -> None:
        """Write `data` to `url` (a key under the lease's `name/`) as this holder's commit, fenced by the
        store: the exclusive create of this generation's fence decides between this commit and a
        takeover (module docstring), and the publication itself is an exclusive create. LeaseLost, with
        nothing written at `url`, when the lease was taken over, however long this holder paused."""
        url = fs.normalize_url(url)
        key = url[len(self.root) + 1:] if url.startswith(self.root + "/") else ""
        if not key or not self._owns(key):
            raise fs.StorageKeyError(f"{url} is not under the lease's own keys ({self.root}/{self.name}/)")
        self.check()  # fail early; the guarantee is the create below, however long a pause here lasts
        generation = self.generation
        fence_url = self._fence_url(generation)
        record = {"outcome": "committed", "generation": generation, **self._me(), "key": key,
                  "data": base64.b64encode(data).decode(), "at": _clock()}
        if not fs.create_bytes(fence_url, json.dumps(record).encode()):
            fence = self._fence(generation)
            if fence is None or fence["outcome"] != "committed" or fence.get("token") != self.token \
                    or fence["key"] != key or fence["data"] != data:
                self._lost = True
                raise LeaseLost(f"lease {self.folder} was taken over by "
                                f"{self._by(fence) if fence else 'another process'} before this commit")
        if fs.create_bytes(url, data) or fs.read_bytes(url) == data:
            return  # published (by us, or by a process that completed our commit while we paused)
        # Our fence was created in a lease folder removed after a newer holder's commit: withdraw it.
        fs.rm(fence_url)
        self._lost = True
        raise LeaseLost(f"{url} was committed by another holder while this one held an expired lease")

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
