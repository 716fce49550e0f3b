"""Stage `traces`: the fine-tuned target regenerates answers for prompts; its own outputs and, in
offline mode, its hidden states become the EAGLE-3 draft's training data
(docs/speculative-decoding.md: regenerate with the target, at the serving temperature; online vs
offline hidden states and what they cost; the aux layers the features come from).

    python -m tasks.traces --model DIR --data DIR --out DIR [--set num_prompts=128 hidden_states=online ...]

Inputs: `model` (an HF checkpoint folder or a finetune artifact) and `data` (data_prep output: its
train rows give the training prompts, after `skip_prompts`; `prompts.parquet` the held-out ones).

Work goes in shards of `shard_prompts` prompts per split. Shard i of a split is generated (batched,
KV cache, left padding, length-sorted buckets, one fixed batch shape; the sampling RNG is a pure
function of (seed, split, i), so a restarted job regenerates identical shards), packed into
data_prep's row format and, in offline mode, run through ONE teacher-forcing forward of the target
over the packed rows (segment ids keep packed sequences apart). Output folder:

    train-NNNNN.parquet, valid-NNNNN.parquet   packed rows (data_prep's format; loss on the answer + eos)
    hidden-{split}-NNNNN.safetensors           offline only, rows aligned with the parquet shard:
                                               `aux` [R, T, n·D_t] = the target's hidden states at
                                               `aux_layer_ids` (layer outputs, concatenated low→high
                                               in the listed order), `final` [R, T, D_t] = its final
                                               normed hidden (logits = the target's LM head of it);
                                               `hidden_dtype`, zeros at padding (segment id 0)
    topk-{split}-NNNNN.safetensors             with `top_k_logits` K > 0, rows aligned likewise:
                                               `topk_logprobs` [R, T, K] float32 and `topk_ids` [R, T, K]:
                                               the target's K most likely next tokens at each position and
                                               their log-probabilities (a distilled student's targets,
                                               finetune.method distill), zeros at padding
    traces.json                                aux_layer_ids, mode, dtype, D_t, per-split counts and
                                               throughput, storage bytes (offline: measured; online:
                                               what offline would have cost)
    samples.jsonl                              decoded examples for people to read
    tokenizer.json, special_tokens.json, tokenizer_config.json

Resumability: every finished shard is persisted before the next starts -- in the output folder
(files written under a temporary name and renamed, then a marker in `.progress/`) and, when the stage
runs with a store, under `checkpoints/traces/<fingerprint>/` (files uploaded first, the marker
`<shard>.done.json` last, so that a half-uploaded shard is never taken as done). On start, shards
whose marker matches (same config, code, prompts and target) are reused (fetched from the store if
needed) and only the missing ones are generated.

`target_features` is the one definition of the features; the draft trainer's online mode calls it
inside its jitted step, `hidden_for_rows` (offline) jits it over packed rows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
from flax import nnx
from tokenizers import Tokenizer

import models
import storage
from models.eagle3 import default_aux_layer_ids
from models.generate import generate
from tasks.cli import stage_cli
from tasks.code import code_version
from tasks.configs import TracesConfig
from tasks.data.features import hidden_for_rows, topk_for_rows, write_hidden, write_topk
from tasks.data.rows import COLUMNS, SPLITS, pack_answers, prompts_from_rows, read_rows, write_rows
from tasks.layout import TOKENIZER_FILES, model_dir
from tasks.stage import StageContext, write_report
from tasks.training.config import Progress

log = logging.getLogger("forgeline.traces")

PROGRESS_DIR = ".progress"  # local shard markers (removed from a stage's committed output)
# fields that only choose which prompts exist; a shard's key covers its prompts themselves
_PROMPT_SELECTION = {"num_prompts", "num_valid_prompts", "skip_prompts", "max_prompt_len"}


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def resolve_aux_layer_ids(aux_layer_ids: Sequence[int] | None, num_layers: int) -> tuple[int, ...]:
    """The configured ids, or EAGLE-3's defaults for the target; each must be a layer of the target."""
    ids = tuple(default_aux_layer_ids(num_layers)) if aux_layer_ids is None else tuple(aux_layer_ids)
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"traces: aux_layer_ids {list(ids)}: {bad} not a layer of the target "
                         f"({num_layers} layers, ids 0..{num_layers - 1})")
    return ids


