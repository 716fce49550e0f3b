"""safetensors files: validated headers and lazy, sliced reads of (sharded) checkpoints, from local paths,
file:// URLs or any URL storage/ reads. The format is huggingface/safetensors' (an 8-byte little-endian header
length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw bytes); the single-file and
`model.safetensors.index.json` layouts are transformers'. Never pickle. docs/formats/hf-checkpoint.md,
"Streamed, sharded loading", says how slices are read; models/hf.py maps these tensors to and from models.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import tempfile
import threading
from collections.abc import Iterator, Mapping
from typing import IO, Any
from urllib.parse import urlparse
from urllib.request import url2pathname

import ml_dtypes
import numpy as np

from models import views

SAFETENSORS_DTYPES = {  # safetensors dtype tag -> bytes per element
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "E8M0": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}
NUMPY_DTYPES = {  # safetensors dtype tag -> numpy dtype (ml_dtypes supplies bf16 / fp8 / e8m0)
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2, "E8M0": ml_dtypes.float8_e8m0fnu,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu, "I16": np.int16, "U16": np.uint16,
    "F16": np.float16, "BF16": ml_dtypes.bfloat16, "I32": np.int32, "U32": np.uint32, "F32": np.float32,
    "I64": np.int64, "U64": np.uint64, "F64": np.float64,
}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# ------------------------------------------------------------------------------------------------
# URLs: local paths and file:// directly, anything else through storage/
# ------------------------------------------------------------------------------------------------


def _local_path(path_or_url: str) -> str | None:
    parsed = urlparse(str(path_or_url))
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and os.name == "nt"):
        return str(path_or_url)
    if parsed.scheme == "file":
        return url2pathname(parsed.netloc + parsed.path) if parsed.netloc else url2pathname(parsed.path)
    return None


@contextlib.contextmanager
def readable_dir(path_or_url: str) -> Iterator[str]:
    """A local folder holding the contents of `path_or_url` for the duration of the block."""
    local = _local_path(path_or_url)
    if local is not None:
        yield local
        return
    from storage import download_dir  # lazy: local paths must not depend on storage/

    with tempfile.TemporaryDirectory(prefix="forgeline-dl-") as tmp:
        download_dir(path_or_url, tmp)
        yield tmp


@contextlib.contextmanager
def writable_dir(path_or_url: str) -> Iterator[str]:
    """A local folder whose contents end up at `path_or_url` when the block exits without error."""
    local = _local_path(path_or_url)
    if local is not None:
        os.makedirs(local, exist_ok=True)
        yield local
        return
    from storage import upload_dir

    with tempfile.TemporaryDirectory(prefix="forgeline-ul-") as tmp:
        yield tmp
        upload_dir(tmp, path_or_url)


# ------------------------------------------------------------------------------------------------
# Reading safetensors with validation
# ------------------------------------------------------------------------------------------------


def read_safetensors_header(path: str, f: IO[bytes] | None = None,
                            size: int | None = None) -> dict[str, dict[str, Any]]:
    """Parse and validate a safetensors header: {name: {dtype, shape, data_offsets}}; ValueError naming
    `path` if bad. Reads only the header: from the local file `path`, or from the open binary file `f` of
    `size` bytes (a ranged read of a remote object)."""
    try:
        with contextlib.ExitStack() as stack:
            if f is None:
                size = os.path.getsize(path)
                f = stack.enter_context(open(path, "rb"))
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: corrupt safetensors: {size} bytes, too short for a header")
            n = int.from_bytes(head, "little")
            if 8 + n > size:
                raise ValueError(f"{path}: corrupt or truncated safetensors: {n}-byte header in {size} bytes")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: corrupt safetensors header ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    header["__data_start__"] = 8 + n  # type: ignore[assignment]  # popped by the caller
    data_bytes = size - 8 - n
    for name, info in header.items():
        if name == "__data_start__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            expected = math.prod(shape) * SAFETENSORS_DTYPES[dtype]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: corrupt safetensors header entry for tensor {name}") from None
        if end - begin != expected or begin < 0:
            raise ValueError(f"{path}: corrupt safetensors: tensor {name} spans {end - begin} bytes, "
                             f"{dtype}{shape} needs {expected}")
        if end > data_bytes:
            raise ValueError(f"{path}: truncated safetensors: tensor {name} ends at byte {end} of the data "
                             f"section but the file holds {data_bytes}")
    return header


class SafetensorsCheckpoint(Mapping):
    """Lazy {tensor name: np.ndarray} over a folder's model.safetensors or index + shards, local or remote.

    A local folder (a path or file://) is read through short-lived memory maps; any other URL (s3://) with ranged reads
    through storage/ and never copied whole. `read(name, index)` reads only the bytes of one slice of a
    tensor (what a device of a mesh holds), `view(name)` is a lazy view of it (models/views.py), and
    `bytes_read` counts every byte read, headers included."""

    def __init__(self, folder: str):
        self.folder = folder
        self.local = _local_path(folder)
        self.bytes_read = 0
        self._lock = threading.RLock()  # the counters, file descriptors and caches, for the loader's threads
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}  # one read-only map per file, for strided slices
        self._recent: tuple[str | None, dict[views.Index, np.ndarray]] = (None, {})
        self._spans: dict[str, list[tuple[int, int, bytes]]] = {}  # remote spans read for the current variable
        index_path = self._join(INDEX_FILE)
        if self._exists(INDEX_FILE):
            try:
                weight_map = json.loads(self._read_all(INDEX_FILE))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index_path}: unreadable index ({type(e).__name__}: {e})") from None
            files = sorted(set(weight_map.values()))
        elif self._exists(SINGLE_FILE):
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise ValueError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}")
        self.sharded = weight_map is not None
        self.headers = {fn: self._header(fn) for fn in files}
        self.data_start = {fn: h.pop("__data_start__") for fn, h in self.headers.items()}
        self.file_of: dict[str, str] = {}
        for fn, header in self.headers.items():
            for name in header:
                self.file_of[name] = fn
        if weight_map is not None:
            for name, fn in weight_map.items():
                if name not in self.headers[fn]:
                    raise ValueError(f"{self._join(fn)}: missing tensor {name} (listed in {INDEX_FILE})")

    # -- files, local or remote --

    def _join(self, fn: str) -> str:
        if self.local is not None:
            return os.path.join(self.local, fn)
        from storage import join

        return join(self.folder, fn)

    def _exists(self, fn: str) -> bool:
        if self.local is not None:
            return os.path.exists(self._join(fn))
        from storage import exists

        return exists(self._join(fn))

    def _read_all(self, fn: str) -> bytes:
        if self.local is not None:
            with open(self._join(fn), "rb") as f:
                return f.read()
        from storage import read_bytes

        return read_bytes(self._join(fn))

    def _header(self, fn: str) -> dict[str, Any]:
        path = self._join(fn)
        if self.local is not None:
            header = read_safetensors_header(path)
        else:
            import io

            from storage import read_ranges, size_of

            try:  # two ranged reads: the length, then the header itself
                size = size_of(path)
                head = read_ranges(path, [(0, min(8, size))])[0]
                n = int.from_bytes(head, "little") if len(head) == 8 else 0
                body = read_ranges(path, [(8, 8 + n)])[0] if 0 < n and 8 + n <= size else b""
                header = read_safetensors_header(path, io.BytesIO(head + body), size)
            except FileNotFoundError:
                raise ValueError(f"{path}: missing (listed in {INDEX_FILE})") from None
        self.bytes_read += header["__data_start__"]
        return header

    def _fd(self, fn: str) -> int:
        with self._lock:
            if fn not in self._fds:
                self._fds[fn] = os.open(self._join(fn), os.O_RDONLY)
            return self._fds[fn]

    def clear_cache(self) -> None:
        """Forget the slices and spans kept for the variable just placed."""
        self._recent, self._spans = (None, {}), {}

    def close(self) -> None:
        self.clear_cache()
        for mm in self._maps.values():
            mm.close()
        self._maps.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: S110 (interpreter shutdown)
            pass

    # -- tensors --

    def path_of(self, name: str) -> str:
        """The file holding `name`, or for a missing tensor the file that should have (the index)."""
        if name in self.file_of:
            return self._join(self.file_of[name])
        return self._join(INDEX_FILE if self.sharded else SINGLE_FILE)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.headers[self.file_of[name]][name]["shape"])

    def dtype(self, name: str) -> str:
        """The safetensors dtype tag of `name` ("BF16", "F8_E4M3", ...)."""
        return self.headers[self.file_of[name]][name]["dtype"]

    def view(self, name: str) -> views.View:
        return views.Tensor(self, name, self.shape(name), NUMPY_DTYPES[self.dtype(name)])

    def read(self, name: str, index: views.Index | None = None) -> np.ndarray:
        """`tensor[index]` (one (start, stop) per dimension; None: all of it), reading only its bytes. The last
        variable's slices are kept (`clear_cache`): views whose devices ask for overlapping bytes (GPT-OSS's
        interleaved gate/up pairs, FP8 scale tiles) read them once."""
        if name not in self.file_of:
            raise KeyError(name)
        shape = self.shape(name)
        index = views.whole(shape) if index is None else tuple(index)
        with self._lock:  # one reader of the cache at a time: a slice is read once even from two threads
            if self._recent[0] != name:  # the slices read of the tensor being placed, for devices that share one
                self._recent = (name, {})
            out = self._recent[1].get(index)
            if out is None:
                out = np.empty(views.extent(index), NUMPY_DTYPES[self.dtype(name)])
                self.read_into(name, index, out)
                out.flags.writeable = False  # shared with the next identical read
                self._recent[1][index] = out
        return out

    def read_into(self, name: str, index: views.Index, out: np.ndarray) -> None:
        """Write `tensor[index]` into `out` (its shape; any dtype and strides), reading only the slice's bytes.
        Safe from several threads: the loader reads a variable's slices on a thread pool."""
        if name not in self.file_of:
            raise KeyError(name)
        fn = self.file_of[name]
        info = self.headers[fn][name]
        shape, dtype = tuple(info["shape"]), np.dtype(NUMPY_DTYPES[info["dtype"]])
        if out.size == 0:
            return
        base = self.data_start[fn] + info["data_offsets"][0]
        itemsize = dtype.itemsize
        strides = [math.prod(shape[k + 1:]) * itemsize for k in range(len(shape))]
        lo = base + sum(a * st for (a, _), st in zip(index, strides, strict=True))
        hi = base + sum((b - 1) * st for (_, b), st in zip(index, strides, strict=True)) + itemsize
        path = self._join(fn)
        try:
            if self.local is None:  # counts the spans it fetches
                self._read_remote(path, base, shape, index, strides, lo, hi, dtype, out)
                return
            if out.dtype == dtype and out.flags.c_contiguous and hi - lo == out.nbytes:
                self._pread(fn, lo, out)  # the slice is one run of bytes: read them straight into `out`
            else:
                self._read_mapped(fn, lo, hi, strides, dtype, out)
        except OSError as e:
            raise ValueError(f"{path}: cannot read tensor {name} ({type(e).__name__}: {e})") from None
        with self._lock:
            self.bytes_read += out.size * itemsize

    def _pread(self, fn: str, lo: int, out: np.ndarray) -> None:
        """A contiguous slice (whole rows: an FSDP shard, an expert, a replicated tensor) with `preadv` into
        its destination: one copy, page cache to the device's buffer, without mapping pages into the process."""
        dest = memoryview(out.reshape(-1).view(np.uint8))
        done, fd = 0, self._fd(fn)
        while done < len(dest):
            n = os.preadv(fd, [dest[done:]], lo + done)
            if n <= 0:
                raise OSError(f"truncated: {done} of {len(dest)} bytes at {lo}")
            done += n

    def _read_mapped(self, fn: str, lo: int, hi: int, strides: list[int], dtype: np.dtype, out: np.ndarray) -> None:
        """A strided slice (columns of a tensor-parallel shard, a dtype change) copied out of the file's memory
        map, the pages it spanned released right after (`MADV_DONTNEED`: they leave this process's resident
        memory and stay in the page cache for the devices holding the other columns). One map per file for
        the whole load: a map and unmap per slice cost more than the copy."""
        mm = self._map(fn)
        start = lo - lo % mmap.PAGESIZE
        region = np.ndarray(out.shape, dtype, buffer=mm, offset=lo, strides=strides)
        try:
            out[...] = region
        finally:
            del region
            mm.madvise(mmap.MADV_DONTNEED, start, hi - start)

    def _map(self, fn: str) -> mmap.mmap:
        with self._lock:
            if fn not in self._maps:
                self._maps[fn] = mmap.mmap(self._fd(fn), 0, access=mmap.ACCESS_READ)
            return self._maps[fn]

    def _read_remote(self, url: str, base: int, shape: tuple[int, ...], index: views.Index, strides: list[int],
                     lo: int, hi: int, dtype: np.dtype, out: np.ndarray) -> None:
        """One ranged GET of the span the slice lies in, kept until the variable being placed is done
        (`clear_cache`): the other devices' slices of a column-sharded tensor come from the same span instead
        of a request per row each."""
        from storage import read_ranges

        with self._lock:  # one request per span, even when two threads want it at once
            spans = self._spans.setdefault(url, [])
            span = next((sp for sp in spans if sp[0] <= lo and hi <= sp[1]), None)
            if span is None:
                # the slice's whole rows (its range of the first dimension, everything else whole): the devices
                # holding the other columns of those rows find them here, one request in all instead of one per
                # row per device. A slice that takes every row reads the tensor once for all of them.
                if shape:
                    first, last = base + index[0][0] * strides[0], base + index[0][1] * strides[0]
                else:
                    first, last = base, base + dtype.itemsize
                (data,) = read_ranges(url, [(first, last)])
                if len(data) != last - first:
                    raise OSError(f"truncated: {len(data)} of {last - first} bytes at {first}")
                self.bytes_read += len(data)
                span = (first, last, data)
                spans.append(span)
        region = np.ndarray(out.shape, dtype, buffer=span[2], offset=lo - span[0], strides=strides)
        out[...] = region

    def __getitem__(self, name: str) -> np.ndarray:
        """Read one tensor straight from its validated byte range (bf16 and fp8 through ml_dtypes)."""
        return self.read(name)

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self.file_of

    def __iter__(self):
        return iter(self.file_of)

    def __len__(self) -> int:
        return len(self.file_of)


