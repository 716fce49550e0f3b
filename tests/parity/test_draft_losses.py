"""The draft objectives (models/draft_losses.py) against vllm-project/speculators 0.9.0's own eager
implementations (`speculators/losses/eager.py`), value and gradient, on logits wide enough to have
near-zero probabilities; plus the mix / temperature / error handling of `draft_loss`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from models.draft_losses import OBJECTIVES, acceptance, check_objective, draft_loss

pytestmark = pytest.mark.parity
jax.config.update("jax_default_matmul_precision", "highest")


def _inputs(seed: int = 0, V: int = 50):
    rng = np.random.default_rng(seed)
    logits = (2.0 * rng.normal(size=(1, 7, V))).astype(np.float32)
    targets = (4.0 * rng.normal(size=(1, 7, V))).astype(np.float32)
    targets[0, 3, 5] += 40.0  # a near point-mass target: exp underflows for the other ids
    return logits, targets


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_objective_equals_speculators_eager(name):
    from speculators.losses import eager
    ref_fn = {"kl_div": eager.kl_div_loss, "rkl": eager.reverse_kl_div_loss, "jsd": eager.js_div_loss,
              "ce": eager.ce_loss, "tv": eager.tv_loss, "nla": eager.neg_log_acceptance_loss,
              "lk_hybrid": eager.lk_hybrid_loss}[name]
    logits, targets = _inputs()
    lt = torch.tensor(logits, requires_grad=True)
    want = ref_fn(lt, torch.tensor(targets))  # [1, 7]
    want.sum().backward()
    got, grad = jax.value_and_grad(lambda x: OBJECTIVES[name](x, jnp.asarray(targets)).sum())(jnp.asarray(logits))
    np.testing.assert_allclose(np.asarray(OBJECTIVES[name](jnp.asarray(logits), jnp.asarray(targets))),
                               want.detach().numpy(), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(float(got), float(want.detach().sum()), rtol=2e-5)
    np.testing.assert_allclose(np.asarray(grad), lt.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_tv_is_one_minus_the_acceptance_rate_of_speculative_sampling():
    """α = Σ min(p, q) is the probability that d ~ q passes u < p(d)/q(d) (Monte Carlo, 200k draws)."""
    logits, targets = _inputs(1, V=6)
    p = np.asarray(jax.nn.softmax(targets[0, 0]), np.float64)
    q = np.asarray(jax.nn.softmax(logits[0, 0]), np.float64)
    rng = np.random.default_rng(2)
    d = rng.choice(6, size=200_000, p=q / q.sum())
    accepted = np.mean(rng.random(200_000) < np.minimum(1.0, p[d] / q[d]))
    alpha = float(acceptance(jnp.asarray(logits[0, 0]), jnp.asarray(targets[0, 0])))
    assert abs(accepted - alpha) < 4e-3
    assert float(OBJECTIVES["tv"](jnp.asarray(logits[0, 0]), jnp.asarray(targets[0, 0]))) == pytest.approx(1 - alpha)


def test_mix_temperature_and_errors():
    logits, targets = _inputs(3)
    lg, tg = jnp.asarray(logits), jnp.asarray(targets)
    mix = draft_loss(lg, tg, {"ce": 0.1, "tv": 0.9})
    want = 0.1 * OBJECTIVES["ce"](lg, tg) + 0.9 * OBJECTIVES["tv"](lg, tg)
    np.testing.assert_allclose(np.asarray(mix), np.asarray(want), rtol=1e-6)
    hot = draft_loss(lg, tg, "tv", temperature=2.0)
    np.testing.assert_allclose(np.asarray(hot), np.asarray(OBJECTIVES["tv"](lg / 2, tg / 2)), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(draft_loss(lg, tg, "tv", temperature=0.0)),
                                  np.asarray(OBJECTIVES["tv"](lg, tg)))  # greedy serving trains at T = 1
    with pytest.raises(ValueError, match="unknown objective 'kl'"):
        check_objective("kl")
    with pytest.raises(ValueError, match="weight of 'tv'"):
        check_objective({"tv": -1.0})
    with pytest.raises(ValueError, match="empty mix"):
        check_objective({})
