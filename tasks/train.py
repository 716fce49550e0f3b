"""The training loop every training stage shares (base pretraining, fine-tuning, draft training).

    data (packed Parquet rows) -> global batch sharded over the mesh (each process reads only its rows)
    -> one compiled step (masked next-token cross entropy + optional MoE load-balancing loss,
    gradient accumulation, global-norm clipping, AdamW or Muon, donated buffers)
    -> orbax checkpoints (async, local, then uploaded to the store, then a `latest.json` pointer)
    -> resume from the newest committed checkpoint, bit-identical to a run that never stopped.

Parallelism is a mesh chosen in the recipe (`train.mesh`: data, fsdp, tensor, expert) plus the one
logical-axis rule table in models/sharding.py: parameters, gradients and optimizer state are placed
by their logical axes (FSDP = ZeRO-3: all three sharded over "fsdp"), the batch over (data, fsdp,
expert). The same code runs multi-host after `jax.distributed.initialize` (tasks/distributed.py).

Only the parameters selected by `trainable` (all `nnx.Param` for full fine-tuning, `nnx.LoRAParam`
for LoRA) are differentiated, updated and checkpointed; `nnx.RngState` (LoRA dropout) is threaded
through the step and checkpointed; the rest of the model (e.g. the frozen MoE router correction
bias, a `Buffer`) is a constant input. Batches are a pure function of the step number, so the step
is the data position.

Mixed precision (`compute_dtype: bfloat16`) keeps fp32 master weights and optimizer state and runs
the matmuls in bf16 (models.decoder.set_compute_dtype); `remat` recomputes each decoder layer in
the backward pass (models.decoder.REMAT_POLICIES).
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pyarrow.parquet as pq
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from pydantic import BaseModel, ConfigDict, Field, model_validator

import storage
from models.decoder import DecoderLM, set_compute_dtype
from models.moe import MoE
from models.sharding import RULES, make_mesh, named_sharding, shard_model
from storage import Store
from tasks import metrics as train_metrics

log = logging.getLogger("forgeline.train")

COLUMNS = ("input_ids", "target_ids", "positions", "segment_ids", "loss_mask")
Progress = Callable[[int, int, dict[str, float]], None]


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN/Inf; the message names the step."""


