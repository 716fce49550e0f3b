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
from typing import NamedTuple

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


# -- the target's side: its logits restricted to the draft vocabulary ---------------------------------------


class TargetHead(NamedTuple):
    """The target's logits in factored form, `hidden @ head.T`: its last normed hidden states `hidden` [..., D_t]
    and its LM head `head` [V, D_t] (HF layout). A draft's loss reads the target only at the draft vocabulary's
    columns plus whether the target's argmax is among them (`restricted_targets`), which two matmuls over the
    head's rows give without materialising and gathering [..., V] logits."""

    hidden: jax.Array
    head: jax.Array

    def at(self, index: jax.Array) -> TargetHead:
        """The hidden states at positions `index` [B, M] along axis 1: hidden [B, T, D_t] -> [B, M, D_t]."""
        return TargetHead(jnp.take_along_axis(self.hidden, index[..., None], axis=1), self.head)


def restricted_targets(target: jax.Array | TargetHead, token_ids: jax.Array,
                       in_vocab: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the target's logits at the draft vocabulary's columns [..., Vd] fp32, whether the target's
    full-vocabulary argmax is a draft token [...] bool), from its full logits [..., V] or a `TargetHead`.

    token_ids [Vd]: the draft vocabulary as target ids (ascending); in_vocab [V] bool: its indicator (`t2d`).
    From a TargetHead, the restricted logits are hidden @ head[token_ids].T and the argmax test compares their
    maximum with the maximum over the other V - Vd rows: the same FLOPs as the full logits, without the [.., V]
    column gather and the argmax over V (on a 2-core CPU: 54 ms instead of 145 for 2,048 positions, V 4,096,
    Vd 2,048). Where a draft token and another tie for the maximum, it counts as the draft's (argmax over the
    full logits takes the lower id; float ties between different rows of a trained head do not occur in practice)."""
    if not isinstance(target, TargetHead):
        full = target.astype(jnp.float32)  # [..., V]
        return jnp.take(full, token_ids, axis=-1), jnp.take(in_vocab, jnp.argmax(full, axis=-1))
    hidden, head = target.hidden.astype(jnp.float32), target.head.astype(jnp.float32)
    restricted = jnp.einsum("...d,vd->...v", hidden, jnp.take(head, token_ids, axis=0))  # [..., Vd]
    others = head.shape[0] - token_ids.shape[0]
    if others == 0:  # the draft vocabulary is the target's
        return restricted, jnp.ones(restricted.shape[:-1], bool)
    other_ids = jnp.nonzero(~in_vocab, size=others, fill_value=0)[0]  # [V - Vd]
    rest = jnp.einsum("...d,vd->...v", hidden, jnp.take(head, other_ids, axis=0))  # [..., V - Vd]
    return restricted, jnp.max(restricted, axis=-1) >= jnp.max(rest, axis=-1)
