"""Training objectives: masked next-token cross entropy, plus the MoE load-balancing loss the layers sow.

A `LossFn` maps (model, batch) to (the per-token loss summed over the batch's loss positions, an auxiliary
loss); the train step divides the sum by the batch's target-token count. The EAGLE-3 draft plugs its own
distillation loss in through the same contract (tasks/draft.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

# A training objective: (model, batch) -> (sum of the per-token loss over the batch's loss positions, an
# auxiliary loss added with weight `aux_loss_coef`[, {name: a metric summed like the loss}]). The step
# divides the sums by the batch's count (`CountFn`: `loss_mask.sum()` unless the Trainer is given another)
# and reports the metrics beside the loss.
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


def with_moe_aux(fn: Callable[..., Any], model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[Any, jax.Array]:
    """(`fn(model, batch)`, the MoE load-balancing loss averaged over the MoE layers; 0 for a dense model), the
    latter captured from what the layers sow during this forward. Every objective that trains a policy
    (SFT, DPO, GRPO) reports it this way."""
    out, sown = nnx.capture(fn, nnx.Intermediate)(model, batch)
    leaves = [jnp.sum(x) for x in jax.tree.leaves(sown)]
    return out, sum(leaves, jnp.float32(0.0)) / max(len(leaves), 1)


def xent_sum_and_aux(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """(`xent_sum`'s cross-entropy sum, the MoE load-balancing loss: `with_moe_aux`)."""
    (ce_sum, _), aux = with_moe_aux(xent_sum, model, batch)
    return ce_sum, aux
