"""MoE building blocks (models/moe.py): routers against plain numpy re-statements of the reference
rules (docs/models/qwen3-moe.md, deepseek-v3.md, gpt-oss.md), grouped dispatch against the dense every-expert reference
in value and gradient, and the HF expert layouts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import views
from models.moe import Experts, MoE, Router, block_rows, grouped_matmul

pytestmark = pytest.mark.unit
jax.config.update("jax_default_matmul_precision", "highest")


def np_sigmoid_route(x, W, bias, k, n_group, topk_group, norm, scale):
    """The sigmoid group-limited rule (docs/models/deepseek-v3.md) step by step in numpy, one token at a time."""
    out_w, out_i = [], []
    for row in x.astype(np.float64):
        s = 1 / (1 + np.exp(-(W.astype(np.float64) @ row)))
        choice = s + bias
        groups = choice.reshape(n_group, -1)
        gscore = np.sort(groups, axis=1)[:, -2:].sum(1)
        keep = np.argsort(-gscore, kind="stable")[:topk_group]
        masked = np.full_like(choice, -np.inf)
        for g in keep:
            sl = slice(g * groups.shape[1], (g + 1) * groups.shape[1])
            masked[sl] = choice[sl]
        idx = np.argsort(-masked, kind="stable")[:k]
        w = s[idx]
        if norm:
            w = w / (w.sum() + 1e-20)
        out_w.append(w * scale)
        out_i.append(idx)
    return np.array(out_w), np.array(out_i)


def test_sigmoid_group_router_matches_reference_rule():
    E, D, k = 16, 24, 4
    r = Router(D, E, k, scoring="sigmoid", norm_topk_prob=True, n_group=4, topk_group=2,
               routed_scaling_factor=2.5, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    r.weight.set_value(jnp.asarray(rng.normal(0, 0.3, (E, D)), jnp.float32))
    # a strongly negative bias on a group: selection must move away from it although its sigmoid is high
    bias = rng.normal(0, 0.1, E).astype(np.float32)
    bias[:4] = -3.0
    r.e_score_correction_bias.set_value(jnp.asarray(bias))
    x = rng.normal(0, 1, (64, D)).astype(np.float32)
    w, idx, _ = r(jnp.asarray(x))
    ref_w, ref_i = np_sigmoid_route(x, np.asarray(r.weight[...]), bias, k, 4, 2, True, 2.5)
    for a, b in zip(np.asarray(idx), ref_i, strict=True):
        assert set(a) == set(b)
    order = np.argsort(np.asarray(idx), axis=1)
    ref_order = np.argsort(ref_i, axis=1)
    got = np.take_along_axis(np.asarray(w), order, 1)
    want = np.take_along_axis(ref_w, ref_order, 1)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert not np.any(np.asarray(idx) < 4)  # the penalised group is never chosen
    np.testing.assert_allclose(np.asarray(w).sum(1), 2.5, rtol=1e-5)  # renormalised, then scaled
    # the bias chooses but never weighs: weights are the unbiased sigmoid (up to the renormalisation)
    assert isinstance(r.e_score_correction_bias, nnx.Variable) and not isinstance(r.e_score_correction_bias, nnx.Param)


def test_softmax_routers():
    E, D, k = 8, 16, 3
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (10, D)).astype(np.float32)
    qwen = Router(D, E, k, scoring="softmax", norm_topk_prob=False, rngs=nnx.Rngs(0))
    logits = x @ np.asarray(qwen.weight[...]).T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    w, idx, _ = qwen(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(w), np.sort(p, 1)[:, ::-1][:, :k], rtol=1e-5)  # not renormalised
    oss = Router(D, E, k, scoring="softmax_topk", use_bias=True, rngs=nnx.Rngs(0))
    oss.bias.set_value(jnp.asarray(rng.normal(0, 1, E), jnp.float32))
    w, idx, logits = oss(jnp.asarray(x))
    top = np.sort(np.asarray(logits), 1)[:, ::-1][:, :k]
    ref = np.exp(top - top[:, :1])
    np.testing.assert_allclose(np.asarray(w), ref / ref.sum(1, keepdims=True), rtol=1e-5)  # softmax over the k only


@pytest.mark.parametrize("activation,bias", [("silu", False), ("gpt_oss", True)])
@pytest.mark.parametrize("num_experts", [4, 32])
def test_grouped_dispatch_equals_dense_in_value_and_gradient(activation, bias, num_experts):
    E, D, I, k, T = num_experts, 24, 16, 2, 70
    ex = Experts(E, D, I, activation=activation, use_bias=bias, rngs=nnx.Rngs(0))
    if bias:
        ex.gate_up_bias.set_value(jax.random.normal(jax.random.PRNGKey(1), (E, 2 * I)))
        ex.down_bias.set_value(jax.random.normal(jax.random.PRNGKey(2), (E, D)))
    ex.gate_up.set_value(ex.gate_up[...] * 40)  # push gpt_oss's clamps into play
    x = jax.random.normal(jax.random.PRNGKey(3), (T, D))
    idx = jax.random.randint(jax.random.PRNGKey(4), (T, k), 0, E // 2)  # half of the experts get no token
    w = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(5), (T, k)), axis=-1)
    dense = ex(x, idx, w, impl="dense")
    for impl in ("blocked", "ragged"):
        np.testing.assert_allclose(np.asarray(ex(x, idx, w, impl=impl)), np.asarray(dense), rtol=1e-5, atol=1e-6)

    def loss(model, x, w, impl):
        return jnp.sum(jnp.sin(model(x, idx, w, impl=impl)))

    g_dense = nnx.grad(loss, argnums=(0, 1, 2))(ex, x, w, "dense")
    g_grp = nnx.grad(loss, argnums=(0, 1, 2))(ex, x, w, "blocked")
    for a, b in zip(jax.tree.leaves(g_dense), jax.tree.leaves(g_grp), strict=True):
        a, b = np.asarray(a), np.asarray(b)  # fp32 sums in another order: error relative to the largest entry
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(a)), np.max(np.abs(a - b)) / np.max(np.abs(a))


def test_grouped_matmul_blocks_and_empty_groups():
    R, D, O, E = 100, 8, 6, 7
    sizes = jnp.asarray([0, 37, 0, 1, 60, 2, 0], jnp.int32)
    x = jax.random.normal(jax.random.PRNGKey(0), (R, D))
    w = jax.random.normal(jax.random.PRNGKey(1), (E, D, O))
    gid = np.repeat(np.arange(E), np.asarray(sizes))
    ref = np.einsum("rd,rdo->ro", np.asarray(x), np.asarray(w)[gid])
    np.testing.assert_allclose(np.asarray(grouped_matmul(x, w, sizes)), ref, rtol=1e-5, atol=1e-5)
    assert block_rows(100, 7) == 32 and block_rows(8192, 8) == 256 and block_rows(64, 256) == 32


def test_experts_hf_layouts_round_trip():
    for layout, act in (("per_expert", "silu"), ("gpt_oss", "gpt_oss")):
        a = Experts(4, 8, 6, activation=act, use_bias=layout == "gpt_oss", hf_layout=layout, rngs=nnx.Rngs(0))
        tensors = {k: np.asarray(v) for k, v in a.hf_export().items()}
        if layout == "gpt_oss":
            assert tensors["gate_up_proj"].shape == (4, 8, 12)  # [E, D, 2I], interleaved
            np.testing.assert_array_equal(tensors["gate_up_proj"][..., 0::2], np.asarray(a.gate_up[...])[..., :6])
            np.testing.assert_array_equal(tensors["gate_up_proj"][..., 1::2], np.asarray(a.gate_up[...])[..., 6:])
        else:
            assert tensors["3.gate_proj.weight"].shape == (6, 8) and tensors["3.down_proj.weight"].shape == (8, 6)
        b = Experts(4, 8, 6, activation=act, use_bias=layout == "gpt_oss", hf_layout=layout, rngs=nnx.Rngs(1))
        for attr, view in b.hf_views(lambda suffix, shape, t=tensors: views.Array(t[suffix])).items():
            full = view.full()
            getattr(b, attr).set_value(jnp.asarray(full))
            # any slice of the lazy view is that slice of the whole (what a device of a mesh reads)
            for index in (tuple((1, n - 1) for n in view.shape), tuple((n // 2, n) for n in view.shape)):
                np.testing.assert_array_equal(view.read(index), full[tuple(slice(a, b) for a, b in index)])
        for va, vb in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b)), strict=True):
            np.testing.assert_array_equal(np.asarray(va), np.asarray(vb))


def test_moe_block_adds_shared_expert():
    from models.layers import MLP

    D = 16
    router = Router(D, 8, 2, scoring="sigmoid", rngs=nnx.Rngs(0))
    experts = Experts(8, D, 8, rngs=nnx.Rngs(1))
    shared = MLP(D, 8, rngs=nnx.Rngs(2), dtype=jnp.float32, param_dtype=jnp.float32)
    moe = MoE(router, experts, shared)
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, D))
    w, idx, _ = router(x.reshape(-1, D))
    want = experts(x.reshape(-1, D), idx, w, impl="dense") + shared(x.reshape(-1, D))
    np.testing.assert_allclose(np.asarray(moe(x)).reshape(-1, D), np.asarray(want), rtol=1e-5, atol=1e-6)
