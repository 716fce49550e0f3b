"""Artifacts: content-addressed folders committed by writing `manifest.json` last.

The commit protocol (shared/reference/prefect-practice.md §12.7, the same idea as Orbax's
commit-file mode and Hadoop's `_SUCCESS` markers):

1. a stage computes into a local staging folder;
2. every file is uploaded under `<root>/<kind>/<fingerprint>/`, where the fingerprint hashes the
   stage name, its canonical config, the code version and the digests of its inputs' manifests;
3. `manifest.json` (kind, files with sha256 and size, config, inputs, code version, time, metrics)
   is written **last** as one object -- the commit point. A folder without a manifest does not
   exist for readers, and is cleared before the next attempt writes into it;
4. readers trust only prefixes whose manifest parses; `verify` re-hashes the files;
5. promotion is a single-object overwrite of a pointer file (`pointers/<name>.json`).

S3 has no atomic rename, so nothing here renames.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from storage import fs

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_CODE_PACKAGES = ("models", "tasks", "storage")


class ArtifactError(RuntimeError):
    """A manifest that is missing, malformed, or whose files do not match their digests."""


@dataclass(frozen=True)
class ArtifactRef:
    """What stages pass each other: where an artifact is and which bytes it holds, never the bytes."""

    url: str
    kind: str
    fingerprint: str
    digest: str  # sha256 of the manifest bytes: names the exact content of the whole artifact
    metadata: dict[str, Any] = field(default_factory=dict)  # small: metrics, stats

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ArtifactRef:
        return cls(**d)

    def file(self, rel: str) -> str:
        return fs.join(self.url, rel)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


@cache
def code_version() -> str:
    """sha256 over the source of the packages that produce artifacts (models, tasks, storage).

    Hashing the source rather than a git SHA makes an installed copy, a dirty checkout and a
    clean clone of the same code agree, and makes edits to flows/ or tests/ not invalidate caches.
    """
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256(f"python{sys.version_info[0]}.{sys.version_info[1]}".encode())  # builtin corpora vary
    for pkg in _CODE_PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


@cache
def git_sha() -> str | None:
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def fingerprint(kind: str, config: dict[str, Any], inputs: Iterable[ArtifactRef | str]) -> str:
    """The stage's address: equal fingerprint <=> same stage, config, code and input bytes."""
    digests = sorted(i.digest if isinstance(i, ArtifactRef) else str(i) for i in inputs)
    payload = {"kind": kind, "config": config, "inputs": digests, "code": code_version(),
               "format": FORMAT_VERSION}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:20]


