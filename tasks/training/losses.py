"""Training objectives: masked next-token cross entropy, plus the auxiliary losses the layers sow (the MoE
load-balancing loss, a DSA indexer's KL objective).

A `LossFn` maps (model, batch) to (the per-token loss summed over the batch's loss positions, the auxiliary
losses); the train step divides the sum by the batch's target-token count. The EAGLE-3 draft plugs its own
distillation loss in through the same contract (tasks/draft.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models.deepseek_v32 import INDEXER_KL

# A training objective: (model, batch) -> (sum of the per-token loss over the batch's loss positions, the
# auxiliary losses (`AuxLosses`, or a scalar MoE loss) added with their weights[, {name: a metric summed like
# the loss}]). The step divides the sums by the batch's count (`CountFn`: `loss_mask.sum()` unless the Trainer
# is given another) and reports the metrics beside the loss.
LossFn = Callable[[nnx.Module, dict[str, jax.Array]], tuple[jax.Array, ...]]
CountFn = Callable[[dict[str, jax.Array]], jax.Array]
# An eval objective: (model, batch) -> (loss sum, token count).
EvalFn = Callable[[nnx.Module, dict[str, jax.Array]], tuple[jax.Array, jax.Array]]


def target_count(batch: dict[str, jax.Array]) -> jax.Array:
    """The loss positions of a packed-rows batch: what a per-token loss sum is divided by."""
    return batch["loss_mask"].astype(jnp.float32).sum()


def xent_sum(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(sum of next-token cross entropy over `loss_mask`, number of target tokens), both fp32 scalars."""
    logits = model(batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    logits = logits.astype(jnp.float32)  # [B, T, V]
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["target_ids"])  # [B, T]
    mask = batch["loss_mask"].astype(jnp.float32)
    return (ce * mask).sum(), mask.sum()


class AuxLosses(NamedTuple):
    """What the layers sow during a training forward: `moe`, the MoE load-balancing loss averaged over the MoE
    layers (0 for a dense model), and `indexer_kl`, the DSA indexers' KL objective averaged over the layers that
    compute it (models/deepseek_v32.py `DSAttention.kl_objective`; 0 unless the trainer trains the indexers).
    The train step weighs them by `train.aux_loss_coef` and `finetune.indexer.kl_weight`."""

    moe: jax.Array
    indexer_kl: jax.Array


def with_aux_losses(fn: Callable[..., Any], model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[Any, AuxLosses]:
    """(`fn(model, batch)`, the auxiliary losses the layers sow during this forward: `AuxLosses`). Every
    objective that trains a policy (SFT, DPO, GRPO, distillation) passes them on this way."""
    out, sown = nnx.capture(fn, nnx.Intermediate)(model, batch)
    moe: list[jax.Array] = []
    kl: list[jax.Array] = []
    for path, value in nnx.to_flat_state(sown):
        (kl if INDEXER_KL in path else moe).extend(jnp.sum(x) for x in jax.tree.leaves(value))
    mean = lambda xs: sum(xs, jnp.float32(0.0)) / max(len(xs), 1)
    return out, AuxLosses(mean(moe), mean(kl))


def xent_sum_and_aux(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, AuxLosses]:
    """(`xent_sum`'s cross-entropy sum, the auxiliary losses: `with_aux_losses`)."""
    (ce_sum, _), aux = with_aux_losses(xent_sum, model, batch)
    return ce_sum, aux