# -- prompts ---------------------------------------------------------------------------------------


def heldout_prompts(data_dir: Path, limit: int, max_len: int) -> list[list[int]]:
    path = Path(data_dir) / "prompts.parquet"
    if not path.exists():
        raise FileNotFoundError(f"traces: {path} is missing (the held-out prompts of data_prep)")
    table = pq.read_table(path, columns=["prompt_ids"])
    return [p for p in table.column("prompt_ids").to_pylist() if len(p) <= max_len][:limit]


def load_prompts(cfg: TracesConfig, data_dir: Path, bos: int) -> dict[str, list[list[int]]]:
    """Training prompts (train rows, after `skip_prompts`) and held-out prompts; one-line error if none."""
    found = {
        "train": prompts_from_rows(data_dir, "train", cfg.num_prompts, bos, cfg.max_prompt_len, cfg.skip_prompts),
        "valid": heldout_prompts(data_dir, cfg.num_valid_prompts, cfg.max_prompt_len),
    }
    if not found["train"]:
        raise ValueError(f"traces: no train prompts in {data_dir} (train-*.parquet) of at most "
                         f"max_prompt_len={cfg.max_prompt_len} tokens after skip_prompts={cfg.skip_prompts}")
    if not found["valid"]:
        raise ValueError(f"traces: no valid prompts in {data_dir} (prompts.parquet) of at most "
                         f"max_prompt_len={cfg.max_prompt_len} tokens")
    return found


# -- generation ------------------------------------------------------------------------------------


def shard_rng(seed: int, split: str, index: int) -> jax.Array:
    """The sampling key of shard `index` of `split`: a pure function of its arguments."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), SPLITS.index(split)), index)


def batched_generate(model: nnx.Module, prompts: list[list[int]], cfg: TracesConfig, eos: int, pad: int,
                     rng: jax.Array) -> list[list[int]]:
    """Answers (without eos and padding) for every prompt, batched in length-sorted buckets of one
    fixed batch shape (min(batch_size, shard_prompts) rows, prompt width rounded up to 16); batch b
    samples with `fold_in(rng, b)`."""
    batch_size = min(cfg.batch_size, cfg.shard_prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    answers: list[list[int]] = [[] for _ in prompts]
    for b, start in enumerate(range(0, len(order), batch_size)):
        idx = order[start : start + batch_size]
        width = -(-max(len(prompts[i]) for i in idx) // 16) * 16  # bucketed width: few compiled shapes
        batch = np.full((batch_size, width), pad, np.int32)  # [B, W]
        lengths = np.ones((batch_size,), np.int32)
        for row, i in enumerate(idx):
            batch[row, width - len(prompts[i]):] = prompts[i]  # left padding
            lengths[row] = len(prompts[i])
        for row in range(len(idx), batch_size):  # filler rows: one real token each
            batch[row, -1] = prompts[idx[0]][-1]
        out = generate(model, batch, prompt_lengths=lengths, max_new_tokens=cfg.max_new_tokens,
                       temperature=cfg.temperature, top_p=cfg.top_p, rng=jax.random.fold_in(rng, b),
                       eos_token_id=eos, pad_token_id=pad)
        tokens, lens = np.asarray(out.tokens), np.asarray(out.lengths)  # [B, M], [B]
        for row, i in enumerate(idx):
            answers[i] = [int(t) for t in tokens[row, : lens[row]] if t != eos]
    return answers


def generate_shard(model: nnx.Module, prompts: list[list[int]], cfg: TracesConfig, eos: int, pad: int,
                   split: str, index: int) -> list[list[int]]:
    """The answers of one shard, sampled with `shard_rng(cfg.seed, split, index)`."""
    return batched_generate(model, prompts, cfg, eos, pad, shard_rng(cfg.seed, split, index))


# -- packing into data_prep's row format -----------------------------------------------------------


# -- hidden states ---------------------------------------------------------------------------------


def shard_key(cfg: TracesConfig, run_key: str, split: str, index: int, prompts: list[list[int]]) -> str:
    """What a finished shard depends on: the config (less prompt selection: the prompts themselves are
    in), the code version, the run (the target), the split, the index and the shard's prompts."""
    payload = {"config": cfg.model_dump(mode="json", exclude=_PROMPT_SELECTION), "code": code_version("tasks.traces"),
               "run": run_key, "split": split, "index": index, "prompts": prompts}
    return hashlib.sha256(_canonical(payload).encode()).hexdigest()


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp")


