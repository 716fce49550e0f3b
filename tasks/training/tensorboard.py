"""TensorBoard event files written without TensorFlow.


TensorBoard files are written without TensorFlow: TFRecord framing (tensorflow `core/lib/io/record_writer.cc`:
uint64 length, masked CRC-32C of the length, the data, masked CRC-32C of the data) around hand-encoded
`tensorflow.Event` protobufs (`tensorboard/compat/proto/event.proto`, `summary.proto`): the first record
carries `file_version: "brain.Event:2"`, the next ones `Summary{Value{tag, simple_value}}`.
tensorboard's own EventAccumulator reads them back (tests/unit/test_metrics.py).

"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# -- CRC-32C and TFRecord framing ------------------------------------------------------------------


def _crc32c_table() -> tuple[int, ...]:
    poly = 0x82F63B78  # Castagnoli, reflected
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


_CRC32C = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of `data`, table-driven; crc32c(b"123456789") == 0xE3069283."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC32C[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: rotate right by 15 and add a constant (record_writer.cc)."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    """One TFRecord: uint64 length, masked crc of the length, data, masked crc of the data (little endian)."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


# -- protobuf wire encoding (just what Event and Summary need) --------------------------------------


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 negatives are ten-byte two's complement
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _len_delimited(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def encode_event(wall_time: float, step: int, *, file_version: str | None = None,
                 scalars: Mapping[str, float] | None = None) -> bytes:
    """A serialized `Event{wall_time=1 (double), step=2 (int64), file_version=3 | summary=5}`, where
    `Summary{value=1 (repeated Value)}` and `Value{tag=1 (string), simple_value=2 (float)}`."""
    out = _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(step)
    if file_version is not None:
        out += _len_delimited(3, file_version.encode())
    if scalars:
        values = b"".join(
            _len_delimited(1, _len_delimited(1, tag.encode()) + _key(2, 5) + struct.pack("<f", float(v)))
            for tag, v in scalars.items()
        )
        out += _len_delimited(5, values)
    return out


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
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        self._file.write(tfrecord(encode_event(now, 0, file_version="brain.Event:2")))
        self._file.flush()

    def scalars(self, step: int, values: Mapping[str, Any], wall_time: float | None = None) -> None:
        """One event at `step` with a simple_value per tag; None values are skipped, others go through float()."""
        if self._file.closed:
            raise ValueError(f"{self.path}: the writer is closed")
        kept = {tag: float(v) for tag, v in values.items() if v is not None}
        if kept:
            t = time.time() if wall_time is None else wall_time
            self._file.write(tfrecord(encode_event(t, int(step), scalars=kept)))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