SAFETENSORS_TAGS = {np.dtype(v): k for k, v in NUMPY_DTYPES.items()}


class SafetensorsWriter:
    """A safetensors file written one tensor at a time: the header (every name, dtype, shape and offset) is
    known up front from the tensors' abstract shapes, so the data follows in order and at most one tensor
    is on the host. Same format as safetensors' own writer (header padded to 8 bytes with spaces)."""

    def __init__(self, path: str, entries: list[tuple[str, tuple[int, ...], np.dtype]], metadata: dict[str, str]):
        header: dict[str, Any] = {"__metadata__": metadata}
        offset = 0
        for name, shape, dtype in entries:
            n = math.prod(shape) * np.dtype(dtype).itemsize
            header[name] = {"dtype": SAFETENSORS_TAGS[np.dtype(dtype)], "shape": list(shape),
                            "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path, self.pending = path, list(entries)
        self.f = open(path, "wb")  # noqa: SIM115 (closed by close())
        self.f.write(len(raw).to_bytes(8, "little") + raw)

    def write(self, name: str, array: np.ndarray) -> None:
        want_name, shape, dtype = self.pending.pop(0)
        if (name, tuple(array.shape), np.dtype(array.dtype)) != (want_name, tuple(shape), np.dtype(dtype)):
            raise ValueError(f"{self.path}: expected {want_name} {dtype}{list(shape)}, got {name} "
                             f"{array.dtype}{list(array.shape)}")
        self.f.write(memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8)))

    def write_parts(self, name: str, shape: tuple[int, ...], dtype: np.dtype, parts: Iterator[np.ndarray]) -> None:
        """The next tensor from consecutive row-major pieces of it (a tensor's shards along its first axis,
        in order), written as they come."""
        want_name, want_shape, want_dtype = self.pending[0]
        if (name, tuple(shape), np.dtype(dtype)) != (want_name, tuple(want_shape), np.dtype(want_dtype)):
            raise ValueError(f"{self.path}: expected {want_name} {want_dtype}{list(want_shape)}, got {name} "
                             f"{np.dtype(dtype)}{list(shape)}")
        self.pending.pop(0)
        left = math.prod(shape) * np.dtype(dtype).itemsize
        for part in parts:
            data = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
            if part.dtype != np.dtype(dtype) or data.size > left:
                raise ValueError(f"{self.path}: {name}: a part of {part.dtype}{list(part.shape)} does not fit")
            self.f.write(memoryview(data))
            left -= data.size
        if left:
            raise ValueError(f"{self.path}: {name}: {left} bytes never written")

    def close(self) -> None:
        self.f.close()
        if self.pending:
            raise ValueError(f"{self.path}: {len(self.pending)} tensors never written ({self.pending[0][0]} ...)")