class ShardCheckpoints:
    """Finished shards, file first and marker last: locally in `out_dir` (files renamed into place,
    then `.progress/<shard>.json`) and, with `remote` (a store URL), under `remote/` (files uploaded,
    then `<shard>.done.json`). A marker records the shard's key, its files' sha256/size and its stats."""

    def __init__(self, out_dir: Path, remote: str | None):
        self.out_dir, self.remote = out_dir, remote
        (out_dir / PROGRESS_DIR).mkdir(parents=True, exist_ok=True)

    def _local_marker(self, shard: str) -> Path:
        return self.out_dir / PROGRESS_DIR / f"{shard}.json"

    def _valid_files(self, marker: dict[str, Any]) -> bool:
        for rel, info in marker["files"].items():
            p = self.out_dir / rel
            if not p.exists() or p.stat().st_size != info["size"] or storage.sha256_file(p) != info["sha256"]:
                return False
        return True

    def restore(self, shard: str, key: str) -> tuple[dict[str, Any], str] | None:
        """(stats, "local" | "store") of a finished shard with this key, its files in `out_dir`; else None."""
        try:
            marker = json.loads(self._local_marker(shard).read_text())
            if marker["key"] == key and self._valid_files(marker):
                return marker["stats"], "local"
        except (OSError, ValueError, KeyError):
            pass
        if self.remote is None:
            return None
        try:
            raw = storage.read_bytes(storage.join(self.remote, f"{shard}.done.json"))
        except FileNotFoundError:
            return None
        marker = json.loads(raw)
        if marker.get("key") != key:
            log.warning("traces: %s in %s was made with other settings; regenerating it", shard, self.remote)
            return None
        for rel, info in marker["files"].items():  # keys from the store: checked to stay inside out_dir
            dest = storage.local_file(self.out_dir, rel, source=storage.join(self.remote, f"{shard}.done.json"))
            storage.download_file(storage.join(self.remote, rel), _tmp(dest))
            if storage.sha256_file(_tmp(dest)) != info["sha256"]:
                _tmp(dest).unlink()
                log.warning("traces: %s in %s does not match its marker; regenerating it", rel, self.remote)
                return None
            os.replace(_tmp(dest), dest)
        self._write_local_marker(shard, raw)
        return marker["stats"], "store"

    def _write_local_marker(self, shard: str, raw: bytes) -> None:
        path = self._local_marker(shard)
        _tmp(path).write_bytes(raw)
        os.replace(_tmp(path), path)

    def commit(self, shard: str, key: str, files: list[str], stats: dict[str, Any]) -> None:
        """Record a shard whose files are already in place in `out_dir`."""
        marker = {"key": key, "stats": stats,
                  "files": {rel: {"sha256": storage.sha256_file(self.out_dir / rel),
                                  "size": (self.out_dir / rel).stat().st_size} for rel in files}}
        raw = json.dumps(marker, indent=1, sort_keys=True).encode()
        self._write_local_marker(shard, raw)
        if self.remote is not None:
            for rel in files:
                storage.upload_file(self.out_dir / rel, storage.join(self.remote, rel))
            storage.write_bytes(storage.join(self.remote, f"{shard}.done.json"), raw)  # the commit point

    def remove_stale(self, keep: set[str]) -> None:
        """Drop outputs of shards that are not part of this run (an earlier run with more prompts)."""
        patterns = ("train-*.parquet", "valid-*.parquet", "hidden-*.safetensors", "topk-*.safetensors",
                    f"{PROGRESS_DIR}/*.json",
                    ".*.tmp", f"{PROGRESS_DIR}/.*.tmp")
        for pattern in patterns:
            for p in self.out_dir.glob(pattern):
                if p.relative_to(self.out_dir).as_posix() not in keep:
                    p.unlink()


