"""TensorBoard event files written through tensorboardX, without TensorFlow.

An event file is a sequence of TFRecords (tensorflow `core/lib/io/record_writer.cc`,
https://github.com/tensorflow/tensorflow/blob/master/tensorflow/core/lib/io/record_writer.cc), each a
serialized `Event` (https://github.com/tensorflow/tensorboard/blob/master/tensorboard/compat/proto/event.proto).
tensorboardX (https://github.com/lanpa/tensorboardX) does both parts: its `RecordWriter` frames a record
(uint64 length, masked CRC-32C of the length, the data, masked CRC-32C of the data) and its generated
protobuf classes encode the events. The first record carries `file_version: "brain.Event:2"`; each
`scalars()` call is one `Event{step, Summary{Value{tag, simple_value}, ...}}` holding all of its tags.
tensorboard's own EventAccumulator reads them back (tests/unit/test_metrics.py).

Records go straight into the file's buffer, as tensorboardX's synchronous `EventsWriter` writes them:
the file is flushed after the file version, on `flush()` and on `close()` (tensorboardX's flush also
fsyncs), so a crash loses at most what was written since the last of those. tensorboardX's
`SummaryWriter` / `FileWriter` are not used: they hand events to a background thread through a queue
whose `flush()` does not wait for, write one event per tag, and expose no file name.

tensorboardX is imported when the first writer opens, not with this module: its package imports torch
wherever torch is installed (2.3 s measured in the test environment, 0.03 s without torch), which a
process that merely imports the training code (a flow, a stage that rejects its input) should not pay.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) as tensorboardX computes it for the framing; crc32c(b"123456789") == 0xE3069283."""
    from tensorboardX import record_writer

    return record_writer.crc32c(data)


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC (rotate right by 15, add 0xA282EAD8), the one tensorboardX frames records with."""
    from tensorboardX import record_writer

    return record_writer.masked_crc32c(data)


class TensorBoardWriter:
    """Scalar summaries in a TensorBoard event file under `logdir` (created), no TensorFlow needed.

    The file is `events.out.tfevents.<unix time, 10 digits>.<host>.<pid>.<n>` (tensorboard's own
    naming), so several writers in one folder never collide; its first record is the file version.
    """

    _count = 0

    def __init__(self, logdir: str | os.PathLike[str]):
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary
        from tensorboardX.record_writer import RecordWriter

        self._event, self._summary = Event, Summary
        self.logdir = Path(logdir)
        self.logdir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        TensorBoardWriter._count += 1
        name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}.{os.getpid()}.{TensorBoardWriter._count}"
        self.path = self.logdir / name
        # absolute: RecordWriter sends a path that starts with "s3:" or "gs:" to its cloud writers
        self._records = RecordWriter(str(self.path.absolute()))
        self._closed = False
        self._records.write(Event(wall_time=now, file_version="brain.Event:2").SerializeToString())
        self._records.flush()

    def scalars(self, step: int, values: Mapping[str, Any], wall_time: float | None = None) -> None:
        """One event at `step` with a simple_value per tag; None values are skipped, others go through float()."""
        if self._closed:
            raise ValueError(f"{self.path}: the writer is closed")
        kept = [self._summary.Value(tag=tag, simple_value=float(v)) for tag, v in values.items() if v is not None]
        if kept:
            t = time.time() if wall_time is None else wall_time
            event = self._event(wall_time=t, step=int(step), summary=self._summary(value=kept))
            self._records.write(event.SerializeToString())

    def flush(self) -> None:
        self._records.flush()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._records.flush()
            self._records.close()

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
