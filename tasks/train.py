"""The training loop every training stage shares (base pretraining, fine-tuning, draft training).

    data (packed Parquet rows) -> jitted step (masked next-token cross entropy, AdamW with warmup +
    cosine, global-norm clipping, donated buffers) -> orbax checkpoints (local, then uploaded to the
    store, then a `latest.json` pointer) -> resume from the newest committed checkpoint.

Only the parameters selected by `trainable` (all `nnx.Param` for full fine-tuning, `nnx.LoRAParam`
for LoRA) are differentiated, updated and checkpointed; the rest of the model is a frozen input.
Batches are a pure function of the step number, so a resumed run sees exactly the batches the
killed run would have seen.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pyarrow.parquet as pq
from flax import nnx
from pydantic import BaseModel, ConfigDict, Field

import storage
from storage import Store

log = logging.getLogger("forgeline.train")

COLUMNS = ("input_ids", "target_ids", "positions", "segment_ids", "loss_mask")
Progress = Callable[[int, int, dict[str, float]], None]


class TrainConfig(BaseModel):
    """Optimisation settings shared by every training stage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(200, ge=1)
    batch_size: int = Field(16, ge=1)
    learning_rate: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    b1: float = 0.9
    b2: float = 0.95
    checkpoint_every: int = Field(50, ge=1)
    eval_batches: int = Field(8, ge=1)
    log_every: int = Field(10, ge=1)
    seed: int = 0


# -- data ------------------------------------------------------------------------------------------


class PackedBatches:
    """Deterministic batches over packed Parquet shards: `batch(step)` depends only on `step`.

    Shards are read one at a time (two kept in memory), shuffled per epoch at shard level and
    within each shard, so the loader scales to corpora that do not fit in memory.
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
        table = pq.read_table(self.files[shard], columns=list(COLUMNS))
        return {c: np.stack(table.column(c).to_numpy(zero_copy_only=False)).astype(np.int32) for c in COLUMNS}

    def _locate(self, index: int) -> tuple[int, int]:
        """Global example index -> (shard, row) under the per-epoch permutations."""
        epoch, pos = divmod(index, self.total)
        rng = np.random.default_rng([self.seed, epoch])
        order = rng.permutation(len(self.files)) if self.shuffle else np.arange(len(self.files))
        for shard in order:
            if pos < self.rows[shard]:
                rows = (np.random.default_rng([self.seed, epoch, int(shard)]).permutation(self.rows[shard])
                        if self.shuffle else np.arange(self.rows[shard]))
                return int(shard), int(rows[pos])
            pos -= self.rows[shard]
        raise AssertionError("unreachable")

    def batch(self, step: int) -> dict[str, np.ndarray]:
        picks = [self._locate(step * self.batch_size + i) for i in range(self.batch_size)]
        return {c: np.stack([self._load(s)[c][r] for s, r in picks]) for c in COLUMNS}  # each [B, T]

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * int(self._load(0)["input_ids"].shape[1])


# -- loss and step ---------------------------------------------------------------------------------


def masked_xent(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Mean next-token cross entropy over `loss_mask`; returns (mean loss, number of target tokens)."""
    logits = model(batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    logits = logits.astype(jnp.float32)  # [B, T, V]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["target_ids"])  # [B, T]
    mask = batch["loss_mask"].astype(jnp.float32)
    n = mask.sum()
    return (ce * mask).sum() / jnp.maximum(n, 1.0), n


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=max(cfg.warmup_steps, 1),
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # no decay on norms/biases
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask),
    )


