"""The files stages exchange, apart from the stages that write and read them.

- **Packed rows** (`<split>-NNNNN.parquet`, written by data_prep and traces, read by every training stage
  and by evaluate): one row per training sequence of `seq_len` tokens, several documents packed per row.
  Columns, each a list of `seq_len` integers: `input_ids`, `target_ids` (the next token), `positions`
  (restarting at 0 in every packed segment), `segment_ids` (1, 2, ... per packed segment; 0 = padding:
  attention stays within a segment), `loss_mask` (1 where `target_ids` is a loss target).
- **Prompts** (`prompts.parquet`, data_prep): held-out prompts with their reference continuations.
- **Preference pairs** (`pairs-<split>-NNNNN.parquet`, data_prep on a corpus of chosen/rejected records, read
  by preference optimisation): one pair per row, not packed. For each side (`chosen_`, `rejected_`) the five
  packed-row columns of one sequence `bos + context + answer + eos` padded to `seq_len` (segment id 1, 0 on
  padding), with `loss_mask` on the final answer and its eos only (earlier turns of a conversation are
  context here), so a side's log-probability is the sum over its mask.

The hidden-state files that travel beside trace rows are in tasks/data/features.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROW_SCHEMA = pa.schema([  # packed rows
    ("input_ids", pa.list_(pa.int32())),
    ("target_ids", pa.list_(pa.int32())),
    ("positions", pa.list_(pa.int32())),
    ("segment_ids", pa.list_(pa.int32())),
    ("loss_mask", pa.list_(pa.int8())),
])
PROMPT_SCHEMA = pa.schema([
    ("prompt_ids", pa.list_(pa.int32())),
    ("reference_ids", pa.list_(pa.int32())),
    ("prompt_text", pa.string()),
])
COLUMNS = tuple(ROW_SCHEMA.names)
SPLITS = ("train", "valid")
SIDES = ("chosen", "rejected")
PAIR_COLUMNS = tuple(f"{side}_{c}" for side in SIDES for c in COLUMNS)
PAIR_SCHEMA = pa.schema([(f"{side}_{f.name}", f.type) for side in SIDES for f in ROW_SCHEMA])


def rows_table(arrays: Mapping[str, np.ndarray]) -> pa.Table:
    """[R, T] arrays per column as a packed-rows table (each cell a list of T values)."""
    R, T = np.shape(arrays["input_ids"])
    offsets = pa.array(np.arange(0, (R + 1) * T, T, dtype=np.int32))
    return pa.table([pa.ListArray.from_arrays(offsets, pa.array(np.asarray(arrays[c]).reshape(-1))) for c in COLUMNS],
                    schema=ROW_SCHEMA)


def pairs_table(arrays: Mapping[str, np.ndarray]) -> pa.Table:
    """[R, T] arrays per pair column as a preference-pairs table."""
    R, T = np.shape(arrays["chosen_input_ids"])
    offsets = pa.array(np.arange(0, (R + 1) * T, T, dtype=np.int32))
    return pa.table([pa.ListArray.from_arrays(offsets, pa.array(np.asarray(arrays[c]).reshape(-1)))
                     for c in PAIR_COLUMNS], schema=PAIR_SCHEMA)


def read_pairs(path: Path) -> dict[str, np.ndarray]:
    """A preference-pairs Parquet shard as int32 arrays [R, T] per column."""
    table = pq.read_table(path, columns=list(PAIR_COLUMNS))
    if table.num_rows == 0:
        return {c: np.zeros((0, 0), np.int32) for c in PAIR_COLUMNS}
    return {c: np.stack(table.column(c).to_numpy(zero_copy_only=False)).astype(np.int32) for c in PAIR_COLUMNS}


def write_rows(rows: Mapping[str, Any], path: Path) -> int:
    """Rows (lists or [R, T] arrays per column) as a data_prep-format Parquet file; returns R."""
    arrays = {c: np.asarray(rows[c], np.int8 if c == "loss_mask" else np.int32) for c in COLUMNS}  # [R, T]
    pq.write_table(rows_table(arrays), path, compression="zstd")
    return len(arrays["input_ids"])


def read_rows(path: Path) -> dict[str, np.ndarray]:
    """A packed Parquet shard as int32 arrays [R, T] per column."""
    table = pq.read_table(path, columns=list(COLUMNS))
    return {c: np.stack(table.column(c).to_numpy(zero_copy_only=False)).astype(np.int32) for c in COLUMNS}


def pack_answers(sequences: Iterator[tuple[list[int], list[int]]], seq_len: int, eos: int, pad: int) -> dict[str, list]:
    """Greedy packing of (prompt, answer) pairs into rows of `seq_len`; loss on answer + eos only."""
    rows: dict[str, list] = {c: [] for c in COLUMNS}
    cur: dict[str, list[int]] = {c: [] for c in COLUMNS}

    def flush() -> None:
        if not cur["input_ids"]:
            return
        n = seq_len - len(cur["input_ids"])
        for c in COLUMNS:
            rows[c].append(cur[c] + [pad if c in ("input_ids", "target_ids") else 0] * n)
            cur[c] = []

    for prompt, answer in sequences:
        seq = (prompt + answer + [eos])[: seq_len + 1]
        inp, tgt = seq[:-1], seq[1:]
        loss = [1 if t >= len(prompt) - 1 else 0 for t in range(len(inp))]
        if len(cur["input_ids"]) + len(inp) > seq_len:
            flush()
        seg = (max(cur["segment_ids"]) + 1) if cur["segment_ids"] else 1
        cur["input_ids"] += inp
        cur["target_ids"] += tgt
        cur["positions"] += list(range(len(inp)))
        cur["segment_ids"] += [seg] * len(inp)
        cur["loss_mask"] += loss
    flush()
    return rows


def documents_from_rows(data_dir: Path, split: str, limit: int, bos: int, max_len: int,
                        skip: int = 0) -> list[tuple[list[int], list[int]]]:
    """Recover (prompt, answer) token lists from packed rows: a segment that starts with `bos` and whose loss
    region starts after some prompt tokens yields `input_ids[start : first_loss + 1]` (the last prompt token
    predicts the first answer token) and the segment's targets from there on (the answer and its eos, cut
    where the row ended for a document longer than a row). Plain-text segments (loss from the first token)
    split at their middle, so the stage also works on unstructured corpora."""
    out: list[tuple[list[int], list[int]]] = []
    for f in sorted(Path(data_dir).glob(f"{split}-*.parquet")):
        table = pq.read_table(f, columns=["input_ids", "target_ids", "segment_ids", "loss_mask"])
        for ids, tgt, seg, mask in zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True):
            ids, tgt, seg, mask = np.asarray(ids), np.asarray(tgt), np.asarray(seg), np.asarray(mask)
            for s in np.unique(seg[seg > 0]):
                where = np.flatnonzero(seg == s)
                if ids[where[0]] != bos:
                    continue  # a continuation chunk, not a document start
                loss = np.flatnonzero(mask[where])
                end = int(loss[0]) + 1 if len(loss) and loss[0] > 0 else max(1, len(where) // 2)
                if end <= max_len:
                    out.append((ids[where[:end]].tolist(), tgt[where[end - 1:]].tolist()))
                if len(out) >= skip + limit:
                    return out[skip:]
    return out[skip:]


def prompts_from_rows(data_dir: Path, split: str, limit: int, bos: int, max_len: int, skip: int = 0) -> list[list[int]]:
    """The prompts of `documents_from_rows`."""
    return [p for p, _ in documents_from_rows(data_dir, split, limit, bos, max_len, skip)]