# -- the stage -------------------------------------------------------------------------------------


def _make_shard(model: nnx.Module, prompts: list[list[int]], cfg: TracesConfig, special: dict[str, int],
                split: str, index: int, aux_ids: tuple[int, ...], out_dir: Path, files: list[str]) -> dict[str, Any]:
    """Generate, pack and (offline) teacher-force one shard into `files`; returns its stats."""
    eos, pad = special["eos"], special["pad"]
    t0 = time.perf_counter()
    answers = generate_shard(model, prompts, cfg, eos, pad, split, index)
    generate_s = time.perf_counter() - t0
    rows = pack_answers(zip(prompts, answers, strict=True), cfg.seq_len, eos, pad)
    arrays = {c: np.asarray(rows[c], np.int32) for c in COLUMNS}  # [R, T] each
    parquet = out_dir / files[0]
    write_rows(arrays, _tmp(parquet))
    os.replace(_tmp(parquet), parquet)
    stats = {"prompts": len(prompts), "rows": len(arrays["input_ids"]),
             "tokens": int((arrays["segment_ids"] != 0).sum()), "answer_tokens": int(arrays["loss_mask"].sum()),
             "generated_tokens": sum(len(a) for a in answers), "generate_seconds": round(generate_s, 3),
             "ids_bytes": parquet.stat().st_size, "hidden_bytes": 0}
    if cfg.hidden_states == "offline":
        t1 = time.perf_counter()
        hidden = hidden_for_rows(model, arrays, aux_ids, cfg.hidden_dtype, batch_size=cfg.batch_size)
        path = out_dir / files[1]
        write_hidden(_tmp(path), hidden, aux_ids)
        os.replace(_tmp(path), path)
        stats["hidden_bytes"] = path.stat().st_size
        stats["hidden_seconds"] = round(time.perf_counter() - t1, 3)
    if cfg.top_k_logits:
        t2 = time.perf_counter()
        path = out_dir / files[-1]  # topk-<shard>.safetensors
        write_topk(_tmp(path), topk_for_rows(model, arrays, cfg.top_k_logits, batch_size=cfg.batch_size))
        os.replace(_tmp(path), path)
        stats["topk_bytes"] = path.stat().st_size
        stats["topk_seconds"] = round(time.perf_counter() - t2, 3)
    return stats


def _samples(tok: Tokenizer, rows: dict[str, np.ndarray], split: str, n: int = 4) -> list[dict[str, str]]:
    """The first `n` (prompt, answer) pairs of a shard, decoded from its rows."""
    out = []
    for r in range(len(rows["input_ids"])):
        seg = rows["segment_ids"][r]
        for s in np.unique(seg[seg > 0]):
            where = np.flatnonzero(seg == s)
            seq = rows["input_ids"][r][where].tolist() + [int(rows["target_ids"][r][where[-1]])]
            loss = np.flatnonzero(rows["loss_mask"][r][where])
            cut = int(loss[0]) + 1 if len(loss) else len(seq)
            out.append({"split": split, "prompt": tok.decode(seq[:cut], skip_special_tokens=False),
                        "answer": tok.decode(seq[cut:], skip_special_tokens=False)})
            if len(out) == n:
                return out
    return out


