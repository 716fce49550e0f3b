"""storage/: one conformance suite run against memory://, file:// and a real S3 server (SeaweedFS)."""

from __future__ import annotations

import base64
import json
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

import storage
from storage import ArtifactError, StorageKeyError, Store, fingerprint

pytestmark = pytest.mark.unit


@pytest.fixture(params=["memory", "file", "s3"])
def root(request, tmp_path):
    if request.param == "memory":
        return f"memory://forgeline-{uuid.uuid4().hex[:8]}"
    if request.param == "file":
        return f"file://{tmp_path}/store"
    request.getfixturevalue("s3_env")
    return f"s3://forgeline/test-{uuid.uuid4().hex[:8]}"


def _stage_dir(tmp_path: Path, files: dict[str, bytes]) -> Path:
    d = tmp_path / f"stage-{uuid.uuid4().hex[:6]}"
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    return d


def test_commit_lookup_fetch_roundtrip(root, tmp_path):
    store = Store(root, cache_dir=tmp_path / "cache")
    fp = fingerprint("demo", {"a": 1}, [])
    assert store.lookup("demo", fp) is None
    ref = store.commit(_stage_dir(tmp_path, {"a.bin": b"x" * 1000, "sub/b.json": b"{}"}), "demo", fp,
                       config={"a": 1}, metadata={"loss": 1.5})
    assert ref.kind == "demo" and ref.fingerprint == fp and ref.metadata == {"loss": 1.5}
    again = store.lookup("demo", fp)
    assert again == ref
    manifest = store.manifest(ref)
    assert set(manifest["files"]) == {"a.bin", "sub/b.json"}
    assert manifest["files"]["a.bin"]["size"] == 1000
    store.verify(ref)
    local = store.fetch(ref)
    assert (local / "a.bin").read_bytes() == b"x" * 1000
    assert (local / "sub" / "b.json").read_bytes() == b"{}"


def test_folder_without_manifest_does_not_exist(root, tmp_path):
    store = Store(root, cache_dir=tmp_path / "cache")
    fp = fingerprint("demo", {"b": 2}, [])
    storage.write_bytes(storage.join(store.prefix("demo", fp), "half-written.bin"), b"partial")
    assert store.lookup("demo", fp) is None
    ref = store.commit(_stage_dir(tmp_path, {"c.bin": b"c"}), "demo", fp, config={})
    # the stale file of the dead attempt was cleared before the new files were written
    assert set(store.manifest(ref)["files"]) == {"c.bin"}
    assert not storage.exists(storage.join(ref.url, "half-written.bin"))


def test_verify_detects_corruption(root, tmp_path):
    store = Store(root, cache_dir=tmp_path / "cache")
    fp = fingerprint("demo", {"c": 3}, [])
    ref = store.commit(_stage_dir(tmp_path, {"w.bin": b"weights"}), "demo", fp, config={})
    storage.write_bytes(ref.file("w.bin"), b"tampered")
    with pytest.raises(ArtifactError, match="w.bin"):
        store.verify(ref)


def test_pointer_is_one_object(root, tmp_path):
    store = Store(root, cache_dir=tmp_path / "cache")
    assert store.read_pointer("draft/current") is None
    ref = store.commit(_stage_dir(tmp_path, {"d": b"1"}), "draft", fingerprint("draft", {}, []), config={})
    store.write_pointer("draft/current", ref, acceptance_length=2.5)
    assert store.read_pointer("draft/current") == ref
    body = json.loads(storage.read_bytes(store.url("pointers/draft/current.json")))
    assert body["acceptance_length"] == 2.5


def test_an_overwrite_is_seen_whole_or_not_at_all(root):
    """write_bytes replacing an object (a checkpoint's latest.json, a pointer): a reader polling it while
    it is rewritten sees the old bytes or the new ones, never an empty or partial object, and a folder
    listing shows no leftover temporary files. (Truncating in place failed this: a SIGKILLed trainer
    left an empty latest.json.)"""
    url = storage.join(root, "ckpt/latest.json")
    payloads = [bytes([i]) * (1 << 18) for i in range(1, 9)]  # 256 KiB each: the write takes a while
    storage.write_bytes(url, payloads[0])
    done, seen = threading.Event(), []

    def poll():
        while not done.is_set():
            seen.append(storage.read_bytes(url))

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        for i in range(40):
            storage.write_bytes(url, payloads[i % len(payloads)])
    finally:
        done.set()
        reader.join(30)
    assert seen and all(b in payloads for b in seen), sorted({len(b) for b in seen if b not in payloads})
    names = [u.rsplit("/", 1)[-1] for u in storage.list_files(storage.join(root, "ckpt"), hidden=True)]
    assert names == ["latest.json"]