class Trainer:
    """Jitted train and eval steps for one model, split into (trainable, frozen) state."""

    def __init__(self, model: nnx.Module, cfg: TrainConfig, trainable: Any = nnx.Param):
        self.cfg = cfg
        self.graphdef, self.params, self.frozen = nnx.split(model, trainable, ...)
        self.tx = make_optimizer(cfg)
        self.opt_state = self.tx.init(self.params)
        graphdef, tx = self.graphdef, self.tx

        def loss_fn(params, frozen, batch):
            return masked_xent(nnx.merge(graphdef, params, frozen), batch)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def train_step(params, opt_state, frozen, batch):
            (loss, ntok), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, frozen, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return params, opt_state, {"loss": loss, "grad_norm": optax.tree.norm(grads), "tokens": ntok}

        self._train_step = train_step
        self._eval_step = jax.jit(loss_fn)

    def step(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        self.params, self.opt_state, metrics = self._train_step(self.params, self.opt_state, self.frozen, batch)
        return metrics

    def evaluate(self, batches: PackedBatches, n: int) -> float:
        """Token-weighted mean loss over the first `n` batches of a split (fixed order)."""
        total, count = 0.0, 0.0
        for i in range(min(n, math.ceil(batches.total / batches.batch_size))):
            loss, ntok = self._eval_step(self.params, self.frozen, batches.batch(i))
            total += float(loss) * float(ntok)
            count += float(ntok)
        return total / max(count, 1.0)

    def model(self) -> nnx.Module:
        return nnx.merge(self.graphdef, self.params, self.frozen)

    # orbax wants plain pytrees of arrays
    def state(self) -> dict[str, Any]:
        return {"params": nnx.to_pure_dict(self.params), "opt_state": self.opt_state}

    def load_state(self, state: dict[str, Any]) -> None:
        nnx.replace_by_pure_dict(self.params, state["params"])
        self.opt_state = state["opt_state"]


# -- checkpoints -----------------------------------------------------------------------------------


class Checkpoints:
    """Orbax checkpoints written to local disk, then uploaded to `<store>/checkpoints/<name>/<step>/`,
    then committed by rewriting `latest.json` (one object). Orbax cannot write s3:// itself
    (prefect-practice.md §12.8), and S3 has no atomic rename, hence this order."""

    def __init__(self, local_dir: Path, store: Store | None, name: str, keep: int = 2):
        self.local_dir = Path(local_dir)
        self.local_dir.mkdir(parents=True, exist_ok=True)
        self.remote = store.url(f"checkpoints/{name}") if store is not None else None
        self.manager = ocp.CheckpointManager(
            self.local_dir, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        )

    def save(self, step: int, state: dict[str, Any]) -> None:
        self.manager.save(step, args=ocp.args.StandardSave(state))
        self.manager.wait_until_finished()
        if self.remote is not None:
            storage.upload_dir(self.local_dir / str(step), storage.join(self.remote, str(step)))
            storage.write_bytes(storage.join(self.remote, "latest.json"), json.dumps({"step": step}).encode())

    def restore_latest(self, target: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        """(step, state) of the newest committed checkpoint, local or remote; None when there is none."""
        local_step = self.manager.latest_step()
        remote_step = None
        if self.remote is not None:
            try:
                remote_step = json.loads(storage.read_bytes(storage.join(self.remote, "latest.json")))["step"]
            except FileNotFoundError:
                pass
        if remote_step is not None and (local_step is None or remote_step > local_step):
            dest = self.local_dir / str(remote_step)
            shutil.rmtree(dest, ignore_errors=True)
            storage.download_dir(storage.join(self.remote, str(remote_step)), dest)
            self.manager.reload()
            local_step = remote_step
        if local_step is None:
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        return local_step, self.manager.restore(local_step, args=ocp.args.StandardRestore(abstract))

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def fit(
    trainer: Trainer,
    data_dir: Path,
    *,
    checkpoints: Checkpoints | None = None,
    progress: Progress | None = None,
    label: str = "train",
) -> dict[str, Any]:
    """Train `trainer` for `cfg.steps` steps on `data_dir`'s train split, resuming if possible.

    Returns JSON-able metrics: validation loss before and after, the final train loss, tokens/s.
    """
    cfg = trainer.cfg
    train = PackedBatches(data_dir, "train", cfg.batch_size, seed=cfg.seed)
    valid = PackedBatches(data_dir, "valid", cfg.batch_size, shuffle=False)
    start, resumed_from = 0, None
    if checkpoints is not None and (found := checkpoints.restore_latest(trainer.state())) is not None:
        start, state = found
        trainer.load_state(state)
        resumed_from = start
        log.info("%s: resumed from checkpoint at step %d", label, start)
    valid_before = trainer.evaluate(valid, cfg.eval_batches) if start == 0 else None
    losses: list[float] = []
    t0, tokens, compile_s = time.perf_counter(), 0, 0.0
    for step in range(start, cfg.steps):
        ts = time.perf_counter()
        metrics = trainer.step(train.batch(step))
        if step == start:  # the first step compiles; keep it out of the throughput number
            loss0 = float(metrics["loss"])
            compile_s = time.perf_counter() - ts
            t0 = time.perf_counter()
        else:
            tokens += train.tokens_per_batch
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            m = {k: float(v) for k, v in metrics.items()}
            losses.append(m["loss"])
            rate = tokens / max(time.perf_counter() - t0, 1e-9)
            log.info("%s step %d/%d loss %.4f grad_norm %.3f %.0f tok/s", label, step + 1, cfg.steps,
                     m["loss"], m["grad_norm"], rate)
            if progress is not None:
                progress(step + 1, cfg.steps, {"loss": m["loss"], "tokens_per_s": rate})
        if checkpoints is not None and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps):
            checkpoints.save(step + 1, trainer.state())
    elapsed = time.perf_counter() - t0
    valid_after = trainer.evaluate(valid, cfg.eval_batches)
    return {
        "steps": cfg.steps,
        "resumed_from_step": resumed_from,
        "first_train_loss": loss0 if start < cfg.steps else None,
        "final_train_loss": losses[-1] if losses else None,
        "valid_loss_before": valid_before,
        "valid_loss_after": valid_after,
        "tokens_per_s": round(tokens / elapsed, 1) if tokens else None,
        "compile_s": round(compile_s, 2),
    }
