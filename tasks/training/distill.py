"""Knowledge distillation on the teacher's top-k logits (`finetune.method: distill`).

The teacher (the release's base) answers the data's prompts in the traces stage, which stores with its answers
its K most likely next tokens and their log-probabilities at every position (tasks/data/features.py,
`topk_for_rows`). The student (the teacher's own layers `student_layers`, models/pruning.py) is trained on those
rows with, per answer token (Hinton et al. 2015, "Distilling the knowledge in a neural network"):

    p_k = softmax_k(log p_teacher[top-k] / T)          the teacher's top k, renormalised, at temperature T
    q   = log_softmax(z_student / T)                   the student over the whole vocabulary
    KL  = sum_k p_k (log p_k - q[id_k])                equals KL(p || q) when K = V
    loss = alpha * CE(z_student, sampled token) + (1 - alpha) * T² * KL

Training on the teacher's own answers (not the data's) is sequence-level distillation (Kim & Rush 2016); the
logits add what the teacher would have said at every position (its "dark knowledge"). With K < V the teacher's
tail is dropped and its head renormalised, the sparse-logit distillation of Raman et al. 2023 and Anshumann et
al. 2025, which keeps K·8 bytes per token instead of V·4.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.pruning import check_layers, evenly_spaced
from tasks.data.features import load_topk
from tasks.training.data import PackedBatches
from tasks.training.losses import with_aux_losses, xent_sum


def student_layers(layers: list[int] | None, num_layers: int) -> tuple[int, ...]:
    """The teacher layers the student keeps: the configured ids (checked) or half of them, evenly spaced."""
    if layers is None:
        return evenly_spaced(num_layers, max(1, num_layers // 2))
    return check_layers(layers, num_layers, "finetune.distill.student_layers")


def distill_sums(logits: jax.Array, topk_logprobs: jax.Array, topk_ids: jax.Array, target_ids: jax.Array,
                 mask: jax.Array, *, temperature: float, alpha: float) -> dict[str, jax.Array]:
    """Sums over the `mask` positions of the per-token loss and its parts (fp32 scalars).

    logits [B, T, V] (the student), topk_logprobs / topk_ids [B, T, K] (the teacher), target_ids [B, T] (the
    tokens the teacher sampled), mask [B, T]."""
    z = logits.astype(jnp.float32)
    logq = jax.nn.log_softmax(z / temperature, axis=-1)  # [B, T, V]
    q_k = jnp.take_along_axis(logq, topk_ids, axis=-1)  # [B, T, K]
    logp = jax.nn.log_softmax(topk_logprobs.astype(jnp.float32) / temperature, axis=-1)  # [B, T, K] renormalised
    kl = jnp.sum(jnp.exp(logp) * (logp - q_k), axis=-1)  # [B, T]
    ce = optax.softmax_cross_entropy_with_integer_labels(z, target_ids)  # [B, T], at T = 1
    agree = (jnp.argmax(z, axis=-1) == topk_ids[..., 0]).astype(jnp.float32)  # the teacher's top-1
    m = mask.astype(jnp.float32)
    per = alpha * ce + (1.0 - alpha) * temperature**2 * kl
    return {"loss": (per * m).sum(), "kl": (kl * m).sum(), "ce": (ce * m).sum(), "top1_agreement": (agree * m).sum()}


def _sums(model: nnx.Module, batch: dict[str, jax.Array], temperature: float, alpha: float) -> dict[str, jax.Array]:
    logits = model(batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    return distill_sums(logits, batch["topk_logprobs"], batch["topk_ids"], batch["target_ids"], batch["loss_mask"],
                        temperature=temperature, alpha=alpha)


def distill_objective(temperature: float, alpha: float) -> Callable[..., tuple[Any, ...]]:
    """The Trainer's loss: (loss sum, the MoE balance loss, {kl, ce, top1_agreement} sums) per answer token."""

    def loss_fn(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[Any, ...]:
        sums, aux = with_aux_losses(lambda m, b: _sums(m, b, temperature, alpha), model, batch)
        return sums["loss"], aux, {k: sums[k] for k in ("kl", "ce", "top1_agreement")}

    return loss_fn


def distill_eval(temperature: float, alpha: float) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """The held-out loss: (the distillation loss summed, the answer-token count)."""

    def eval_fn(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        return _sums(model, batch, temperature, alpha)["loss"], batch["loss_mask"].astype(jnp.float32).sum()

    return eval_fn


class TopkBatches(PackedBatches):
    """The teacher's packed trace rows plus its top-k log-probabilities, stored beside each shard
    (`topk-<shard>.safetensors`: topk_logprobs / topk_ids [R, T, K]); a shard without one is an error naming it."""

    def _read(self, shard: int) -> dict[str, np.ndarray]:
        rows = super()._read(shard)
        path = self.files[shard].with_name(f"topk-{self.files[shard].stem}.safetensors")
        if not path.exists():
            raise FileNotFoundError(f"{path}: the teacher's top-k logits of {self.files[shard].name} are missing "
                                    "(traces with top_k_logits > 0 write them)")
        topk = load_topk(path)
        if topk["topk_ids"].shape[:2] != rows["input_ids"].shape:
            raise ValueError(f"{path}: {list(topk['topk_ids'].shape[:2])} rows x positions, its shard has "
                             f"{list(rows['input_ids'].shape)}")
        return {**rows, **topk}


# -- the comparison the report shows -------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature"))
def _heldout_sums(graphdef: Any, state: Any, batch: dict[str, jax.Array], temperature: float) -> dict[str, jax.Array]:
    sums = _sums(nnx.merge(graphdef, state), batch, temperature, 0.0)
    return {**sums, "tokens": batch["loss_mask"].astype(jnp.float32).sum()}


def teacher_match(model: nnx.Module, traces_dir: Path, put: Callable[[dict[str, np.ndarray]], Any], *,
                  batch_size: int, max_batches: int, temperature: float = 1.0) -> dict[str, float]:
    """How close `model` is to the teacher on the held-out traces (the teacher's answers to held-out prompts), per
    answer token: KL(teacher top-k || model), cross entropy on the teacher's tokens, and how often the model's
    most likely token is the teacher's."""
    valid = TopkBatches(traces_dir, "valid", batch_size, shuffle=False)
    graphdef, state = nnx.split(model)
    n = min(max_batches, -(-valid.total // batch_size))
    total: dict[str, float] = {}
    for step in range(n):
        sums = _heldout_sums(graphdef, state, put(valid.batch(step)), temperature)
        for k, v in sums.items():
            total[k] = total.get(k, 0.0) + float(v)
    tokens = max(total.pop("tokens"), 1.0)
    return {"teacher_kl": total["kl"] / tokens, "teacher_ce": total["ce"] / tokens,
            "top1_agreement": total["top1_agreement"] / tokens}


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _xent(graphdef: Any, state: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    return xent_sum(nnx.merge(graphdef, state), batch)


def data_loss(model: nnx.Module, data_dir: Path, put: Callable[[dict[str, np.ndarray]], Any], *, batch_size: int,
              max_batches: int) -> float:
    """Mean next-token cross entropy per loss token on the data's held-out rows (its own answers)."""
    valid = PackedBatches(data_dir, "valid", batch_size, shuffle=False)
    graphdef, state = nnx.split(model)
    total = count = 0.0
    for step in range(min(max_batches, -(-valid.total // batch_size))):
        s, n = _xent(graphdef, state, put(valid.batch(step)))
        total, count = total + float(s), count + float(n)
    return total / max(count, 1.0)
