"""Artifacts: content-addressed folders committed by writing `manifest.json` last.

The commit protocol (the same idea as Orbax's commit-file mode and Hadoop's `_SUCCESS` markers):

1. a stage computes into a local staging folder;
2. every file is uploaded under `<root>/<kind>/<fingerprint>/`, where the fingerprint hashes the
   stage name, its canonical config, the code version and the digests of its inputs;
3. `manifest.json` (kind, files with sha256 and size, config, inputs, code version, time, metrics)
   is written **last** as one object -- the commit point. A folder without a manifest does not
   exist for readers, and is cleared before the next attempt writes into it (under the stage's
   lease, `storage.leases`, so that only one process ever writes a prefix). Under a lease the
   manifest is written by `Lease.publish`: an exclusive create that the store itself refuses once the
   lease was taken over (a fencing token, not a check just before the write), so a holder that
   paused past its expiry never publishes over the holder that took over;
4. readers trust only prefixes whose manifest parses; every read of an artifact's files checks them
   against the manifest (`fetch`), and `audit`/`verify` re-hash them on demand;
5. promotion is a single-object overwrite of a pointer file (`pointers/<name>.json`).

An artifact's **digest** names its content: sha256 over the canonical JSON of its kind, fingerprint,
config, input digests, code version and content files. It leaves out what describes one run rather
than the result -- the commit time, the git SHA, stage metadata (seconds, tokens/s) and the files a
stage declares *volatile* (wall-clock measurements and logs, e.g. TensorBoard events) -- which the
manifest still records and `audit` still re-hashes. So a stage recomputed after a crash, on another
machine or by the other execution mode, has the digest of the first computation whenever it produced
the same bytes, and everything downstream keeps its fingerprint.

S3 has no atomic rename, so nothing here renames.
"""

from __future__ import annotations

import datetime as dt
import fnmatch
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from storage import fs
from storage.leases import Lease

log = logging.getLogger("forgeline.storage")

MANIFEST = "manifest.json"
FORMAT_VERSION = 2


class ArtifactError(RuntimeError):
    """A manifest that is missing or malformed, or files that do not match it. Never transient: retrying
    the same read gives the same answer."""


class IntegrityError(ArtifactError):
    """Committed bytes that do not match their manifest (or a manifest that changed since a ref named it):
    the artifact is damaged, and recomputing over it would hide that."""


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


def content_digest(manifest: dict[str, Any]) -> str:
    """The artifact's digest: what it is, not when or where it was made (see the module docstring)."""
    content = {k: manifest.get(k) for k in ("format", "kind", "fingerprint", "config", "code_version", "files")}
    content["inputs"] = sorted(i["digest"] for i in manifest.get("inputs", []))
    return hashlib.sha256(canonical_json(content).encode()).hexdigest()


def _check_manifest(m: Any, where: str) -> dict[str, Any]:
    """A parsed manifest whose shape and file keys are safe to act on (the store may be hostile)."""
    if not isinstance(m, dict) or not isinstance(m.get("kind"), str) or not isinstance(m.get("fingerprint"), str):
        raise ArtifactError(f"{where}: malformed manifest (kind and fingerprint must be strings)")
    for section in ("files", "volatile"):
        entries = m.get(section, {})
        if not isinstance(entries, dict):
            raise ArtifactError(f"{where}: malformed manifest ({section} is not a mapping)")
        for rel, meta in entries.items():
            try:
                fs.check_key(rel)
            except fs.StorageKeyError as e:
                raise ArtifactError(f"{where}: {e}") from None
            if not rel or rel == MANIFEST or not isinstance(meta, dict) or not isinstance(meta.get("sha256"), str) \
                    or not isinstance(meta.get("size"), int):
                raise ArtifactError(f"{where}: malformed manifest entry {rel!r}")
    if not isinstance(m.get("inputs", []), list) or not all(isinstance(i, dict) and isinstance(i.get("digest"), str)
                                                            for i in m.get("inputs", [])):
        raise ArtifactError(f"{where}: malformed manifest (inputs)")
    return m


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


def fingerprint(kind: str, config: dict[str, Any], inputs: Iterable[ArtifactRef | str], code: str = "") -> str:
    """An artifact's address: equal fingerprint <=> same kind, config, input content and `code` (the version
    of the code that computes it, as the caller defines it: tasks/code.py for the stages)."""
    digests = sorted(i.digest if isinstance(i, ArtifactRef) else str(i) for i in inputs)
    payload = {"kind": kind, "config": config, "inputs": digests, "code": code, "format": FORMAT_VERSION}
    return hashlib.sha256(canonical_json(payload).encode()).hexdigest()[:20]


@dataclass(frozen=True)
class Problem:
    """One file that does not match its manifest."""

    what: str  # missing | altered | extra
    rel: str
    url: str
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.what}: {self.url}" + (f" ({self.detail})" if self.detail else "")


