"""Layer-level checks: the custom-VJP, causally blocked attention against a plain autodiff reference
(with GPT-OSS sinks, MLA's value width != key width and DeepSeek's explicit scale), the GPU fast path's
masking (jax.nn.dot_product_attention, run here with its XLA implementation) against it, partial RoPE,
and RoPE frequencies (docs/models/decoder.md)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import layers
from models.layers import attention, rope_inv_freq

pytestmark = pytest.mark.unit
jax.config.update("jax_default_matmul_precision", "highest")


def reference_attention(q, k, v, mask):
    """Textbook GQA: repeat kv heads, masked fp32 softmax, plain autodiff."""
    N, K, H = q.shape[2], k.shape[2], q.shape[3]
    k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) / math.sqrt(H)
    s = jnp.where(mask[:, None], s, -1e30)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), v)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_values_and_gradients(monkeypatch, causal):
    monkeypatch.setattr(layers, "CAUSAL_CHUNK", 16)  # several blocks, one of them ragged
    B, T, N, K, H = 2, 45, 4, 2, 8
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q, w = (jax.random.normal(kk, (B, T, N, H)) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (B, T, K, H)) for kk in keys[2:])
    seg = np.ones((B, T), np.int32)
    seg[0, 20:] = 2  # two packed sequences in row 0
    seg[1, :5] = 0  # left padding in row 1
    seg = jnp.asarray(seg)
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    mask = jnp.tril(jnp.ones((T, T), bool))[None] & same
    real = (seg > 0)[:, :, None, None]  # padding queries' outputs are don't-care

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v) * w * real)

    heads_major = lambda x: x.transpose(0, 2, 1, 3)  # [B, K, S, H], the KV-cache layout
    ours = lambda q, k, v: attention(q, heads_major(k), heads_major(v), mask, causal=causal)
    ref = lambda q, k, v: reference_attention(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(ours(q, k, v) * real), np.asarray(ref(q, k, v) * real), atol=2e-6)
    g_ours = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v)
    g_ref = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g_ours, g_ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    assert np.all(np.isfinite(np.asarray(ours(q, k, v))))


def reference_sink_attention(q, k, v, mask, sinks, scale):
    """softmax over [scores, sink] with the sink column dropped (docs/models/gpt-oss.md), autodiff."""
    N, K = q.shape[2], k.shape[2]
    k, v = jnp.repeat(k, N // K, axis=2), jnp.repeat(v, N // K, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k) * scale
    s = jnp.where(mask[:, None], s, -1e30)
    sink = jnp.broadcast_to(sinks[None, :, None, None], (*s.shape[:3], 1))
    p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bnts,bsnh->btnh", p, v)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_sinks_scale_and_wider_values(monkeypatch, causal):
    """Values, rows summing to < 1, and gradients for q, k, v and the sinks: the training path of
    GPT-OSS (sinks) and DeepSeek MLA (Hv = 12 != H = 8, scale != H^-0.5)."""
    monkeypatch.setattr(layers, "CAUSAL_CHUNK", 16)
    B, T, N, K, H, Hv, scale = 2, 37, 4, 2, 8, 12, 0.21
    keys = jax.random.split(jax.random.PRNGKey(1), 5)
    q = jax.random.normal(keys[0], (B, T, N, H))
    k = jax.random.normal(keys[1], (B, T, K, H))
    v = jax.random.normal(keys[2], (B, T, K, Hv))
    w = jax.random.normal(keys[3], (B, T, N, Hv))
    sinks = jax.random.normal(keys[4], (N,))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
    heads_major = lambda x: x.transpose(0, 2, 1, 3)
    ours = lambda q, k, v, s: attention(q, heads_major(k), heads_major(v), mask, causal=causal, scale=scale, sinks=s)
    ref = lambda q, k, v, s: reference_sink_attention(q, k, v, mask, s, scale)
    np.testing.assert_allclose(np.asarray(ours(q, k, v, sinks)), np.asarray(ref(q, k, v, sinks)), atol=2e-6)
    ones = jnp.ones((B, T, K, Hv))  # with v = 1 the output is each row's attention mass: < 1 with a sink
    mass = np.asarray(attention(q, heads_major(k), heads_major(ones), mask, scale=scale, sinks=sinks))
    assert np.all(mass < 1.0) and np.all(mass > 0.0)
    loss = lambda fn: (lambda q, k, v, s: jnp.sum(fn(q, k, v, s) * w))
    g_ours = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    g_ref = jax.jit(jax.grad(loss(ref), argnums=(0, 1, 2, 3)))(q, k, v, sinks)
    for a, b in zip(g_ours, g_ref, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
    assert np.max(np.abs(np.asarray(g_ours[3]))) > 1e-3  # the sinks do get a gradient



@pytest.mark.parametrize("window", [None, 7])
def test_fused_attention_path_matches_attention_core(monkeypatch, window):
    """The GPU fast path (`jax.nn.dot_product_attention`, cuDNN on a GPU) gets the same masks as today's
    kernel: forced here with implementation="xla", which runs on CPU, it matches `attention_core`'s values
    and gradients in fp32 for GQA + causal + packed segments + left padding + a sliding window (the
    `window` hint on, the window also folded into the mask as models/decoder.py builds it)."""
    monkeypatch.setattr(layers, "CAUSAL_CHUNK", 16)
    B, T, N, K, H = 2, 40, 6, 2, 8
    keys = jax.random.split(jax.random.PRNGKey(3), 4)
    q, w = (jax.random.normal(kk, (B, T, N, H)) for kk in keys[:2])
    k, v = (jax.random.normal(kk, (B, K, T, H)) for kk in keys[2:])  # head-major, the KV-cache layout
    seg = np.ones((B, T), np.int32)
    seg[0, 17:] = 2  # two packed sequences in row 0
    seg[1, :6] = 0  # left padding in row 1
    seg = jnp.asarray(seg)
    idx = jnp.arange(T)
    mask = (idx[None, :, None] >= idx[None, None, :]) & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    if window is not None:
        mask = mask & (idx[None, :, None] - idx[None, None, :] < window)
    real = (seg > 0)[:, :, None, None]  # padding queries' outputs are don't-care
    assert layers.attention_impl(q, k, v, causal=True, sinks=None, impl="xla") == "xla"
    assert layers.attention_impl(q, k, v, causal=True, sinks=None) == "core"  # CPU default: today's kernel
    assert layers.attention_impl(q, k, v, causal=True, sinks=None, impl="cudnn") == "core"  # no GPU here
    assert layers.attention_impl(q, k, v, causal=False, sinks=None, impl="xla") == "core"  # cached calls
    assert layers.attention_impl(q, k, v, causal=True, sinks=jnp.zeros(N), impl="xla") == "core"  # GPT-OSS

    def run(impl):
        return lambda q, k, v: attention(q, k, v, mask, causal=True, window=window, impl=impl) * real

    for impl in ("xla", "core"):  # the environment switch reaches the same kernels
        monkeypatch.setenv("FORGELINE_ATTENTION", impl)
        np.testing.assert_allclose(np.asarray(attention(q, k, v, mask, causal=True) * real),
                                   np.asarray(run(impl)(q, k, v)), atol=0)
    np.testing.assert_allclose(np.asarray(run("xla")(q, k, v)), np.asarray(run("core")(q, k, v)), atol=2e-6)
    loss = lambda fn: (lambda q, k, v: jnp.sum(fn(q, k, v) * w))
    g_fused = jax.jit(jax.grad(loss(run("xla")), argnums=(0, 1, 2)))(q, k, v)
    g_core = jax.jit(jax.grad(loss(run("core")), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(g_fused, g_core, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)

def test_partial_rope_rotates_only_the_first_dims():
    """GLM-4.5 (docs/models/glm4-moe.md): cos/sin over d < H rotate the first d dims of each head; the rest
    pass through."""
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 5, 2, 16))
    inv, _ = layers.rope_frequencies(8, 10000.0)
    cos, sin = layers.rope_cos_sin(jnp.arange(5)[None], inv, jnp.float32)
    y = layers.apply_rope(x, cos, sin)
    np.testing.assert_array_equal(np.asarray(y[..., 8:]), np.asarray(x[..., 8:]))
    np.testing.assert_allclose(np.asarray(y[..., :8]), np.asarray(layers.apply_rope(x[..., :8], cos, sin)))
    np.testing.assert_allclose(np.asarray(y[:, 0]), np.asarray(x[:, 0]), atol=1e-7)  # position 0: identity


def test_rope_inv_freq_default_and_llama3():
    default = rope_inv_freq(8, 10000.0)
    np.testing.assert_allclose(default, 10000.0 ** (-np.arange(0, 8, 2) / 8), rtol=1e-6)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    inv = rope_inv_freq(128, 500000.0, scaling)
    base = rope_inv_freq(128, 500000.0)
    wavelen = 2 * math.pi / base
    assert np.allclose(inv[wavelen < 8192 / 4], base[wavelen < 8192 / 4])  # high frequencies kept
    assert np.allclose(inv[wavelen > 8192], base[wavelen > 8192] / 8)  # low frequencies scaled
    mid = (wavelen >= 2048) & (wavelen <= 8192)
    assert mid.any() and np.all(inv[mid] <= base[mid]) and np.all(inv[mid] >= base[mid] / 8)