def test_list_files_and_dirs(root, tmp_path):
    for rel in ("a/x.txt", "a/y/z.txt", "b.txt"):
        storage.write_bytes(storage.join(root, rel), rel.encode())
    files = storage.list_files(storage.join(root, "a"))
    assert [f.rsplit("/", 2)[-2:] for f in files] == [["a", "x.txt"], ["y", "z.txt"]]
    assert storage.list_files(storage.join(root, "b.txt"))[0].endswith("/b.txt")
    with pytest.raises(FileNotFoundError, match="missing"):
        storage.list_files(storage.join(root, "missing"))
    out = storage.download_dir(storage.join(root, "a"), tmp_path / "dl")
    assert (out / "y" / "z.txt").read_text() == "a/y/z.txt"


@pytest.mark.parametrize("key", ["../escape", "a/../../b", "/abs/path", "s3://other/bucket", "a/.."])
def test_keys_that_escape_are_rejected(key):
    with pytest.raises(StorageKeyError, match="key"):
        storage.join("file:///tmp/root", key)


def test_unsupported_scheme_is_rejected():
    with pytest.raises(StorageKeyError, match="gs"):
        Store("gs://bucket/x")


def test_fingerprint_depends_on_config_and_inputs(tmp_path):
    store = Store(f"file://{tmp_path}")
    ref = store.commit(_stage_dir(tmp_path, {"f": b"1"}), "a", fingerprint("a", {}, []), config={})
    base = fingerprint("b", {"lr": 1e-3}, [ref])
    assert base == fingerprint("b", {"lr": 1e-3}, [ref.digest])
    assert base != fingerprint("b", {"lr": 2e-3}, [ref])
    assert base != fingerprint("b", {"lr": 1e-3}, [])
    assert base != fingerprint("c", {"lr": 1e-3}, [ref])


def test_create_bytes_is_exclusive(root):
    url = storage.join(root, f"once-{uuid.uuid4().hex[:6]}.json")
    assert storage.create_bytes(url, b"first") is True
    assert storage.create_bytes(url, b"second") is False
    assert storage.read_bytes(url) == b"first"


def test_lease_is_exclusive_until_released(root):
    a, b = storage.Lease(root, "demo/fp", ttl=30), storage.Lease(root, "demo/fp", ttl=30)
    assert a.try_acquire()
    try:
        assert not b.try_acquire()
        a.check()
    finally:
        a.release()
    assert b.try_acquire()
    b.check()
    b.release(remove=True)
    with pytest.raises(FileNotFoundError):  # no lease file is left (S3 servers may keep the empty folder)
        storage.list_files(storage.join(root, "leases/demo/fp"), hidden=True)


def test_expired_lease_is_taken_over_and_the_old_holder_is_fenced(root, monkeypatch):
    """Expiry is driven by moving the lease clock, not by sleeping: a sleep-based version failed
    under CI's load when the store was slow enough for a 3 s lease to expire before the first check."""
    from storage import leases

    old = storage.Lease(root, "demo/expiring", ttl=60)
    assert old.try_acquire()
    old._stop.set()  # a holder that stopped heartbeating (frozen, partitioned)
    old._thread.join()
    new = storage.Lease(root, "demo/expiring", ttl=60)
    assert not new.try_acquire()  # 60 s left on the old holder's lease
    expires_at = old._read(old.generation)["expires_at"]
    monkeypatch.setattr(leases, "_clock", lambda: expires_at - 1.0)
    assert not new.try_acquire()  # one second before the expiry: still held
    monkeypatch.setattr(leases, "_clock", lambda: expires_at + 1.0)
    assert new.try_acquire()
    with pytest.raises(storage.LeaseLost, match="taken over"):
        old.check()  # what the commit calls before writing its manifest
    old.release()
    new.check()  # the old holder's release did not touch the new generation
    new.release(remove=True)