class Store:
    """An artifact store rooted at a URL (`file://…`, `s3://bucket/prefix`, `memory://…`)."""

    def __init__(self, root: str, cache_dir: str | Path | None = None):
        self.root = fs.normalize_url(root)
        default_cache = Path(os.environ.get("FORGELINE_CACHE", Path.home() / ".cache" / "forgeline"))
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache / "artifacts"

    def __repr__(self) -> str:
        return f"Store({self.root!r})"

    def url(self, key: str) -> str:
        return fs.join(self.root, key)

    def prefix(self, kind: str, fp: str) -> str:
        return self.url(f"{kind}/{fp}")

    # -- reading ---------------------------------------------------------------------------------

    def lookup(self, kind: str, fp: str) -> ArtifactRef | None:
        """The committed artifact at `<kind>/<fp>`, or None when there is no (valid) manifest."""
        return self.load(self.prefix(kind, fp), missing_ok=True)

    def load(self, url: str, *, missing_ok: bool = False) -> ArtifactRef | None:
        murl = fs.join(url, MANIFEST)
        try:
            raw = fs.read_bytes(murl)
        except FileNotFoundError:
            if missing_ok:
                return None
            raise ArtifactError(f"no committed artifact at {url} (missing {MANIFEST})") from None
        try:
            m = json.loads(raw)
            return ArtifactRef(url=fs.normalize_url(url), kind=m["kind"], fingerprint=m["fingerprint"],
                               digest=hashlib.sha256(raw).hexdigest(), metadata=m.get("metadata", {}))
        except (ValueError, KeyError) as e:
            raise ArtifactError(f"{murl}: malformed manifest ({e})") from None

    def manifest(self, ref: ArtifactRef) -> dict[str, Any]:
        raw = fs.read_bytes(ref.file(MANIFEST))
        if hashlib.sha256(raw).hexdigest() != ref.digest:
            raise ArtifactError(f"{ref.file(MANIFEST)}: manifest changed since it was referenced")
        return json.loads(raw)

    def verify(self, ref: ArtifactRef) -> None:
        """Re-hash every file of the artifact against its manifest; raises ArtifactError on mismatch."""
        for rel, meta in self.manifest(ref)["files"].items():
            h = hashlib.sha256()
            try:
                with fs.open_url(ref.file(rel), "rb") as f:
                    while block := f.read(1 << 20):
                        h.update(block)
            except FileNotFoundError:
                raise ArtifactError(f"{ref.file(rel)}: listed in the manifest but missing") from None
            if h.hexdigest() != meta["sha256"]:
                raise ArtifactError(f"{ref.file(rel)}: sha256 does not match the manifest")

    def fetch(self, ref: ArtifactRef) -> Path:
        """A local folder with the artifact's files: the folder itself for `file://` stores, else a
        digest-keyed cache that is filled once (and verified against the manifest while copying)."""
        local = fs.local_path(ref.url)
        if local is not None:
            return local
        dest = self.cache_dir / ref.digest
        if (dest / ".complete").exists():
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=f".{ref.digest[:12]}-", dir=self._mk_cache()))
        try:
            for rel, meta in self.manifest(ref)["files"].items():
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                fs.download_file(ref.file(rel), tmp / rel)
                if sha256_file(tmp / rel) != meta["sha256"]:
                    raise ArtifactError(f"{ref.file(rel)}: sha256 does not match the manifest")
            (tmp / ".complete").touch()
            if dest.exists():
                shutil.rmtree(dest)
            tmp.rename(dest)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        return dest

    def _mk_cache(self) -> Path:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        return self.cache_dir

    # -- writing ---------------------------------------------------------------------------------

    def commit(
        self,
        local_dir: Path,
        kind: str,
        fp: str,
        *,
        config: dict[str, Any],
        inputs: Iterable[ArtifactRef] = (),
        metadata: dict[str, Any] | None = None,
    ) -> ArtifactRef:
        """Upload `local_dir` to `<kind>/<fp>/` and write the manifest last. Returns the new ref."""
        prefix = self.prefix(kind, fp)
        existing = self.lookup(kind, fp)
        if existing is not None:
            return existing  # someone committed the same content first: content-addressed, so equal
        fs.rm(prefix)  # leftovers of an attempt that died before its manifest
        files: dict[str, dict[str, Any]] = {}
        for path in sorted(p for p in Path(local_dir).rglob("*") if p.is_file()):
            rel = path.relative_to(local_dir).as_posix()
            if rel == MANIFEST:
                raise ArtifactError(f"{path}: a stage may not write its own {MANIFEST}")
            files[rel] = {"sha256": sha256_file(path), "size": path.stat().st_size}
        if not files:
            raise ArtifactError(f"stage {kind} produced no files in {local_dir}")
        for rel in files:
            fs.upload_file(Path(local_dir) / rel, fs.join(prefix, rel))
        manifest = {
            "format": FORMAT_VERSION,
            "kind": kind,
            "fingerprint": fp,
            "files": files,
            "config": config,
            "inputs": [{"kind": i.kind, "url": i.url, "digest": i.digest} for i in inputs],
            "code_version": code_version(),
            "git_sha": git_sha(),
            "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "metadata": metadata or {},
        }
        fs.write_bytes(fs.join(prefix, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True).encode())
        ref = self.load(prefix)
        assert ref is not None
        return ref

    # -- pointers (promotion) --------------------------------------------------------------------

    def write_pointer(self, name: str, ref: ArtifactRef, **extra: Any) -> None:
        """Promote: one single-object overwrite of `pointers/<name>.json`."""
        body = {"ref": ref.to_dict(), "updated_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                **extra}
        fs.write_bytes(self.url(f"pointers/{name}.json"), json.dumps(body, indent=1).encode())

    def read_pointer(self, name: str) -> ArtifactRef | None:
        try:
            body = json.loads(fs.read_bytes(self.url(f"pointers/{name}.json")))
        except FileNotFoundError:
            return None
        return ArtifactRef.from_dict(body["ref"])
