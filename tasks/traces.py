"""Stage `traces`: the fine-tuned target regenerates answers for prompts, and its own outputs become
the draft's training data (EAGLE/Medusa practice: train the draft on what the target actually says,
not on the dataset's references -- speculative-and-quantization-formats.md §A5).

    python -m tasks.traces --model DIR --data DIR --out DIR [--set num_prompts=128 ...]

Inputs: `model` (an HF checkpoint folder or a finetune artifact) and `data` (data_prep output: its
train rows give the training prompts, `prompts.parquet` the held-out ones). Output: packed Parquet
in data_prep's row format (`train-*.parquet`, `valid-*.parquet`: prompt + generated answer, loss on
the answer), the tokenizer files, and `samples.jsonl` with decoded examples for people to read.
Generation is batched (left padding) with the KV cache, in length-sorted buckets.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer

import models
from models.generate import generate
from tasks.cli import PATH, stage_main
from tasks.finetune import model_dir
from tasks.stage import StageContext
from tasks.train import COLUMNS

log = logging.getLogger("forgeline.traces")


class TracesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    num_prompts: int = Field(256, ge=1)  # training prompts to regenerate
    skip_prompts: int = Field(0, ge=0)  # start after this many (a refresh takes prompts the last draft never saw)
    num_valid_prompts: int = Field(32, ge=1)  # held-out prompts (the draft's validation split)
    max_prompt_len: int = Field(160, ge=2)
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0)  # 0 = greedy, the regime the draft is evaluated in
    top_p: float = Field(1.0, gt=0, le=1)
    batch_size: int = Field(32, ge=1)
    seq_len: int = Field(256, ge=8)
    seed: int = 0


# -- prompts ---------------------------------------------------------------------------------------


def prompts_from_rows(data_dir: Path, split: str, limit: int, bos: int, max_len: int, skip: int = 0) -> list[list[int]]:
    """Recover prompts from packed rows: a segment that starts with `bos` and whose loss region starts
    after some prompt tokens yields `input_ids[start : first_loss + 1]` (the last prompt token
    predicts the first answer token). Plain-text segments (loss from the first token) yield their
    first half, so the stage also works on unstructured corpora."""
    out: list[list[int]] = []
    for f in sorted(Path(data_dir).glob(f"{split}-*.parquet")):
        table = pq.read_table(f, columns=["input_ids", "segment_ids", "loss_mask"])
        for ids, seg, mask in zip(*(table.column(c).to_pylist() for c in table.column_names), strict=True):
            ids, seg, mask = np.asarray(ids), np.asarray(seg), np.asarray(mask)
            for s in np.unique(seg[seg > 0]):
                where = np.flatnonzero(seg == s)
                if ids[where[0]] != bos:
                    continue  # a continuation chunk, not a document start
                loss = np.flatnonzero(mask[where])
                end = int(loss[0]) + 1 if len(loss) and loss[0] > 0 else max(1, len(where) // 2)
                if end <= max_len:
                    out.append(ids[where[:end]].tolist())
                if len(out) >= skip + limit:
                    return out[skip:]
    return out[skip:]


def heldout_prompts(data_dir: Path, limit: int, max_len: int) -> list[list[int]]:
    table = pq.read_table(data_dir / "prompts.parquet", columns=["prompt_ids"])
    return [p for p in table.column("prompt_ids").to_pylist() if len(p) <= max_len][:limit]


# -- generation ------------------------------------------------------------------------------------


def batched_generate(model, prompts: list[list[int]], cfg: TracesConfig, eos: int, pad: int) -> list[list[int]]:
    """Answers (without eos and padding) for every prompt, batched in length-sorted buckets."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[list[int]] = [[] for _ in prompts]
    rng = jax.random.key(cfg.seed)
    for b in range(0, len(order), cfg.batch_size):
        idx = order[b : b + cfg.batch_size]
        width = max(len(prompts[i]) for i in idx)
        width = -(-width // 16) * 16  # bucket the prompt width to limit recompilation
        batch = np.full((cfg.batch_size, width), pad, np.int32)  # fixed batch: one compiled shape
        lengths = np.ones((cfg.batch_size,), np.int32)
        for row, i in enumerate(idx):
            batch[row, width - len(prompts[i]):] = prompts[i]  # left padding
            lengths[row] = len(prompts[i])
        for row in range(len(idx), cfg.batch_size):
            batch[row, -1] = prompts[idx[0]][-1]
        rng, key = jax.random.split(rng)
        out = generate(model, batch, prompt_lengths=lengths, max_new_tokens=cfg.max_new_tokens,
                       temperature=cfg.temperature, top_p=cfg.top_p, rng=key, eos_token_id=eos)
        tokens, lens = np.asarray(out.tokens), np.asarray(out.lengths)
        for row, i in enumerate(idx):
            answers[i] = [int(t) for t in tokens[row, : lens[row]] if t != eos]
    return answers


# -- packing into data_prep's row format -----------------------------------------------------------


def pack(sequences: Iterator[tuple[list[int], list[int]]], seq_len: int, eos: int, pad: int) -> dict[str, list]:
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


def write_rows(rows: dict[str, list], path: Path) -> int:
    schema = pa.schema([(c, pa.list_(pa.int8() if c == "loss_mask" else pa.int32())) for c in COLUMNS])
    pq.write_table(pa.table({c: rows[c] for c in COLUMNS}, schema=schema), path)
    return len(rows["input_ids"])


# -- the stage -------------------------------------------------------------------------------------


def traces(cfg: TracesConfig, model_path: Path, data_dir: Path, out_dir: Path) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    special = json.loads((data_dir / "special_tokens.json").read_text())
    bos, eos, pad = special["bos"], special["eos"], special["pad"]
    model = models.from_pretrained(str(model_path))
    tok = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    stats: dict[str, Any] = {}
    t0, generated = time.perf_counter(), 0
    samples = []
    for split, prompts in (
        ("train", prompts_from_rows(data_dir, "train", cfg.num_prompts, bos, cfg.max_prompt_len, cfg.skip_prompts)),
        ("valid", heldout_prompts(data_dir, cfg.num_valid_prompts, cfg.max_prompt_len)),
    ):
        if not prompts:
            raise ValueError(f"traces: no {split} prompts of at most {cfg.max_prompt_len} tokens in {data_dir}")
        answers = batched_generate(model, prompts, cfg, eos, pad)
        generated += sum(len(a) for a in answers)
        rows = pack(zip(prompts, answers, strict=True), cfg.seq_len, eos, pad)
        stats[f"{split}_rows"] = write_rows(rows, out_dir / f"{split}-00000.parquet")
        stats[f"{split}_prompts"] = len(prompts)
        samples += [{"split": split, "prompt": tok.decode(p, skip_special_tokens=False),
                     "answer": tok.decode(a, skip_special_tokens=False)}
                    for p, a in zip(prompts[:4], answers[:4], strict=True)]
    seconds = time.perf_counter() - t0
    with open(out_dir / "samples.jsonl", "w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    for name in ("tokenizer.json", "special_tokens.json"):
        shutil.copyfile(data_dir / name, out_dir / name)
    return {**stats, "generated_tokens": generated, "generate_tokens_per_s": round(generated / seconds, 1)}


def compute(cfg: TracesConfig):
    def _compute(ctx: StageContext) -> dict[str, Any]:
        return traces(cfg, model_dir(ctx.inputs["model"]), ctx.inputs["data"], ctx.out_dir)

    return _compute


def main(argv: list[str] | None = None) -> None:
    stage_main(__doc__, TracesConfig, {"--model": PATH, "--data": PATH},
               lambda cfg, a: traces(cfg, model_dir(a.model), a.data, a.out), argv)

if __name__ == "__main__":
    main()