def _summary(shards: list[dict[str, Any]]) -> dict[str, Any]:
    total = {k: sum(s.get(k, 0) for s in shards) for k in
             ("prompts", "rows", "tokens", "answer_tokens", "generated_tokens", "generate_seconds", "ids_bytes",
              "hidden_bytes", "topk_bytes")}
    total["shards"] = len(shards)
    total["generate_seconds"] = round(total["generate_seconds"], 3)
    total["generate_tokens_per_s"] = round(total["generated_tokens"] / max(total["generate_seconds"], 1e-9), 1)
    return total


def traces(cfg: TracesConfig, model_path: Path, data_dir: Path, out_dir: Path, *,
           checkpoint_url: str | None = None, run_key: str | None = None) -> dict[str, Any]:
    """Run the stage into `out_dir`; returns the headline numbers (traces.json holds the rest).

    `checkpoint_url`: a store folder where finished shards are persisted and found again (the stage
    passes `checkpoints/traces/<fingerprint>`); `run_key` names the target for shard reuse (default:
    the checkpoint folder's listing: names, sizes and modification times).
    """
    model_path, data_dir, out_dir = Path(model_path), Path(data_dir), Path(out_dir)
    if not (model_path / "config.json").exists():
        raise FileNotFoundError(f"traces: no target checkpoint at {model_path} (config.json is missing)")
    if not (data_dir / "special_tokens.json").exists():
        raise FileNotFoundError(f"traces: {data_dir} is not a data_prep folder (special_tokens.json is missing)")
    special = json.loads((data_dir / "special_tokens.json").read_text())
    prompts = load_prompts(cfg, data_dir, special["bos"])
    model = models.from_pretrained(str(model_path))
    L, D = model.config.num_hidden_layers, model.config.hidden_size
    aux_ids = resolve_aux_layer_ids(cfg.aux_layer_ids, L)
    if run_key is None:
        run_key = _canonical(storage.listing_signature(str(model_path)))
    out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = ShardCheckpoints(out_dir, checkpoint_url)

    shards: dict[str, list[dict[str, Any]]] = {}
    names: dict[str, list[str]] = {}
    reused: dict[str, list[str]] = {"local": [], "store": []}
    keep: set[str] = set()
    for split in SPLITS:
        shards[split], names[split] = [], []
        for index, lo in enumerate(range(0, len(prompts[split]), cfg.shard_prompts)):
            chunk = prompts[split][lo : lo + cfg.shard_prompts]
            shard = f"{split}-{index:05d}"
            files = [f"{shard}.parquet"] + ([f"hidden-{shard}.safetensors"] if cfg.hidden_states == "offline" else []) \
                + ([f"topk-{shard}.safetensors"] if cfg.top_k_logits else [])
            key = shard_key(cfg, run_key, split, index, chunk)
            found = ckpt.restore(shard, key)
            if found is not None:
                stats, where = found
                reused[where].append(shard)
            else:
                stats = _make_shard(model, chunk, cfg, special, split, index, aux_ids, out_dir, files)
                ckpt.commit(shard, key, files, stats)
                log.info("traces: %s: %d prompts -> %d rows, %d tokens generated at %.1f tokens/s", shard,
                         stats["prompts"], stats["rows"], stats["generated_tokens"],
                         stats["generated_tokens"] / max(stats["generate_seconds"], 1e-9))
            shards[split].append(stats)
            names[split].append(shard)
            keep.update(files + [f"{PROGRESS_DIR}/{shard}.json"])
    for where, found in reused.items():
        if found:
            log.info("traces: reused %d finished shards from the %s: %s", len(found),
                     "output folder" if where == "local" else f"store ({checkpoint_url})", ", ".join(found))
    ckpt.remove_stale(keep)

    tok = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    with open(out_dir / "samples.jsonl", "w") as f:
        for split in SPLITS:
            for s in _samples(tok, read_rows(out_dir / f"{names[split][0]}.parquet"), split):
                f.write(json.dumps(s) + "\n")
    for name in TOKENIZER_FILES:
        if (data_dir / name).exists():
            shutil.copyfile(data_dir / name, out_dir / name)

    per_split = {split: _summary(shards[split]) for split in SPLITS}
    every = _summary([s for split in SPLITS for s in shards[split]])
    slots = every["rows"] * cfg.seq_len
    offline_bytes = slots * (len(aux_ids) + 1) * D * jnp.dtype(cfg.hidden_dtype).itemsize  # aux + final
    hidden_bytes = every["hidden_bytes"] if cfg.hidden_states == "offline" else offline_bytes
    store_stats = {
        "hidden_states": cfg.hidden_states,  # the mode actually used
        "ids_bytes": every["ids_bytes"],
        "hidden_bytes": hidden_bytes,  # offline: the files' bytes; online: what offline would have cost
        "hidden_bytes_estimated": cfg.hidden_states == "online",
        "hidden_bytes_per_token": round(hidden_bytes / max(every["tokens"], 1), 1),  # per real (non-pad) token
        "hidden_bytes_per_slot": round(hidden_bytes / max(slots, 1), 1),  # per row position, padding included
        "fill": round(every["tokens"] / max(slots, 1), 4),
        "topk_bytes": every["topk_bytes"],
    }
    report = {
        "aux_layer_ids": list(aux_ids), "hidden_states": cfg.hidden_states, "hidden_dtype": cfg.hidden_dtype,
        "target_hidden_size": D, "target_num_layers": L, "seq_len": cfg.seq_len,
        "temperature": cfg.temperature, "top_p": cfg.top_p,
        "splits": per_split, "storage": store_stats,
        "shards": {split: [f"{n}.parquet" for n in names[split]] for split in SPLITS},
        "hidden_files": {split: ([f"hidden-{n}.safetensors" for n in names[split]]
                                 if cfg.hidden_states == "offline" else []) for split in SPLITS},
        "top_k_logits": cfg.top_k_logits,
        "topk_files": {split: [f"topk-{n}.safetensors" for n in names[split]] if cfg.top_k_logits else []
                       for split in SPLITS},
        "reused_shards": reused["local"] + reused["store"],
    }
    write_report(out_dir / "traces.json", report)  # generation times go to timing.json
    if checkpoint_url is not None:  # the store holds the progress; the committed output stays clean
        shutil.rmtree(out_dir / PROGRESS_DIR, ignore_errors=True)
    return {
        "hidden_states": cfg.hidden_states, "hidden_dtype": cfg.hidden_dtype, "aux_layer_ids": list(aux_ids),
        **{f"{split}_{k}": per_split[split][k] for split in SPLITS for k in ("prompts", "rows")},
        "tokens": every["tokens"], "answer_tokens": every["answer_tokens"],
        "generated_tokens": every["generated_tokens"], "generate_tokens_per_s": every["generate_tokens_per_s"],
        "ids_bytes": every["ids_bytes"], "hidden_bytes": hidden_bytes,
        "hidden_bytes_per_token": store_stats["hidden_bytes_per_token"], "reused_shards": len(report["reused_shards"]),
    }


def run(config: TracesConfig, inputs: Mapping[str, Path], output: Path, *, progress: Progress | None = None,
        context: StageContext | None = None) -> dict[str, Any]:
    """The stage: inputs `model` (the served model: a finetune or quantize artifact, `config.target` naming
    the variant) and `data` (prompts). With a `context`, finished shards are kept in the store and a
    rerun after a crash reuses them."""
    model = model_dir(inputs["model"], config.target)
    if context is None:
        return traces(config, model, inputs["data"], output)
    return traces(config, model, inputs["data"], output, checkpoint_url=context.checkpoint_url,
                  run_key=context.fingerprint)


main = stage_cli(__name__)  # `python -m tasks.traces`: the command line its declaration implies (tasks/cli.py)


if __name__ == "__main__":
    main()
