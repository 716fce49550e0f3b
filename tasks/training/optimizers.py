"""Optimizers: warmup + cosine schedule, AdamW, and Muon on hidden matrices (Kimi K2 / Moonlight, optax.contrib),
global-norm clipping, weight decay on matrices only."""

from __future__ import annotations

from typing import Any

import jax
import optax

from tasks.training.config import TrainConfig


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
