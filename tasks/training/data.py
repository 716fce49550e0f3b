"""Deterministic batches over packed Parquet rows (tasks/data/rows.py): `batch(step)` depends only on the
step, so the step is the data position, and a process reads only the rows its devices hold."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from tasks.data.rows import COLUMNS, read_rows


class PackedBatches:
    """Deterministic batches over packed Parquet shards: `batch(step)` depends only on `step`.

    Shards are read one at a time (two kept in memory), shuffled per epoch at shard level and
    within each shard, so the loader scales to corpora that do not fit in memory. `batch(step, lo, hi)`
    reads only rows lo..hi-1 of the global batch: what one process of a multi-host job needs.
    """

    def __init__(self, data_dir: Path, split: str, batch_size: int, seed: int = 0, shuffle: bool = True):
        self.files = sorted(Path(data_dir).glob(f"{split}-*.parquet"))
        if not self.files:
            raise ValueError(f"{data_dir}: no {split}-*.parquet shards")
        self.rows = [pq.ParquetFile(f).metadata.num_rows for f in self.files]
        self.total = sum(self.rows)
        if self.total == 0:
            raise ValueError(f"{data_dir}: the {split} split is empty")
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self._load = functools.lru_cache(maxsize=2)(self._read)

    def _read(self, shard: int) -> dict[str, np.ndarray]:
        return read_rows(self.files[shard])

    @functools.lru_cache(maxsize=4)  # noqa: B019 - a handful of small index arrays per loader
    def _shard_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.files))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.files))

    @functools.lru_cache(maxsize=4)  # noqa: B019
    def _row_order(self, epoch: int, shard: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.rows[shard])
        return np.random.default_rng([self.seed, epoch, shard]).permutation(self.rows[shard])

    def _locate(self, index: int) -> tuple[int, int]:
        """Global example index -> (shard, row) under the per-epoch permutations."""
        epoch, pos = divmod(index, self.total)
        for shard in self._shard_order(epoch):
            if pos < self.rows[shard]:
                return int(shard), int(self._row_order(epoch, int(shard))[pos])
            pos -= self.rows[shard]
        raise AssertionError("unreachable")

    def batch(self, step: int, lo: int = 0, hi: int | None = None) -> dict[str, np.ndarray]:
        """Rows lo..hi-1 of batch `step`: every column `_read` gives ([hi-lo, T] for the token columns;
        a subclass may add per-token feature columns [hi-lo, T, ...])."""
        hi = self.batch_size if hi is None else hi
        picks = [self._locate(step * self.batch_size + i) for i in range(lo, hi)]
        columns = self._load(picks[0][0]).keys() if picks else COLUMNS
        return {c: np.stack([self._load(s)[c][r] for s, r in picks]) for c in columns}

    @property
    def seq_len(self) -> int:
        return int(self._load(0)["input_ids"].shape[1])

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len
