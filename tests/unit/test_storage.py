"""storage/: one conformance suite run against memory://, file:// and a real S3 server (SeaweedFS)."""

from __future__ import annotations

import json
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
