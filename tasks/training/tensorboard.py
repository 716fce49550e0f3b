"""TensorBoard event files, written here: no TensorFlow, no tensorboardX.

An event file is a sequence of TFRecords (tensorflow `core/lib/io/record_writer.cc`,
https://github.com/tensorflow/tensorflow/blob/master/tensorflow/core/lib/io/record_writer.cc): uint64 length,
masked CRC-32C of the length, the data, masked CRC-32C of the data. Each record is a serialized `Event`
(https://github.com/tensorflow/tensorboard/blob/master/tensorboard/compat/proto/event.proto), and the few
fields a scalar log needs are encoded by hand in protobuf's wire format
(https://protobuf.dev/programming-guides/encoding/):

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }      Value { string tag = 1; float simple_value = 2; }

The first record carries `file_version: "brain.Event:2"`; each `scalars()` call is one
`Event{step, Summary{Value{tag, simple_value}, ...}}` holding all of its tags. tensorboard's own
EventFileLoader and EventAccumulator read them back, checking every CRC (tests/unit/test_metrics.py).

Records go straight into the file's buffer: the file is flushed (and fsynced) after the file version, on
`flush()` and on `close()`, so a crash loses at most what was written since the last of those.

tensorboardX (its RecordWriter and generated protobuf classes) wrote these files until its import was measured:
its package imports torch wherever torch is installed, 1.9 s of every training process's start in the test
environment, against microseconds for the three messages above.
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # the reflected Castagnoli polynomial
        table.append(crc)
    return table


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli, RFC 3720), table-driven; crc32c(b"123456789") == 0xE3069283. Records here are a
    few hundred bytes, so pure Python is fast enough."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC32C[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: the CRC-32C rotated right by 15 bits, plus 0xA282EAD8 (modulo 2^32)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # an int64 field: a negative value is its 64-bit two's complement (ten bytes)
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _float32(value: float) -> float:
    """`value` as a float32 field holds it: past float32's range it is infinite (struct refuses to round it)."""
    return value if math.isnan(value) or abs(value) <= _FLOAT32_MAX else math.copysign(math.inf, value)


_FLOAT32_MAX = 3.4028234663852886e38


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2): a string or an embedded message."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event_bytes(wall_time: float, step: int = 0, *, file_version: str | None = None,
                scalars: Mapping[str, float] | None = None) -> bytes:
    """One serialized `Event`: wall_time (double, field 1), step (int64, field 2), and either file_version
    (field 3) or a Summary (field 5) with one Value{tag, simple_value (float, field 2)} per scalar."""
    out = bytearray(b"\x09" + struct.pack("<d", wall_time))  # field 1, wire type 1 (64-bit)
    out += b"\x10" + _varint(step)  # field 2, wire type 0 (varint)
    if file_version is not None:
        out += _field(3, file_version.encode())
    if scalars:
        values = b"".join(_field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", _float32(value)))
                          for tag, value in scalars.items())  # simple_value: field 2, wire type 5 (32-bit)
        out += _field(5, values)
    return bytes(out)


def record_bytes(data: bytes) -> bytes:
    """One TFRecord: length, masked CRC of the length, the data, masked CRC of the data."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


class TensorBoardWriter:
    """Scalar summaries in a TensorBoard event file under `logdir` (created), no TensorFlow needed.

    The file is `events.out.tfevents.<unix time, 10 digits>.<host>.<pid>.<n>` (tensorboard's own
    naming), so several writers in one folder never collide; its first record is the file version.
    """

    _count = 0

    def __init__(self, logdir: str | os.PathLike[str]):
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        TensorBoardWriter._count += 1
        name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}.{TensorBoardWriter._count}"
        self.path = self.logdir / name
        self._file = open(self.path, "xb")  # noqa: SIM115 (open until close())
        self._closed = False
        self._file.write(record_bytes(event_bytes(now, file_version="brain.Event:2")))
        self.flush()

    def scalars(self, step: int, values: Mapping[str, Any], wall_time: float | None = None) -> None:
        """One event at `step` with a simple_value per tag; None values are skipped, others go through float()."""
        if self._closed:
            raise ValueError(f"{self.path}: the writer is closed")
        kept = {tag: float(v) for tag, v in values.items() if v is not None}
        if kept:
            t = time.time() if wall_time is None else wall_time
            self._file.write(record_bytes(event_bytes(t, int(step), scalars=kept)))

    def flush(self) -> None:
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.flush()
            self._file.close()

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
