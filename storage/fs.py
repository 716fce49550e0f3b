"""URLs to filesystems: the only place in forgeline that knows URL schemes.

A tiny surface over `fsspec.core.url_to_fs`, in the spirit of fsspec/s3fs themselves:

    file:///abs/path, plain paths   -> local disk (the default store is ./artifacts)
    s3://bucket/prefix              -> s3fs; endpoint and credentials come from the standard AWS_*
                                       environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) or
                                       fsspec config, never from code
    memory://name                   -> fsspec's in-process memory filesystem (tests)

Everything here works on whole URLs; `storage.artifacts` builds the commit protocol on top.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import fsspec
from fsspec.core import url_to_fs

SCHEMES = ("file", "s3", "memory")


class StorageKeyError(ValueError):
    """A key that would escape its store's root, or a URL with an unsupported scheme."""


class StoreUnavailable(OSError):
    """A store that cannot be used at all: unreachable, unwritable, or not a folder. Names the URL."""


def scheme_of(url: str) -> str:
    """`s3://b/k` -> "s3"; a plain path -> "file"."""
    if "://" not in url:
        return "file"
    return url.split("://", 1)[0].lower()


def normalize_url(url: str) -> str:
    """A canonical URL: plain and relative paths become absolute `file://` URLs; no trailing slash."""
    scheme = scheme_of(url)
    if scheme not in SCHEMES:
        raise StorageKeyError(f"unsupported URL scheme {scheme!r} in {url!r}; use one of {', '.join(SCHEMES)}")
    if scheme == "file":
        path = url[len("file://"):] if url.startswith("file://") else url
        return "file://" + str(Path(path).expanduser().resolve())
    return url.rstrip("/")


def _fs(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    url = normalize_url(url)
    if scheme_of(url) == "s3":
        fs = _s3()
        return fs, fs._strip_protocol(url)
    return url_to_fs(url)


# The S3 environment an s3fs client is built from: a change in any of these (a test starting a new server,
# rotated credentials) gets a new client; otherwise the process keeps one.
_S3_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
           "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_PROFILE")
_S3_CLIENTS: dict[tuple, fsspec.AbstractFileSystem] = {}
_S3_LOCK = threading.Lock()


def _s3() -> fsspec.AbstractFileSystem:
    """The process's s3fs client for the current AWS_* environment. Building one (a botocore session,
    credential resolution, a connection pool) costs 0.1-0.3 s, which a client per call paid on every
    `exists`, read and write: a smoke release against a local S3 server spent two thirds of its time
    there (173 s against 59 s on a local folder). Kept per process id (an s3fs client is bound to its
    event loop thread, which a forked child does not have) and without s3fs's listings cache, so no
    answer it gives is stale: every `exists`, `info` and listing goes to the server."""
    key = (os.getpid(), *(os.environ.get(k) for k in _S3_ENV))
    with _S3_LOCK:
        if key not in _S3_CLIENTS:
            endpoint = key[1] or key[2]
            kwargs: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False}
            if endpoint:
                kwargs["endpoint_url"] = endpoint
            _S3_CLIENTS[key] = fsspec.filesystem("s3", **kwargs)
        return _S3_CLIENTS[key]


def join(url: str, key: str) -> str:
    """`url/key` after checking that `key` stays under `url` (no `..`, no absolute path, no scheme)."""
    check_key(key)
    return normalize_url(url) + "/" + key.strip("/") if key.strip("/") else normalize_url(url)


def check_key(key: str) -> str:
    """Reject keys that escape the root they are joined to."""
    if "\x00" in key:
        raise StorageKeyError(f"storage key {key!r} contains a NUL byte")
    if "://" in key or key.startswith(("/", "\\")) or (len(key) > 1 and key[1] == ":"):
        raise StorageKeyError(f"storage key {key!r} must be relative to the store root")
    norm = posixpath.normpath(key.replace("\\", "/")) if key else ""
    if norm == ".." or norm.startswith("../") or any(part == ".." for part in key.replace("\\", "/").split("/")):
        raise StorageKeyError(f"storage key {key!r} escapes the store root")
    return key


# -- Reading and writing whole URLs -------------------------------------------------------------


def open_url(url: str, mode: str = "rb", **kwargs: Any) -> IO:
    """Open a file URL; the caller closes it (use it as a context manager)."""
    fs, path = _fs(url)
    if "w" in mode or "a" in mode:
        parent = posixpath.dirname(path)
        if parent and scheme_of(url) != "s3":
            fs.makedirs(parent, exist_ok=True)
    return fs.open(path, mode, **kwargs)


def exists(url: str) -> bool:
    fs, path = _fs(url)
    return fs.exists(path)


