"""Per-position objectives for training speculative-decoding drafts, selectable by name.

Every objective compares the draft's logits Q with the target's logits P over the same (draft)
vocabulary, position by position, and returns a [..] loss per position (fp32). The names and the
definitions are vllm-project/speculators 0.9.0's (`speculators/losses/eager.py`), so a recipe that says
`loss: lk_hybrid` means what it means there:

    kl_div     forward KL(p ‖ q) = Σ p (log p − log q): EAGLE-3's soft-label objective (its gradient is
               the soft-label cross-entropy's; the value is lower by the target's entropy)
    rkl        reverse KL(q ‖ p)
    jsd        Jensen–Shannon divergence ½ KL(p ‖ m) + ½ KL(q ‖ m), m = (p + q) / 2
    ce         cross-entropy on the target's argmax (hard labels)
    tv         total variation 1 − Σ min(p, q): one minus the acceptance rate α of speculative sampling
               (Leviathan et al. 2023, Thm 3.5), i.e. the objective that *is* the acceptance rate
    nla        −log α (negative log-acceptance; its gradient is TV's scaled by 1/α, usable from a cold start)
    lk_hybrid  λ·KL + (1 − λ)·TV with λ = exp(−η · sg[α]) (Samarin et al., "LK Losses: Direct Acceptance
               Rate Optimization for Speculative Decoding", arXiv 2602.23881): KL's strong gradient while
               the draft is far from the target, TV once α grows; η = 3

Temperature: the acceptance rate at serving temperature T is computed between softmax(P / T) and
softmax(Q / T); `temperature` scales both logits before the objective, so a draft can be trained for
the temperature it will serve at (T = 0 is treated as 1: at greedy decoding only the argmax matters,
and the objectives above at T = 1 are what EAGLE-3 and speculators train with).

A weighted mix is a mapping {name: weight} (speculators' `'{"ce": 0.1, "tv": 0.9}'`); the names and
their validation live in models/objectives.py, which recipes import without JAX.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from models.objectives import OBJECTIVE_NAMES, Objective, check_objective

NLA_EPS = 1e-5  # speculators' clamp of α inside −log α
LK_ETA = 3.0


def _dists(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    log_q = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    log_p = jax.nn.log_softmax(targets.astype(jnp.float32), axis=-1)
    return log_q, log_p, jnp.exp(log_q), jnp.exp(log_p)


def _xlogy_ratio(p: jax.Array, log_p: jax.Array, log_q: jax.Array) -> jax.Array:
    """Σ p (log p − log q) with 0·log 0 = 0 (as torch's kl_div). [..., V] -> [...]"""
    return jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)


def kl_div(logits: jax.Array, targets: jax.Array) -> jax.Array:
    log_q, log_p, _, p = _dists(logits, targets)
    return _xlogy_ratio(p, log_p, log_q)


def reverse_kl(logits: jax.Array, targets: jax.Array) -> jax.Array:
    log_q, log_p, q, _ = _dists(logits, targets)
    return _xlogy_ratio(q, log_q, log_p)


def jsd(logits: jax.Array, targets: jax.Array) -> jax.Array:
    log_q, log_p, q, p = _dists(logits, targets)
    log_m = jnp.logaddexp(log_q, log_p) - math.log(2.0)
    return 0.5 * (_xlogy_ratio(p, log_p, log_m) + _xlogy_ratio(q, log_q, log_m))


def ce(logits: jax.Array, targets: jax.Array) -> jax.Array:
    log_q = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    label = jnp.argmax(targets, axis=-1)
    return -jnp.take_along_axis(log_q, label[..., None], axis=-1)[..., 0]


def acceptance(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """α = Σ_v min(p_v, q_v): the probability that speculative sampling accepts a token drawn from q."""
    _, _, q, p = _dists(logits, targets)
    return jnp.sum(jnp.minimum(p, q), axis=-1)


def tv(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return 1.0 - acceptance(logits, targets)


def nla(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return -jnp.log(jnp.maximum(acceptance(logits, targets), NLA_EPS))


def lk_hybrid(logits: jax.Array, targets: jax.Array, eta: float = LK_ETA) -> jax.Array:
    alpha = acceptance(logits, targets)
    lam = jnp.exp(-eta * jax.lax.stop_gradient(alpha))
    return lam * kl_div(logits, targets) + (1.0 - lam) * (1.0 - alpha)


OBJECTIVES: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "kl_div": kl_div, "rkl": reverse_kl, "jsd": jsd, "ce": ce, "tv": tv, "nla": nla, "lk_hybrid": lk_hybrid,
}

assert tuple(OBJECTIVES) == OBJECTIVE_NAMES


def draft_loss(logits: jax.Array, targets: jax.Array, objective: Objective = "kl_div",
               temperature: float = 1.0) -> jax.Array:
    """Per-position loss [...] of draft logits [..., V] against target logits [..., V] (the same
    vocabulary) under `objective` (a name or a weighted mix), at serving `temperature` (0 -> 1)."""
    t = 1.0 if temperature <= 0 else float(temperature)
    logits, targets = logits.astype(jnp.float32) / t, targets.astype(jnp.float32) / t
    total = None
    for name, w in check_objective(objective).items():
        term = w * OBJECTIVES[name](logits, targets)
        total = term if total is None else total + term
    return total