def test_create_bytes_has_one_winner_under_a_race(root):
    """Eight threads create the same key at once, three times: exactly one wins each time and the object
    holds the winner's bytes, whole (the fence of a lease rests on this)."""

    def create(url: str, i: int, start: threading.Barrier, wins: list[int]) -> None:
        start.wait()
        if storage.create_bytes(url, f"writer {i} ".encode() * 100):
            wins.append(i)  # list.append is atomic under the GIL

    for attempt in range(3):
        url = storage.join(root, f"race-{uuid.uuid4().hex[:6]}/k.json")
        start, wins = threading.Barrier(8), []
        threads = [threading.Thread(target=create, args=(url, i, start, wins)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(wins) == 1, f"attempt {attempt}: {len(wins)} winners"
        assert storage.read_bytes(url) == f"writer {wins[0]} ".encode() * 100


class _Paused:
    """Runs `store.commit(..., lease=holder)` in a thread that stops right after the lease check inside
    `Lease.publish` (past every check, before the manifest write reaches the store) until `resume()`."""

    def __init__(self, store: Store, holder: storage.Lease, staged: Path, fp: str):
        self.at_write, self._go = threading.Event(), threading.Event()
        self.ref: storage.ArtifactRef | None = None
        self.error: BaseException | None = None
        check = holder.check

        def check_then_pause() -> None:
            check()
            if sys._getframe(1).f_code.co_name == "publish":  # the check that guards the manifest write
                self.at_write.set()
                assert self._go.wait(120), "never resumed"

        holder.check = check_then_pause

        def commit() -> None:
            try:
                self.ref = store.commit(staged, "demo", fp, config={}, lease=holder)
            except BaseException as e:
                self.error = e

        self.thread = threading.Thread(target=commit, name="paused-holder")
        self.thread.start()
        assert self.at_write.wait(120), f"the holder never reached its manifest write ({self.error!r})"

    def resume(self) -> None:
        self._go.set()
        self.thread.join(120)
        assert not self.thread.is_alive()


@pytest.mark.parametrize("wakes", ["before the newer commit", "after the newer commit", "after the lease is removed"])
def test_a_paused_holder_cannot_publish_over_the_holder_that_took_over(root, tmp_path, monkeypatch, wakes):
    """Kleppmann's fencing scenario: holder 1 passes its lease check, pauses before its manifest write,
    sleeps through its expiry; holder 2 takes over and commits (or is still computing). When holder 1
    wakes, the store refuses its commit (LeaseLost) and holder 2's manifest is the one that stands. With a
    check-then-write commit, holder 1's manifest would land over or before holder 2's."""
    from storage import leases

    store = Store(root, cache_dir=tmp_path / "cache")
    fp = fingerprint("demo", {"fenced": wakes}, [])
    old = store.lease("demo", fp)
    assert old.try_acquire()
    old._stop.set()  # a frozen holder does not heartbeat
    old._thread.join()
    paused = _Paused(store, old, _stage_dir(tmp_path, {"w.bin": b"old holder", "old-only.bin": b"o"}), fp)
    try:
        expires_at = old._read(old.generation)["expires_at"]
        monkeypatch.setattr(leases, "_clock", lambda: expires_at + 1.0)  # holder 1 slept through its expiry
        new = store.lease("demo", fp)
        assert new.try_acquire() and new.generation == old.generation + 1
        staged = _stage_dir(tmp_path, {"w.bin": b"new holder"})
        if wakes == "before the newer commit":
            paused.resume()
            assert store.lookup("demo", fp) is None  # holder 1 published nothing, not even before holder 2
            ref = store.commit(staged, "demo", fp, config={}, lease=new)
            new.check()  # its own commit does not count as a takeover
        else:
            ref = store.commit(staged, "demo", fp, config={}, lease=new)
            new.release(remove=wakes == "after the lease is removed")
            paused.resume()
    finally:
        paused.resume()
    assert isinstance(paused.error, storage.LeaseLost), paused.error
    assert paused.ref is None
    assert store.lookup("demo", fp) == ref
    assert set(store.manifest(ref)["files"]) == {"w.bin"}
    store.verify(ref)
    assert (store.fetch(ref) / "w.bin").read_bytes() == b"new holder"
    if wakes == "after the lease is removed":  # holder 1 withdrew the fence it made in the removed folder
        with pytest.raises(FileNotFoundError):
            storage.list_files(storage.join(root, f"leases/demo/{fp}"), hidden=True)
    old.release()
    if new.generation is not None:
        new.release(remove=True)


def test_a_commit_decided_by_its_fence_is_completed_by_the_next_process(root, tmp_path, monkeypatch):
    """A holder whose fence says "committed" but which stopped before writing its manifest: the next
    process to find the lease free writes the recorded manifest instead of taking the lease over (and
    recomputing over the files the commit names)."""
    from storage import leases

    store = Store(root, cache_dir=tmp_path / "cache")
    fp = fingerprint("demo", {"rolled": 1}, [])
    holder = store.lease("demo", fp)
    assert holder.try_acquire()
    create = leases.fs.create_bytes

    def store_goes_away_at_the_manifest(url: str, data: bytes) -> bool:
        if url.endswith("/" + storage.MANIFEST):
            raise ConnectionError("the store went away")
        return create(url, data)

    monkeypatch.setattr(leases.fs, "create_bytes", store_goes_away_at_the_manifest)
    with pytest.raises(ConnectionError):
        store.commit(_stage_dir(tmp_path, {"w.bin": b"w"}), "demo", fp, config={}, lease=holder)
    monkeypatch.setattr(leases.fs, "create_bytes", create)
    holder.release()  # what run_once does on an error
    assert store.lookup("demo", fp) is None
    taker = store.lease("demo", fp)
    assert not taker.try_acquire()  # generation 1 committed: not taken over ...
    ref = store.lookup("demo", fp)  # ... but published
    assert ref is not None and set(store.manifest(ref)["files"]) == {"w.bin"}
    store.verify(ref)
    assert not taker.try_acquire()


def test_a_crafted_fence_cannot_make_a_taker_write_outside_the_lease(root):
    """A fence record is store content: one that "commits" a key outside the lease's own name counts as
    superseded, so the lease is taken over and nothing is written at that key."""
    name = f"demo/crafted-{uuid.uuid4().hex[:6]}"
    folder = storage.join(root, f"leases/{name}")
    storage.write_bytes(storage.join(folder, "0000000001.json"), json.dumps({"token": "t", "expires_at": 0}).encode())
    record = {"outcome": "committed", "token": "t", "key": "pointers/releases/evil.json",
              "data": base64.b64encode(b'{"ref": "owned"}').decode()}
    storage.write_bytes(storage.join(folder, "0000000001.fence"), json.dumps(record).encode())
    lease = storage.Lease(root, name, ttl=30)
    assert lease.try_acquire() and lease.generation == 2
    assert not storage.exists(storage.join(root, "pointers/releases/evil.json"))
    with pytest.raises(StorageKeyError, match="lease's own keys"):
        lease.publish(storage.join(root, "pointers/releases/evil.json"), b"{}")
    lease.release(remove=True)


def test_lease_of_a_dead_process_on_this_host_is_free_at_once(root):
    import json
    import socket
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    body = {"token": "x", "host": socket.gethostname(), "pid": int(dead.stdout), "expires_at": time.time() + 3600}
    storage.write_bytes(storage.join(root, "leases/demo/dead/0000000001.json"), json.dumps(body).encode())
    lease = storage.Lease(root, "demo/dead", ttl=30)
    assert lease.try_acquire() and lease.generation == 2
    lease.release(remove=True)


def test_download_dir_refuses_keys_from_a_hostile_listing(tmp_path):
    """A listing is remote input: a key that climbs out of the destination is refused before anything is
    written (memory:// stores keys verbatim, like a crafted bucket)."""
    root = f"memory://hostile-{uuid.uuid4().hex[:6]}"
    storage.write_bytes(storage.join(root, "ckpt/config.json"), b"{}")
    import fsspec

    fsspec.filesystem("memory").pipe_file(f"/{root[len('memory://'):]}/ckpt/../../../escaped.txt", b"owned")
    dest = tmp_path / "deep" / "dl"
    with pytest.raises(StorageKeyError, match=r"escaped\.txt"):
        storage.download_dir(storage.join(root, "ckpt"), dest)
    assert not list(tmp_path.rglob("escaped.txt")) and not dest.exists()


def test_manifest_with_an_escaping_file_key_is_refused(root, tmp_path):
    import json

    store = Store(root, cache_dir=tmp_path / "cache")
    ref = store.commit(_stage_dir(tmp_path, {"w.bin": b"w"}), "demo", fingerprint("demo", {"e": 1}, []), config={})
    m = json.loads(storage.read_bytes(ref.file("manifest.json")))
    m["files"]["../../../outside.bin"] = m["files"]["w.bin"]
    storage.write_bytes(ref.file("manifest.json"), json.dumps(m).encode())
    with pytest.raises(ArtifactError, match="outside.bin"):
        store.fetch(store.load(ref.url))
    assert not list(tmp_path.rglob("outside.bin")) and not (tmp_path / "cache").exists()


def test_fetch_detects_a_corrupt_byte_and_names_the_file(root, tmp_path):
    store = Store(root, cache_dir=tmp_path / "cache")
    ref = store.commit(_stage_dir(tmp_path, {"w.bin": bytes(range(256)) * 8, "ok.txt": b"fine"}), "demo",
                       fingerprint("demo", {"f": 1}, []), config={})
    data = bytearray(storage.read_bytes(ref.file("w.bin")))
    data[777] ^= 0x01  # one flipped bit, same size
    storage.write_bytes(ref.file("w.bin"), bytes(data))
    with pytest.raises(storage.IntegrityError, match=r"w\.bin: sha256 does not match") as e:
        store.fetch(ref)
    assert ref.file("w.bin") in str(e.value) and "\n" not in str(e.value)


def test_audit_lists_missing_extra_and_altered_files(root, tmp_path):
    store = Store(root, cache_dir=tmp_path / "cache")
    ref = store.commit(_stage_dir(tmp_path, {"a.bin": b"a", "b.bin": b"b", "c/d.bin": b"d"}), "demo",
                       fingerprint("demo", {"g": 1}, []), config={})
    assert store.audit(ref) == []
    storage.rm(ref.file("a.bin"))
    storage.write_bytes(ref.file("b.bin"), b"B")
    storage.write_bytes(ref.file("c/.hidden"), b"planted")
    problems = store.audit(ref)
    assert [(p.what, p.rel) for p in problems] == [("missing", "a.bin"), ("altered", "b.bin"), ("extra", "c/.hidden")]
    assert str(problems[0]) == f"missing: {ref.file('a.bin')}" and ref.file("b.bin") in str(problems[1])


def test_digest_names_content_not_the_run(tmp_path):
    """Two commits of the same bytes -- in other stores, at other times, with other timings and other
    volatile measurements -- have one digest; one changed content byte changes it."""
    fp = fingerprint("demo", {"h": 1}, [])
    refs = []
    for i, weights in enumerate((b"same", b"same", b"diff")):
        store = Store(f"file://{tmp_path}/store{i}")
        stage = _stage_dir(tmp_path, {"w.bin": weights, "tensorboard/events": f"wall time {i}".encode(),
                                      "timing.json": f'{{"s": {i}}}'.encode()})
        refs.append(store.commit(stage, "demo", fp, config={}, metadata={"seconds": i},
                                 volatile=("tensorboard/*", "*timing.json")))
        assert set(store.manifest(refs[-1])["volatile"]) == {"tensorboard/events", "timing.json"}
    assert refs[0].digest == refs[1].digest != refs[2].digest
    assert refs[0].url != refs[1].url


def test_one_s3_client_per_process_and_environment(s3_env, monkeypatch):
    """Every S3 call of a process shares one s3fs client (building one costs 0.1-0.3 s, which a client per call
    paid on every exists/read/write), and a changed endpoint or credential gets a new one, which sees no answer
    the old one cached: a write through one client is visible to the next read through the other."""
    from storage import fs as sfs

    url = f"s3://forgeline/clients-{uuid.uuid4().hex[:8]}/a.txt"
    storage.write_bytes(url, b"one")
    first = sfs._fs(url)[0]
    assert storage.read_bytes(url) == b"one" and sfs._fs(url)[0] is first
    assert storage.exists(url) and sfs._fs(url)[0] is first
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_env["AWS_ACCESS_KEY_ID"])  # unchanged: the same client
    assert sfs._fs(url)[0] is first
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-3")  # a changed environment: a new client
    second = sfs._fs(url)[0]
    assert second is not first
    storage.write_bytes(url, b"two")  # written by the new client
    monkeypatch.setenv("AWS_DEFAULT_REGION", s3_env["AWS_DEFAULT_REGION"])
    assert sfs._fs(url)[0] is first and storage.read_bytes(url) == b"two"  # the old one reads it, nothing stale