def is_dir(url: str) -> bool:
    fs, path = _fs(url)
    return fs.isdir(path)


def read_bytes(url: str) -> bytes:
    fs, path = _fs(url)
    return fs.cat_file(path)


def read_ranges(url: str, ranges: list[tuple[int, int]]) -> list[bytes]:
    """The bytes `[start, end)` of the object at `url` for each range: one ranged GET each on S3 (sent
    concurrently), seek + read on local files. Nothing else of the object is transferred."""
    if not ranges:
        return []
    fs, path = _fs(url)
    if len(ranges) == 1:  # s3fs's cat_ranges costs ~0.2 s a call whatever the size (measured); cat_file ~0.03
        return [fs.cat_file(path, start=ranges[0][0], end=ranges[0][1])]
    return fs.cat_ranges([path] * len(ranges), [a for a, _ in ranges], [b for _, b in ranges], on_error="raise")


def size_of(url: str) -> int:
    fs, path = _fs(url)
    return int(fs.size(path))


def write_bytes(url: str, data: bytes) -> None:
    """A single-object write that readers see whole or not at all, the one atomic primitive we rely on:
    S3 `PutObject` is atomic per key; on local disk the bytes go to a hidden temporary file in the same
    folder that then replaces the name with rename(2), which is atomic
    (https://pubs.opengroup.org/onlinepubs/9699919799/functions/rename.html) -- opening the name with
    `wb` would truncate it first, and a process killed between the truncate and the write would leave an
    empty object (a checkpoint pointer nobody can parse)."""
    fs_, path = _fs(url)
    if scheme_of(url) != "file":
        with open_url(url, "wb") as f:
            f.write(data)
        return
    _local_publish(fs_, path, data, os.replace)