def volatile_match(rel: str, patterns: Iterable[str]) -> bool:
    """Whether `rel` matches one of the glob patterns (`*` crosses folders: `tensorboard/*`)."""
    return any(fnmatch.fnmatchcase(rel, p) for p in patterns)


def cache_root() -> Path:
    """forgeline's per-user cache folder: `$FORGELINE_CACHE`, default ~/.cache/forgeline (downloaded artifacts,
    compiled programs, indexes built from local files; each user of it keys what it keeps)."""
    return Path(os.environ.get("FORGELINE_CACHE", Path.home() / ".cache" / "forgeline"))


class Store:
    """An artifact store rooted at a URL (`file://…`, `s3://bucket/prefix`, `memory://…`)."""

    def __init__(self, root: str, cache_dir: str | Path | None = None):
        self.root = fs.normalize_url(root)
        self.cache_dir = Path(cache_dir) if cache_dir else cache_root() / "artifacts"

    def __repr__(self) -> str:
        return f"Store({self.root!r})"

    def url(self, key: str) -> str:
        return fs.join(self.root, key)

    def prefix(self, kind: str, fp: str) -> str:
        return self.url(f"{kind}/{fp}")

    def key_of(self, url: str) -> str:
        """`url` relative to this store's root (what lineage records, so that a bundle moves with its store);
        StorageKeyError when `url` is not inside the store."""
        url = fs.normalize_url(url)
        if not url.startswith(self.root + "/"):
            raise fs.StorageKeyError(f"{url} is not inside the store {self.root}")
        return fs.check_key(url[len(self.root) + 1:])

    def lease(self, kind: str, fp: str) -> Lease:
        """The lease that makes one process at a time compute `<kind>/<fp>` (storage.leases)."""
        return Lease(self.root, f"{kind}/{fp}")

    # -- reading ---------------------------------------------------------------------------------

    def lookup(self, kind: str, fp: str) -> ArtifactRef | None:
        """The committed artifact at `<kind>/<fp>`, or None when there is no (valid) manifest."""
        return self.load(self.prefix(kind, fp), missing_ok=True)

    def load(self, url: str, *, missing_ok: bool = False) -> ArtifactRef | None:
        ref, _ = self._load(url, missing_ok=missing_ok)
        return ref

    def _load(self, url: str, *, missing_ok: bool = False) -> tuple[ArtifactRef | None, dict[str, Any]]:
        murl = fs.join(url, MANIFEST)
        try:
            raw = fs.read_bytes(murl)
        except FileNotFoundError:
            if missing_ok:
                return None, {}
            raise ArtifactError(f"no committed artifact at {url} (missing {MANIFEST})") from None
        except IsADirectoryError:
            raise ArtifactError(f"{murl}: not a file") from None
        try:
            m = json.loads(raw)
        except ValueError as e:
            raise ArtifactError(f"{murl}: malformed manifest ({e})") from None
        m = _check_manifest(m, murl)
        digest = content_digest(m) if m.get("format", 1) >= 2 else hashlib.sha256(raw).hexdigest()
        return ArtifactRef(url=fs.normalize_url(url), kind=m["kind"], fingerprint=m["fingerprint"],
                           digest=digest, metadata=m.get("metadata", {})), m

    def manifest(self, ref: ArtifactRef) -> dict[str, Any]:
        """The manifest `ref` names; IntegrityError when its content is no longer the one `ref` was made from."""
        now, m = self._load(ref.url)
        if now.digest != ref.digest:
            raise IntegrityError(f"{ref.file(MANIFEST)}: the artifact changed since it was referenced "
                                 f"(digest {now.digest[:16]}, expected {ref.digest[:16]})")
        return m

    def audit(self, ref: ArtifactRef) -> list[Problem]:
        """Every problem with the artifact's files: listed but missing, altered (sha256 or size), or present but
        not listed. An empty list means every byte matches the manifest."""
        m = self.manifest(ref)
        listed = {**m.get("files", {}), **m.get("volatile", {})}
        problems = []
        for rel, meta in sorted(listed.items()):
            try:
                digest, size = _hash_url(ref.file(rel))
            except FileNotFoundError:
                problems.append(Problem("missing", rel, ref.file(rel)))
                continue
            if (digest, size) != (meta["sha256"], meta["size"]):
                problems.append(Problem("altered", rel, ref.file(rel), f"sha256 {digest[:16]}, size {size}; the "
                                        f"manifest says {meta['sha256'][:16]}, size {meta['size']}"))
        base = fs.normalize_url(ref.url)
        for url in fs.list_files(base, hidden=True):
            rel = url[len(base):].lstrip("/")
            if rel != MANIFEST and rel not in listed:
                problems.append(Problem("extra", rel, url, "not in the manifest"))
        return problems

    def verify(self, ref: ArtifactRef) -> None:
        """Re-hash every file of the artifact against its manifest; IntegrityError naming the first problem."""
        problems = self.audit(ref)
        if problems:
            raise IntegrityError(f"{problems[0]}" + (f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""))

    def fetch(self, ref: ArtifactRef) -> Path:
        """A local folder with the artifact's files, every one checked against the manifest as it is read:
        the folder itself for `file://` stores (re-hashed in place), else a digest-keyed cache that is filled
        once (hashed while copying). A mismatch raises IntegrityError naming the file in the store."""
        m = self.manifest(ref)
        files = {**m.get("files", {}), **m.get("volatile", {})}
        local = fs.local_path(ref.url)
        if local is not None:
            for rel, meta in files.items():
                _expect(ref.file(rel), local / rel, meta)
            return local
        dest = self.cache_dir / ref.digest
        if (dest / ".complete").exists():
            return dest
        tmp = Path(tempfile.mkdtemp(prefix=f".{ref.digest[:12]}-", dir=self._mk_cache()))
        try:
            targets = {rel: fs.local_file(tmp, rel, source=ref.file(MANIFEST)) for rel in files}
            for rel, meta in files.items():
                targets[rel].parent.mkdir(parents=True, exist_ok=True)
                fs.download_file(ref.file(rel), targets[rel])
                _expect(ref.file(rel), targets[rel], meta)
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
        volatile: Iterable[str] = (),
        lease: Lease | None = None,
        code_version: str = "",
        source_version: str | None = None,
    ) -> ArtifactRef:
        """Upload `local_dir` to `<kind>/<fp>/` and write the manifest last. Returns the new ref.

        Files matching a `volatile` glob are measurements of this run (listed and hashed, left out of the
        digest). Under a `lease` (the stage's, held by this process) the lease is checked before the
        prefix is cleared and the files uploaded, and the manifest is written with `lease.publish`: the
        store refuses it, with LeaseLost, once another process took the lease over, however long this
        one paused. Without a lease the manifest is one plain overwrite."""
        prefix = self.prefix(kind, fp)
        existing = self.lookup(kind, fp)
        if existing is not None:
            return existing  # someone committed the same content first: content-addressed, so equal
        if lease is not None:
            lease.check()  # a holder that lost its lease clears and uploads nothing (early, not fenced)
        fs.rm(prefix)  # leftovers of an attempt that died before its manifest
        files: dict[str, dict[str, Any]] = {}
        measured: dict[str, dict[str, Any]] = {}
        volatile = tuple(volatile)
        for path in sorted(p for p in Path(local_dir).rglob("*") if p.is_file()):
            rel = path.relative_to(local_dir).as_posix()
            if rel == MANIFEST:
                raise ArtifactError(f"{path}: a stage may not write its own {MANIFEST}")
            entry = {"sha256": sha256_file(path), "size": path.stat().st_size}
            (measured if volatile_match(rel, volatile) else files)[rel] = entry
        if not files:
            raise ArtifactError(f"stage {kind} produced no files in {local_dir}")
        log.info("%s: uploading %d files to %s", kind, len(files) + len(measured), prefix)
        for rel in (*files, *measured):
            fs.upload_file(Path(local_dir) / rel, fs.join(prefix, rel))
        manifest = {
            "format": FORMAT_VERSION,
            "kind": kind,
            "fingerprint": fp,
            "files": files,
            "volatile": measured,
            "config": config,
            "inputs": [{"kind": i.kind, "url": i.url, "digest": i.digest} for i in inputs],
            "code_version": code_version,  # of the code that computed it (part of the digest)
            "source_version": source_version,  # of the whole tree that ran it (recorded only)
            "git_sha": git_sha(),
            "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "metadata": metadata or {},
        }
        manifest["digest"] = content_digest(manifest)
        body = json.dumps(manifest, indent=1, sort_keys=True).encode()
        if lease is not None:
            lease.publish(fs.join(prefix, MANIFEST), body)
        else:
            fs.write_bytes(fs.join(prefix, MANIFEST), body)
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


def _hash_url(url: str) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with fs.open_url(url, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            size += len(block)
    return h.hexdigest(), size


def _expect(url: str, local: Path, meta: dict[str, Any]) -> None:
    """IntegrityError naming `url` (the file in the store) unless `local` holds the manifest's bytes."""
    try:
        ok = local.stat().st_size == meta["size"] and sha256_file(local) == meta["sha256"]
    except FileNotFoundError:
        raise IntegrityError(f"{url}: listed in the manifest but missing") from None
    if not ok:
        raise IntegrityError(f"{url}: sha256 does not match the manifest (the committed artifact is damaged; "
                             f"`forgeline verify` lists every bad file)")