class MeshConfig(BaseModel):
    """Device mesh for training: data x fsdp x tensor x expert must equal the number of devices
    (all processes together); `fsdp: null` takes whatever the other axes leave."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: int = Field(1, ge=1)
    fsdp: int | None = Field(None, ge=1)
    tensor: int = Field(1, ge=1)
    expert: int = Field(1, ge=1)
    rules: dict[str, str | list[str] | None] = {}  # overrides of models.sharding.RULES, logical -> mesh axes


class TrainConfig(BaseModel):
    """Optimisation settings shared by every training stage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(200, ge=1)
    batch_size: int = Field(16, ge=1)  # sequences per optimizer step, all micro-batches and processes together
    grad_accum: int = Field(1, ge=1)  # micro-batches per step (batch_size must divide evenly)
    optimizer: Literal["adamw", "muon"] = "adamw"
    learning_rate: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    b1: float = 0.9
    b2: float = 0.95
    muon_rms: float = Field(0.2, gt=0)  # Muon update RMS matched to AdamW's (Kimi K2 / Moonlight: 0.2)
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Literal["none", "full", "dots"] = "none"
    aux_loss_coef: float = Field(0.0, ge=0)  # MoE load-balancing loss weight (0: reported only)
    checkpoint_every: int = Field(50, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    eval_batches: int = Field(8, ge=1)
    log_every: int = Field(10, ge=1)
    peak_flops: float | None = Field(None, gt=0)  # per device, for MFU; None: this machine's measured matmul peak
    seed: int = 0
    mesh: MeshConfig = MeshConfig()

    @model_validator(mode="after")
    def _accum_divides(self) -> TrainConfig:
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size {self.batch_size} is not a multiple of grad_accum {self.grad_accum}")
        return self


# -- data ------------------------------------------------------------------------------------------


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
        table = pq.read_table(self.files[shard], columns=list(COLUMNS))
        return {c: np.stack(table.column(c).to_numpy(zero_copy_only=False)).astype(np.int32) for c in COLUMNS}

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


# -- loss, optimizer -------------------------------------------------------------------------------

# A training objective: (model, batch) -> (sum of the per-token loss over the batch's loss positions, an
# auxiliary loss added with weight `aux_loss_coef`). The step divides the sum by `loss_mask.sum()`.
LossFn = Callable[[nnx.Module, dict[str, jax.Array]], tuple[jax.Array, jax.Array]]
# An eval objective: (model, batch) -> (loss sum, token count).
EvalFn = Callable[[nnx.Module, dict[str, jax.Array]], tuple[jax.Array, jax.Array]]


def xent_sum(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(sum of next-token cross entropy over `loss_mask`, number of target tokens), both fp32 scalars."""
    logits = model(batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    logits = logits.astype(jnp.float32)  # [B, T, V]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["target_ids"])  # [B, T]
    mask = batch["loss_mask"].astype(jnp.float32)
    return (ce * mask).sum(), mask.sum()


def xent_sum_and_aux(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(`xent_sum`'s cross-entropy sum, the MoE load-balancing loss averaged over the MoE layers; 0 for
    a dense model), the latter captured from what the layers sow during this forward."""
    (ce_sum, _), sown = nnx.capture(xent_sum, nnx.Intermediate)(model, batch)
    leaves = [jnp.sum(x) for x in jax.tree.leaves(sown)]
    return ce_sum, sum(leaves, jnp.float32(0.0)) / max(len(leaves), 1)


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup then cosine decay; `schedule(i)` is the rate of step i (0-based). Shifted by one so
    that no step runs at rate 0: step 0 gets peak/warmup (peak without warmup), the last step the end rate."""
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=max(cfg.warmup_steps, 1),
        decay_steps=max(cfg.steps, cfg.warmup_steps + 1), end_value=cfg.learning_rate * cfg.min_lr_ratio,
    )
    return lambda count: base(count + 1)


def _path_str(path: tuple) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def decay_mask(params: Any) -> Any:
    """Weight decay on matrices only: never on norms, biases, sinks or other vectors."""
    return jax.tree.map(lambda x: x.ndim >= 2, params)


def muon_dims(params: Any) -> Any:
    """Muon on hidden matrices, as Kimi K2 / Moonlight: [in, out] kernels, and stacked experts
    [E, in, out] orthogonalised per expert; embeddings, the LM head and vectors stay on AdamW."""

    def one(path, x):
        name = _path_str(path)
        if "embed_tokens" in name or "lm_head" in name or x.ndim < 2:
            return None
        if x.ndim == 2:
            return optax.contrib.MuonDimensionNumbers(reduction_axis=0, output_axis=1)
        return optax.contrib.MuonDimensionNumbers(reduction_axis=x.ndim - 2, output_axis=x.ndim - 1)

    return jax.tree_util.tree_map_with_path(one, params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    schedule = lr_schedule(cfg)
    if cfg.optimizer == "muon":
        opt = optax.contrib.muon(
            schedule, beta=cfg.b1, weight_decay=cfg.weight_decay, weight_decay_mask=decay_mask,
            adam_b1=cfg.b1, adam_b2=cfg.b2, adam_weight_decay=cfg.weight_decay, adam_learning_rate=schedule,
            muon_weight_dimension_numbers=muon_dims, consistent_rms=cfg.muon_rms,
        )
    else:
        opt = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), opt)


def mesh_from_config(cfg: MeshConfig) -> Mesh:
    return make_mesh(data=cfg.data, fsdp=cfg.fsdp, tensor=cfg.tensor, expert=cfg.expert)


def _rules(cfg: MeshConfig) -> dict[str, Any]:
    unknown = set(cfg.rules) - set(RULES)
    if unknown:
        raise ValueError(f"train.mesh.rules: unknown logical axes {sorted(unknown)} (known: {sorted(RULES)})")
    return {**RULES, **{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.rules.items()}}


def _is_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _state_shardings_like(opt_state: Any, params: Any, default: NamedSharding) -> Any:
    """Shardings for an optimizer state: a leaf whose key path ends with a parameter's path and has its
    shape (Adam moments, Muon momentum, ...) is sharded like that parameter; counts etc. replicated."""
    by_path = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}

    def one(path, leaf):
        for i in range(len(path)):
            x = by_path.get(jax.tree_util.keystr(path[i:]))
            if x is not None and x.shape == leaf.shape:
                return x.sharding
        return default

    return jax.tree_util.tree_map_with_path(one, opt_state)


def _per_device_bytes(tree: Any) -> int:
    total = 0
    for x in jax.tree.leaves(tree):
        shards = getattr(x, "addressable_shards", None)
        total += shards[0].data.nbytes if shards else np.asarray(x).nbytes
    return total


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


_FORMATS = {"loss": "{:.4f}", "grad_norm": "{:.3f}", "learning_rate": "{:.3e}", "tokens_per_s": "{:.0f}",
            "mfu": "{:.1%}", "aux_loss": "{:.4f}"}


# -- trainer ---------------------------------------------------------------------------------------


class Trainer:
    """One compiled train step and eval step for one model on one mesh, over the split state
    (trainable params, RNG state, frozen rest). `model` is adopted, not copied: it is placed on the
    mesh and given the compute dtype and remat policy in place; read results from `trainer.model()`.
    `trainable` is any nnx filter; `loss_fn` / `eval_fn` replace next-token cross entropy (the EAGLE-3
    draft trains a distillation loss this way, tasks/draft.py)."""

    def __init__(self, model: nnx.Module, cfg: TrainConfig, trainable: Any = nnx.Param, mesh: Mesh | None = None,
                 loss_fn: LossFn = xent_sum_and_aux, eval_fn: EvalFn = xent_sum):
        self.cfg = cfg
        self.mesh = mesh if mesh is not None else mesh_from_config(cfg.mesh)
        self.rules = _rules(cfg.mesh)
        self.config = getattr(model, "config", None)
        self.lora = trainable is nnx.LoRAParam
        if cfg.compute_dtype == "bfloat16":
            set_compute_dtype(model, jnp.bfloat16)
        self.moe = [m for _, m in nnx.iter_graph(model) if isinstance(m, MoE)]
        if isinstance(model, DecoderLM):
            model.remat = cfg.remat
        elif cfg.remat != "none":
            raise ValueError(f"train.remat={cfg.remat}: {type(model).__name__} is not a DecoderLM")
        shard_model(model, self.mesh, self.rules)
        model.eval()  # dropout off, no load-balancing loss sown: the graph of eval and of `model()`
        self.eval_graphdef = nnx.graphdef(model)
        model.train()
        for m in self.moe:
            m.collect_aux = True  # sow the load-balancing loss; reported, and trained on when coef > 0
        self.graphdef, self.params, self.rng_state, self.frozen = nnx.split(model, trainable, nnx.RngState, ...)
        self.schedule = lr_schedule(cfg)
        self.tx = make_optimizer(cfg)

        shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
        self.param_sh = shardings(self.params)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        opt_sh = _state_shardings_like(jax.eval_shape(self.tx.init, self.params), self.params, replicated)
        self.opt_state = jax.jit(self.tx.init, out_shardings=opt_sh)(self.params)
        self.opt_sh, self.rng_sh = opt_sh, shardings(self.rng_state)
        self.batch_sh = named_sharding(self.mesh, ("batch", "length"), self.rules)

        graphdef, eval_graphdef, tx, A, coef = self.graphdef, self.eval_graphdef, self.tx, cfg.grad_accum, \
            cfg.aux_loss_coef

        def micro_objective(params, rng_state, frozen, mb, n_total):
            rng_state = jax.tree.map(lambda x: x, rng_state)  # fresh Variables: dropout advances them here
            model = nnx.merge(graphdef, params, rng_state, frozen)
            ce_sum, aux = loss_fn(model, mb)
            objective = ce_sum / n_total + coef * aux / A
            return objective, (ce_sum, aux, nnx.state(model, nnx.RngState))

        grad_fn = jax.value_and_grad(micro_objective, has_aux=True)

        def train_step(params, opt_state, rng_state, frozen, batch):
            n_total = jnp.maximum(batch["loss_mask"].astype(jnp.float32).sum(), 1.0)
            if A == 1:
                (_, (ce_sum, aux, rng_state)), grads = grad_fn(params, rng_state, frozen, batch, n_total)
            else:
                # micro-batch m = rows m, m+A, ...: each micro-batch keeps the batch's sharding
                micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // A, A, *x.shape[1:]).swapaxes(0, 1), batch)

                def body(carry, mb):
                    g_acc, ce_acc, aux_acc, rng = carry
                    (_, (ce, aux, rng)), g = grad_fn(params, rng, frozen, mb, n_total)
                    return (jax.tree.map(jnp.add, g_acc, g), ce_acc + ce, aux_acc + aux, rng), None

                zero = jnp.float32(0.0)
                init = (jax.tree.map(jnp.zeros_like, params), zero, zero, rng_state)
                (grads, ce_sum, aux, rng_state), _ = jax.lax.scan(body, init, micro)
                aux = aux / A
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            stats = {"loss": ce_sum / n_total, "grad_norm": optax.tree.norm(grads), "aux_loss": aux,
                     "target_tokens": n_total}
            return params, opt_state, rng_state, stats

        def eval_step(params, rng_state, frozen, batch):
            model = nnx.merge(eval_graphdef, params, rng_state, frozen)
            return eval_fn(model, batch)

        self._train_step = jax.jit(train_step, donate_argnums=(0, 1, 2),
                                   out_shardings=(self.param_sh, opt_sh, self.rng_sh, replicated))
        self._compiled: Any = None
        self._eval_step = jax.jit(eval_step)

    def adapter_params_per_token(self) -> int:
        """LoRA factors each token multiplies (a stacked expert factor [E, ...] counts top_k / E of itself)."""
        if not self.lora:
            return 0
        top_k = getattr(self.config, "num_experts_per_tok", 1)
        return int(sum(x.size * top_k / x.shape[0] if x.ndim == 3 else x.size for x in jax.tree.leaves(self.params)))

    # -- batches -----------------------------------------------------------------------------------

    def _rows_needed(self, batch_size: int, seq_len: int) -> tuple[int, int]:
        """The contiguous range of global batch rows that this process's devices hold."""
        idx = self.batch_sh.addressable_devices_indices_map((batch_size, seq_len)).values()
        starts = [s[0].start or 0 for s in idx]
        stops = [batch_size if s[0].stop is None else s[0].stop for s in idx]
        return min(starts), max(stops)

    def global_batch(self, loader: PackedBatches, step: int) -> dict[str, jax.Array]:
        """Batch `step` as global arrays on the mesh, reading only this process's rows."""
        B, T = loader.batch_size, loader.seq_len
        lo, hi = self._rows_needed(B, T)
        local = loader.batch(step, lo, hi)
        rows = lambda i: slice((i[0].start or 0) - lo, (B if i[0].stop is None else i[0].stop) - lo)
        return {c: jax.make_array_from_callback(  # feature columns [B, T, F] are split like [B, T]
            (B, *x.shape[1:]), self.batch_sh, lambda i, x=x: x[(rows(i), *i[1:])])
            for c, x in local.items()}

    def put(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """A host batch (the full [B, T] on every process) placed on the mesh."""
        return {c: jax.make_array_from_callback(np.shape(x), self.batch_sh, lambda i, x=x: np.asarray(x)[i])
                for c, x in batch.items()}

    # -- steps -------------------------------------------------------------------------------------

    def _args(self, batch):
        return self.params, self.opt_state, self.rng_state, self.frozen, batch

    def compile(self, batch: dict[str, jax.Array]) -> dict[str, float]:
        """Compile the train step for this batch shape; returns the per-device memory estimate (bytes)."""
        self._compiled = self._train_step.lower(*self._args(batch)).compile()
        est = {"params": _per_device_bytes(self.params), "optimizer": _per_device_bytes(self.opt_state),
               "frozen": _per_device_bytes(self.frozen)}
        ma = None
        try:
            ma = self._compiled.memory_analysis()
        except Exception:  # pragma: no cover - some backends do not implement it
            pass
        est["temp"] = int(getattr(ma, "temp_size_in_bytes", 0) or 0)
        est["total"] = sum(est.values())
        return est

    @property
    def compiled(self) -> bool:
        return self._compiled is not None

    def step(self, batch: dict[str, np.ndarray | jax.Array]) -> dict[str, jax.Array]:
        if not isinstance(batch["input_ids"], jax.Array):
            batch = self.put(batch)
        if self._compiled is None:
            self.compile(batch)
        self.params, self.opt_state, self.rng_state, stats = self._compiled(*self._args(batch))
        return stats

    def evaluate(self, batches: PackedBatches, n: int) -> float:
        """Token-weighted mean loss over the first `n` batches of a split (fixed order)."""
        total, count = 0.0, 0.0
        for i in range(min(n, math.ceil(batches.total / batches.batch_size))):
            ce_sum, ntok = self._eval_step(self.params, self.rng_state, self.frozen, self.global_batch(batches, i))
            total += float(ce_sum)
            count += float(ntok)
        return total / max(count, 1.0)

    def model(self) -> nnx.Module:
        """The trained model (eval mode). Multi-host: gathered so that every process holds all of it."""
        state = (self.params, self.rng_state, self.frozen)
        if jax.process_count() > 1:
            state = jax.jit(lambda *t: t, out_shardings=NamedSharding(self.mesh, PartitionSpec()))(*state)
        model = nnx.merge(self.eval_graphdef, *state)
        if isinstance(model, DecoderLM):
            model.remat = "none"
        return model

    # orbax wants plain pytrees of arrays; typed PRNG keys are saved as their raw key data
    def state(self) -> dict[str, Any]:
        rng = jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, nnx.to_pure_dict(self.rng_state))
        return {"params": nnx.to_pure_dict(self.params), "opt_state": self.opt_state, "rng": rng}

    def load_state(self, state: dict[str, Any]) -> None:
        nnx.replace_by_pure_dict(self.params, state["params"])
        current = nnx.to_pure_dict(self.rng_state)
        rng = jax.tree.map(lambda cur, new: jax.random.wrap_key_data(new, impl=jax.random.key_impl(cur))
                           if _is_key(cur) else new, current, state["rng"])
        nnx.replace_by_pure_dict(self.rng_state, rng)
        self.opt_state = state["opt_state"]


# -- checkpoints -----------------------------------------------------------------------------------


class Checkpoints:
    """Orbax checkpoints saved asynchronously to local disk, then uploaded to
    `<store>/checkpoints/<name>/<step>/`, then committed by rewriting `latest.json` (one object).
    Orbax cannot write s3:// itself (prefect-practice.md §12.8), and S3 has no atomic rename, hence
    this order; a kill at any moment leaves either the previous or the new checkpoint committed.
    The last `keep` checkpoints are kept, locally and in the store. Multi-host: every process saves
    its shards into `local_dir`, which must be one folder shared by all hosts (orbax's requirement:
    NFS/Lustre/Filestore); orbax commits once all processes have written, then process 0 uploads."""

    def __init__(self, local_dir: Path, store: Store | None, name: str, keep: int = 2):
        self.local_dir = Path(local_dir)
        self.local_dir.mkdir(parents=True, exist_ok=True)
        self.remote = store.url(f"checkpoints/{name}") if store is not None else None
        self.keep = keep
        self.manager = ocp.CheckpointManager(
            self.local_dir, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                                 enable_async_checkpointing=True)
        )
        self._uploader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-upload")
        self._pending: concurrent.futures.Future | None = None
        self._committed: list[int] = []

    def save(self, step: int, state: dict[str, Any]) -> None:
        """Start saving `state` as `step`; returns once the arrays are copied off the devices."""
        self._raise_pending()
        self.manager.save(step, args=ocp.args.StandardSave(state))
        if self.remote is not None and jax.process_index() == 0:
            self._pending = self._uploader.submit(self._upload, step)

    def _upload(self, step: int) -> None:
        self.manager.wait_until_finished()
        storage.upload_dir(self.local_dir / str(step), storage.join(self.remote, str(step)))
        storage.write_bytes(storage.join(self.remote, "latest.json"), json.dumps({"step": step}).encode())
        log.info("checkpoint step %d committed to %s", step, self.remote)
        self._committed.append(step)
        for old in self._committed[:-self.keep]:
            storage.rm(storage.join(self.remote, str(old)))
        self._committed = self._committed[-self.keep:]

    def _raise_pending(self) -> None:
        if self._pending is not None:
            self._pending.result()  # re-raises an upload error here, in the training thread
            self._pending = None

    def wait(self) -> None:
        self.manager.wait_until_finished()
        self._raise_pending()

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
            if jax.process_index() == 0:
                dest = self.local_dir / str(remote_step)
                shutil.rmtree(dest, ignore_errors=True)
                storage.download_dir(storage.join(self.remote, str(remote_step)), dest)
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices("forgeline-checkpoint-download")
            self.manager.reload()
            local_step = remote_step
        if local_step is None:
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        return local_step, self.manager.restore(local_step, args=ocp.args.StandardRestore(abstract))

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._uploader.shutdown(wait=True)
            self.manager.close()


# -- the loop --------------------------------------------------------------------------------------


def fit(
    trainer: Trainer,
    data_dir: Path,
    *,
    checkpoints: Checkpoints | None = None,
    progress: Progress | None = None,
    label: str = "train",
    logdir: Path | None = None,
    loader: Callable[..., PackedBatches] = PackedBatches,
) -> dict[str, Any]:
    """Train `trainer` for `cfg.steps` steps on `data_dir`'s train split, resuming if possible.

    Logs loss, grad norm, learning rate, tokens/s and MFU every `log_every` steps (to the log, a
    terminal progress bar, TensorBoard event files under `logdir`, and `progress`). A NaN/Inf loss
    or gradient norm raises TrainingDiverged naming the step; no checkpoint after it is written.
    Returns JSON-able metrics: validation loss before and after, the final train loss, tokens/s, MFU.
    """
    cfg = trainer.cfg
    train = loader(data_dir, "train", cfg.batch_size, seed=cfg.seed)
    valid = loader(data_dir, "valid", cfg.batch_size, shuffle=False)
    start, resumed_from = 0, None
    if checkpoints is not None and (found := checkpoints.restore_latest(trainer.state())) is not None:
        start, state = found
        trainer.load_state(state)
        resumed_from = start
        log.info("%s: resumed from checkpoint at step %d", label, start)
    valid_before = trainer.evaluate(valid, cfg.eval_batches) if start == 0 else None

    n_dev = trainer.mesh.devices.size
    flops_per_token = None
    if trainer.config is not None:
        flops_per_token = train_metrics.train_flops_per_token(trainer.config, train.seq_len,
                                                              trainable_only=trainer.lora,
                                                              adapter_params=trainer.adapter_params_per_token())
    peak = cfg.peak_flops or train_metrics.matmul_peak_flops(jnp.dtype(cfg.compute_dtype))
    writer = train_metrics.TensorBoardWriter(logdir) if logdir is not None and jax.process_index() == 0 else None
    bar = train_metrics.ProgressBar(cfg.steps, label) if jax.process_index() == 0 else None

    losses: list[list[float]] = []
    loss0, compile_s, tokens, t0 = None, 0.0, 0, time.perf_counter()
    last_mfu = None
    pending: tuple[int, dict[str, jax.Array]] | None = None  # the previous step's stats, checked one step late

    def check(step: int, stats: dict[str, jax.Array]) -> dict[str, float]:
        m = {k: float(v) for k, v in stats.items()}
        if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
            last = checkpoints.manager.latest_step() if checkpoints is not None else None
            raise TrainingDiverged(f"{label}: step {step}: loss {m['loss']} grad_norm {m['grad_norm']} is not finite"
                                   f" (last good checkpoint: {'none' if last is None else f'step {last}'})")
        return m

    try:
        for step in range(start, cfg.steps):
            batch = trainer.global_batch(train, step)
            if not trainer.compiled:
                tc = time.perf_counter()
                est = trainer.compile(batch)
                compile_s = time.perf_counter() - tc
                log.info("%s: memory estimate per device: params %s, optimizer %s, frozen %s, activations/temp %s"
                         " = %s (%d devices, mesh %s)", label, _gib(est["params"]), _gib(est["optimizer"]),
                         _gib(est["frozen"]), _gib(est["temp"]), _gib(est["total"]), n_dev,
                         dict(trainer.mesh.shape))
            stats = trainer.step(batch)
            if pending is not None:
                check(*pending)
            pending = (step + 1, stats)
            if step == start:  # the first step is slow (allocation); keep it out of the throughput number
                loss0 = check(*pending)["loss"]
                t0 = time.perf_counter()
            else:
                tokens += train.tokens_per_batch
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                m = check(*pending)
                losses.append([step + 1, m["loss"]])
                rate = tokens / max(time.perf_counter() - t0, 1e-9)
                row = {"loss": m["loss"], "grad_norm": m["grad_norm"],
                       "learning_rate": float(trainer.schedule(step)), "tokens_per_s": rate}
                if flops_per_token is not None and tokens:
                    row["mfu"] = last_mfu = rate * flops_per_token / (peak * n_dev)
                if trainer.moe:
                    row["aux_loss"] = m["aux_loss"]
                log.info("%s step %d/%d %s", label, step + 1, cfg.steps,
                         " ".join(f"{k} {_FORMATS[k].format(v)}" for k, v in row.items()))
                if writer is not None:
                    writer.scalars(step + 1, {f"{label}/{k}": v for k, v in row.items()})
                if bar is not None:
                    bar.update(step + 1, row)
                if progress is not None:
                    progress(step + 1, cfg.steps, row)
            if checkpoints is not None and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps):
                check(*pending)  # never checkpoint past a NaN
                checkpoints.save(step + 1, trainer.state())
        if pending is not None:
            check(*pending)
        if checkpoints is not None:
            checkpoints.wait()
    finally:
        if writer is not None:
            writer.close()
        if bar is not None:
            bar.close()
    elapsed = time.perf_counter() - t0
    valid_after = trainer.evaluate(valid, cfg.eval_batches)
    return {
        "steps": cfg.steps,
        "resumed_from_step": resumed_from,
        "first_train_loss": loss0,
        "final_train_loss": losses[-1][1] if losses else None,
        "train_losses": losses,  # [step, loss] at every logged step
        "valid_loss_before": valid_before,
        "valid_loss_after": valid_after,
        "tokens_per_s": round(tokens / elapsed, 1) if tokens else None,
        "mfu": round(last_mfu, 4) if last_mfu is not None else None,
        "compile_s": round(compile_s, 2),
        "devices": n_dev,
    }