def _local_publish(fs_: fsspec.AbstractFileSystem, path: str, data: bytes, publish: Callable[[str, str], None]) -> None:
    """Write `data` to a hidden temporary file beside local `path`, then `publish(tmp, path)` it (os.replace:
    overwrite; os.link: only if the name is free, FileExistsError otherwise); the temporary file never stays."""
    parent = posixpath.dirname(path)
    if parent:
        fs_.makedirs(parent, exist_ok=True)
    tmp = posixpath.join(parent, f".{posixpath.basename(path)}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        publish(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def create_bytes(url: str, data: bytes) -> bool:
    """Write `url` only if no object is there yet: True when this call created it, False when it already
    existed. The store's one compare-and-set, used by leases and their fenced commits (storage.leases).

    The object appears whole or not at all, so a reader never sees it half-written: S3 `PutObject` with
    `If-None-Match: *` (https://docs.aws.amazon.com/AmazonS3/latest/userguide/conditional-writes.html);
    on local disk the bytes go to a hidden temporary file that is then hard-linked to the name, and
    link(2) fails when the name exists (https://pubs.opengroup.org/onlinepubs/9699919799/functions/link.html;
    an `O_EXCL` create would show readers an empty file until its bytes are written); `memory://` checks
    and stores under a process lock (the store lives in this process)."""
    fs_, path = _fs(url)
    scheme = scheme_of(url)
    if scheme == "s3":
        try:
            fs_.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        except OSError as e:  # servers that omit the failed condition's name come back as a plain EINVAL
            code = getattr(getattr(e, "__cause__", None), "response", {}).get("Error", {}).get("Code")
            if code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise
        return True
    if scheme == "memory":
        with _MEMORY_CREATE:
            if fs_.exists(path):
                return False
            fs_.pipe_file(path, data)
        return True
    try:
        _local_publish(fs_, path, data, os.link)
    except FileExistsError:
        return False
    return True


_MEMORY_CREATE = threading.Lock()


def check_store(url: str) -> None:
    """Fail fast, with one line naming `url`, when a store cannot hold artifacts: a `file://` path that is
    a file or cannot be created or written, an S3 endpoint that does not answer, a bucket that is missing
    or refuses these credentials. Writes and deletes one small probe object."""
    url = normalize_url(url)
    local = local_path(url)
    if local is not None:
        if local.exists() and not local.is_dir():
            raise StoreUnavailable(errno.ENOTDIR, f"store {url} is not a folder")
        try:
            local.mkdir(parents=True, exist_ok=True)
            probe = local / f".forgeline-probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise StoreUnavailable(e.errno or errno.EACCES,
                                   f"store {url} is not writable ({e.strerror or type(e).__name__})") from None
        return
    probe = join(url, f".forgeline-probe-{uuid.uuid4().hex}")
    try:
        if exists(url) and not is_dir(url):
            raise StoreUnavailable(errno.ENOTDIR, f"store {url} is not a folder")
        write_bytes(probe, b"")
        rm(probe)
    except StoreUnavailable:
        raise
    except PermissionError as e:
        raise StoreUnavailable(errno.EACCES, f"store {url} refused the credentials ({_first_line(e)})") from None
    except FileNotFoundError:
        raise StoreUnavailable(errno.ENOENT, f"store {url}: no such bucket") from None
    except Exception as e:  # botocore's connection errors are not OSErrors
        raise StoreUnavailable(errno.EHOSTUNREACH, f"store {url} is unreachable ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def list_files(url: str, *, hidden: bool = False) -> list[str]:
    """The URL itself if it is a file; every file under it if it is a folder; glob matches if it has `*`.
    Files whose name starts with "." are left out unless `hidden`.

    Returns full URLs, sorted. Raises FileNotFoundError naming the URL when nothing is there.
    """
    url = normalize_url(url)
    fs, path = _fs(url)
    scheme = scheme_of(url)
    if "*" in path:
        found = [p for p in fs.glob(path) if fs.isfile(p)]
    elif fs.isdir(path):
        # (some S3 servers keep an emptied folder as a marker object that find() reports as the folder itself)
        found = [p for p in fs.find(path) if p.rstrip("/") != path.rstrip("/")
                 and (hidden or not posixpath.basename(p).startswith("."))]
    elif fs.exists(path):
        found = [path]
    else:
        found = []
    if not found:
        raise FileNotFoundError(f"no such file or folder: {url}")
    return sorted(_unstrip(scheme, p) for p in found)


def _unstrip(scheme: str, path: str) -> str:
    if scheme == "file":
        return "file://" + path
    if scheme == "memory":
        return "memory://" + path.lstrip("/")
    return f"{scheme}://{path}"


def rm(url: str) -> None:
    """Delete a file or a folder recursively; missing is fine."""
    fs, path = _fs(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def upload_dir(local_dir: str | Path, url: str) -> list[str]:
    """Copy every file under `local_dir` to `url/<relative path>`; returns the relative paths copied."""
    local_dir = Path(local_dir)
    rels = sorted(p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*") if p.is_file())
    for rel in rels:
        upload_file(local_dir / rel, join(url, rel))
    return rels


def upload_file(local: str | Path, url: str) -> None:
    if scheme_of(url) == "file":
        dest = Path(normalize_url(url)[len("file://"):])
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(local, dest)
        return
    fs, path = _fs(url)
    fs.put_file(str(local), path)


def download_dir(url: str, local_dir: str | Path) -> Path:
    """Copy every file under the folder `url` into `local_dir` (created); returns `local_dir`.

    The remote listing is not trusted: every key is checked (no `..`, no absolute path) before anything
    is created locally, so a crafted bucket cannot write outside `local_dir`."""
    base = normalize_url(url)
    local_dir = Path(local_dir)
    files = [(file_url, local_file(local_dir, file_url[len(base):].lstrip("/"), source=base))
             for file_url in list_files(base)]
    for file_url, dest in files:
        dest.parent.mkdir(parents=True, exist_ok=True)
        download_file(file_url, dest)
    return local_dir


def local_file(local_dir: Path, rel: str, *, source: str) -> Path:
    """`local_dir / rel` for a key read from a listing or a manifest at `source`, refused (StorageKeyError
    naming `source`) when the key is empty or would land outside `local_dir`."""
    try:
        check_key(rel)
        dest, root = (local_dir / rel).resolve(), local_dir.resolve()
        inside = bool(rel.strip("/")) and root in dest.parents
    except (StorageKeyError, ValueError, OSError):
        inside = False
    if not inside:
        raise StorageKeyError(f"{source}: refusing the listed key {rel!r}: it does not name a file inside the "
                              f"folder (a crafted or broken listing)")
    return local_dir / rel


def download_file(url: str, local: str | Path) -> None:
    if scheme_of(url) == "file":
        shutil.copyfile(normalize_url(url)[len("file://"):], local)
        return
    fs, path = _fs(url)
    fs.get_file(path, str(local))


def local_path(url: str) -> Path | None:
    """The local filesystem path behind a `file://` URL (or plain path); None for remote URLs."""
    if scheme_of(url) != "file":
        return None
    return Path(normalize_url(url)[len("file://"):])


def listing_signature(url: str) -> list[list[Any]]:
    """(relative path, size, etag-or-mtime) for every file under `url`: cheap change detection for
    inputs that are not our artifacts (a user's base checkpoint), without hashing terabytes."""
    base = normalize_url(url)
    fs_, _ = _fs(base)
    out = []
    for file_url in list_files(base):
        info = fs_.info(_fs(file_url)[1])
        stamp = info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified")
        out.append([file_url[len(base):].lstrip("/"), info.get("size"), str(stamp)])
    return out
