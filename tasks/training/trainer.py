"""The Trainer: one compiled train step and eval step for one model on one mesh.

Parameters, gradients and optimizer state are placed by their logical axes through the one rule table in
models/sharding.py (FSDP = ZeRO-3 over "fsdp"); the batch goes over (data, fsdp, expert). Only the
parameters selected by `trainable` are differentiated and updated; the rest of the model is a constant.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.decoder import DecoderLM, set_compute_dtype
from models.deepseek_v32 import DSAttention
from models.moe import MoE
from models.sharding import RULES, make_mesh, named_sharding, set_activation_sharding, shard_model
from tasks.training.config import IndexerConfig, MeshConfig, TrainConfig
from tasks.training.data import PackedBatches
from tasks.training.losses import AuxLosses, CountFn, EvalFn, LossFn, target_count, xent_sum, xent_sum_and_aux
from tasks.training.optimizers import lr_schedule, make_optimizer


def mesh_from_config(cfg: MeshConfig) -> Mesh:
    return make_mesh(data=cfg.data, fsdp=cfg.fsdp, tensor=cfg.tensor, expert=cfg.expert)


def mesh_rules(cfg: MeshConfig) -> dict[str, Any]:
    unknown = set(cfg.rules) - set(RULES)
    if unknown:
        raise ValueError(f"train.mesh.rules: unknown logical axes {sorted(unknown)} (known: {sorted(RULES)})")
    return {**RULES, **{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.rules.items()}}


def adapter_params_per_token(params: Any, config: Any) -> int:
    """LoRA factors (`params`, concrete or abstract) each token multiplies: a stacked expert factor [E, ...]
    counts top_k / E of itself."""
    top_k = getattr(config, "num_experts_per_tok", 1)
    return int(sum(math.prod(x.shape) * (top_k / x.shape[0] if len(x.shape) == 3 else 1)
                   for x in jax.tree.leaves(params)))


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


def prepare_for_training(model: nnx.Module, cfg: TrainConfig, indexer: IndexerConfig = IndexerConfig()) -> Any:
    """Give `model` (concrete or abstract, `nnx.eval_shape`) the compute dtype and remat policy of `cfg`, put it
    in train mode with MoE layers sowing their load-balancing loss and, with `indexer.mode` kl, DSA layers their
    indexer's KL objective (in place); returns the eval-mode graphdef (dropout off, nothing sown), the graph of
    eval steps and of the trained model."""
    if cfg.compute_dtype == "bfloat16":
        set_compute_dtype(model, jnp.bfloat16)
    if isinstance(model, DecoderLM):
        model.remat = cfg.remat
    elif cfg.remat != "none":
        raise ValueError(f"train.remat={cfg.remat}: {type(model).__name__} is not a DecoderLM")
    model.eval()
    eval_graphdef = nnx.graphdef(model)
    model.train()
    for _, m in nnx.iter_graph(model):
        if isinstance(m, MoE):
            m.collect_aux = True  # sow the load-balancing loss; reported, and trained on when coef > 0
        if isinstance(m, DSAttention) and indexer.mode == "kl":
            m.indexer_kl = indexer.form
    return eval_graphdef


def make_train_step(graphdef: Any, tx: optax.GradientTransformation, cfg: TrainConfig, loss_fn: LossFn,
                    count_fn: CountFn = target_count, indexer_kl_weight: float = 0.0) -> Any:
    """The train step as a pure function (params, opt_state, rng_state, frozen, batch) -> (params, opt_state,
    rng_state, stats) over the split state of a model prepared by `prepare_for_training`: `grad_accum`
    micro-batches scanned, the gradient summed, one optimizer update. The loss sum (and any metric sums the
    objective returns) is divided by `count_fn(batch)`, the whole batch's count (target tokens; pairs for
    preference optimisation). The Trainer jits it on real arrays; the capacity planner
    (tasks/training/plan.py) compiles the same function on abstract ones. The objective adds the auxiliary
    losses the objective returns (`AuxLosses`): the MoE load-balancing loss times `aux_loss_coef` and a DSA
    indexer's KL times `indexer_kl_weight`, each a mean per micro-batch; the step reports the KL as
    `indexer_kl` when its weight is set."""
    A, coef, w_kl = cfg.grad_accum, cfg.aux_loss_coef, indexer_kl_weight

    def micro_objective(params, rng_state, frozen, mb, n_total):
        # fresh Variables at this trace level: dropout advances the RNG state here, and a remat'd layer writes
        # its (unchanged) Variables back, which nnx refuses for Variables of an enclosing trace's level. The
        # params too: under `grad_fn` they are fresh already, but the grad_accum path also calls this under
        # `jax.eval_shape` (the metrics' structure) with the train step's own params, whose Variables belong
        # to the enclosing jit (a TraceContextError with remat, on every family)
        params, rng_state, frozen = jax.tree.map(lambda x: x, (params, rng_state, frozen))
        model = nnx.merge(graphdef, params, rng_state, frozen)
        out = loss_fn(model, mb)
        ce_sum, aux = out[0], out[1]
        metrics = out[2] if len(out) > 2 else {}
        aux = aux if isinstance(aux, AuxLosses) else AuxLosses(aux, jnp.float32(0.0))
        objective = ce_sum / n_total + coef * aux.moe / A + w_kl * aux.indexer_kl / A
        return objective, (ce_sum, aux, metrics, nnx.state(model, nnx.RngState))

    grad_fn = jax.value_and_grad(micro_objective, has_aux=True)

    def train_step(params, opt_state, rng_state, frozen, batch):
        n_total = jnp.maximum(count_fn(batch), 1.0)
        if A == 1:
            (_, (ce_sum, aux, metrics, rng_state)), grads = grad_fn(params, rng_state, frozen, batch, n_total)
        else:
            # micro-batch m = rows m, m+A, ...: each micro-batch keeps the batch's sharding
            micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // A, A, *x.shape[1:]).swapaxes(0, 1), batch)

            def body(carry, mb):
                g_acc, ce_acc, aux_acc, m_acc, rng = carry
                (_, (ce, aux, m, rng)), g = grad_fn(params, rng, frozen, mb, n_total)
                return (jax.tree.map(jnp.add, g_acc, g), ce_acc + ce, jax.tree.map(jnp.add, aux_acc, aux),
                        jax.tree.map(jnp.add, m_acc, m), rng), None

            zero = jnp.float32(0.0)
            first = jax.tree.map(lambda x: x[0], micro)
            m0 = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: micro_objective(
                params, rng_state, frozen, first, n_total)[1][2]))
            init = (jax.tree.map(jnp.zeros_like, params), zero, AuxLosses(zero, zero), m0, rng_state)
            (grads, ce_sum, aux, metrics, rng_state), _ = jax.lax.scan(body, init, micro)
            aux = jax.tree.map(lambda x: x / A, aux)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        stats = {"loss": ce_sum / n_total, "grad_norm": optax.tree.norm(grads), "aux_loss": aux.moe,
                 "target_tokens": n_total, **{k: v / n_total for k, v in metrics.items()}}
        if w_kl:
            stats["indexer_kl"] = aux.indexer_kl
        return params, opt_state, rng_state, stats

    return train_step


def _shape_key(batch: dict[str, Any]) -> tuple:
    return tuple(sorted((c, tuple(np.shape(x))) for c, x in batch.items()))


def _per_device_bytes(tree: Any) -> int:
    total = 0
    for x in jax.tree.leaves(tree):
        shards = getattr(x, "addressable_shards", None)
        total += shards[0].data.nbytes if shards else np.asarray(x).nbytes
    return total


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class Trainer:
    """One compiled train step and eval step for one model on one mesh, over the split state
    (trainable params, RNG state, frozen rest). `model` is adopted, not copied: it is placed on the
    mesh and given the compute dtype and remat policy in place; read results from `trainer.model()`.
    `trainable` is any nnx filter; `loss_fn` / `eval_fn` replace next-token cross entropy (the EAGLE-3
    draft trains a distillation loss this way, tasks/draft.py; preference optimisation another, normalised
    per pair by its `count_fn`, tasks/training/preference.py)."""

    def __init__(self, model: nnx.Module, cfg: TrainConfig, trainable: Any = nnx.Param, mesh: Mesh | None = None,
                 loss_fn: LossFn = xent_sum_and_aux, eval_fn: EvalFn = xent_sum, count_fn: CountFn = target_count,
                 indexer: IndexerConfig = IndexerConfig()):
        self.cfg = cfg
        self.mesh = mesh if mesh is not None else mesh_from_config(cfg.mesh)
        self.rules = mesh_rules(cfg.mesh)
        self.config = getattr(model, "config", None)
        self.lora = trainable is nnx.LoRAParam
        shard_model(model, self.mesh, self.rules)
        set_activation_sharding(model, self.mesh, self.rules, cfg.moe_capacity_factor)
        self.eval_graphdef = prepare_for_training(model, cfg, indexer)
        self.moe = [m for _, m in nnx.iter_graph(model) if isinstance(m, MoE)]
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
        kl_weight = indexer.kl_weight if indexer.mode == "kl" else 0.0
        train_step = make_train_step(self.graphdef, self.tx, cfg, loss_fn, count_fn, kl_weight)
        eval_graphdef = self.eval_graphdef

        def eval_step(params, rng_state, frozen, batch):
            model = nnx.merge(eval_graphdef, params, rng_state, frozen)
            return eval_fn(model, batch)

        self._train_step = jax.jit(train_step, donate_argnums=(0, 1, 2),
                                   out_shardings=(self.param_sh, opt_sh, self.rng_sh, replicated))
        self._compiled: dict[tuple, Any] = {}  # one executable per batch shape (GRPO's filtered batches vary)
        self._eval_step = jax.jit(eval_step)

    def adapter_params_per_token(self) -> int:
        """LoRA factors each token multiplies (a stacked expert factor [E, ...] counts top_k / E of itself)."""
        return adapter_params_per_token(self.params, self.config) if self.lora else 0

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
        compiled = self._compiled[_shape_key(batch)] = self._train_step.lower(*self._args(batch)).compile()
        est = {"params": _per_device_bytes(self.params), "optimizer": _per_device_bytes(self.opt_state),
               "frozen": _per_device_bytes(self.frozen)}
        ma = None
        try:
            ma = compiled.memory_analysis()
        except Exception:  # pragma: no cover - some backends do not implement it
            pass
        est["temp"] = int(getattr(ma, "temp_size_in_bytes", 0) or 0)
        est["total"] = sum(est.values())
        return est

    @property
    def compiled(self) -> bool:
        return bool(self._compiled)

    def step(self, batch: dict[str, np.ndarray | jax.Array]) -> dict[str, jax.Array]:
        if not all(isinstance(x, jax.Array) for x in batch.values()):
            batch = self.put(batch)
        if (key := _shape_key(batch)) not in self._compiled:
            self.compile(batch)
        self.params, self.opt_state, self.rng_state, stats = self._compiled[key](*self._args(batch))
        return stats

    def evaluate(self, batches: PackedBatches, n: int) -> float:
        """Token-weighted mean loss over the first `n` batches of a split (fixed order)."""
        total, count = 0.0, 0.0
        for i in range(min(n, math.ceil(batches.total / batches.batch_size))):
            ce_sum, ntok = self._eval_step(self.params, self.rng_state, self.frozen, self.global_batch(batches, i))
            total += float(ce_sum)
            count += float(ntok)
        return total / max(count, 1.0)

    def snapshot(self) -> nnx.Module:
        """The model as it stands now (eval mode), for a reference that later steps must not move (GRPO's KL
        reference): the trainable parameters are copied, since each step donates them, and the frozen ones are
        the trainer's own arrays, which no step writes. In LoRA mode the copy is the adapters only: at the
        start of training (zero-initialised B) the reference is the base with its adapters off, at the cost of
        the adapters, not of a second base."""
        params, rng_state = jax.tree.map(jnp.copy, (self.params, self.rng_state))
        model = nnx.merge(self.eval_graphdef, params, rng_state, self.frozen)
        if isinstance(model, DecoderLM):
            model.remat = "none"
        return model

    def model(self, gather: bool = False) -> nnx.Module:
        """The trained model (eval mode), its state as sharded on the mesh: models.hf.save_pretrained writes it
        without gathering (in a multi-host job every process takes part, the save is a collective).
        `gather=True`: every process holds all of it, for code that reads the model whole on each host."""
        state = (self.params, self.rng_state, self.frozen)
        if gather and jax.process_count() > 1:
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
