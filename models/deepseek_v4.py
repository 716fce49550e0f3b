"""DeepSeek-V4 in Flax NNX, numerically matching transformers 5.25 `DeepseekV4ForCausalLM`
(`models/deepseek_v4/modeling_deepseek_v4.py`, `configuration_deepseek_v4.py`, generated from
`modular_deepseek_v4.py`; the reference is https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash, `inference/model.py`).

Mirrors docs/models/deepseek-v4.md. Every layer is MoE and carries `hc_mult` residual streams:

    streams [B, T, n, D] = embed(ids) copied n times
    per layer, twice (attention, then MoE), manifold-constrained hyper-connections (mHC):
        pre, post, comb = f(rms(flatten(streams)) · fn, base, scale)   (comb: Sinkhorn-projected n × n)
        h = block(norm(Σ_j pre_j · stream_j));  streams = post ⊗ h + combᵀ · streams
    hidden = norm(Σ_j pre_j · stream_j) (the `hc_head`), logits = head(hidden)

Attention (one kv head, K = V, per-head sink, partial interleaved RoPE on the trailing R dims of each head):
    q = unweighted_rms(wq_b(q_norm(wq_a(x)))) per head, kv = norm(wkv(x)), both rotated
    keys = the last `sliding_window` tokens (every layer) ++ compressed entries (CSA / HCA layers):
      HCA: entry w = norm(Σ_{m tokens of window w} softmax(wgate(x) + ape) ⊙ wkv(x)), rotated at position w·m
      CSA: windows of 2m tokens with stride m (the previous window's first half-projection, the current one's
           second half), m = compress_rate_csa, and a lightning indexer (its own compressor at index_head_dim,
           queries from the q latent, head weights) keeping `index_topk` entries per query
    entry w is visible to query t once its window is closed ((w + 1)·m − 1 ≤ t)
    out = attention(q, keys) with the sink, the output's rope dims rotated back by the query position,
          then the grouped low-rank projection: o_groups groups of heads → o_lora_rank each (wo_a), → D (wo_b)
MoE: sqrt(softplus) router scores (+ e_score_correction_bias to choose) or, in the first `hash_moe` layers, the
experts of a fixed token-id table (`tid2eid`); clamped SwiGLU experts (gate ≤ limit, |up| ≤ limit) plus one
clamped shared expert.

HF tensors are transformers' `save_pretrained` names (the reference's: `layers.{i}.attn.wq_a`, `...attn.compressor.
wkv`, `...ffn.experts.{e}.w1`, `layers.{i}.hc_attn_fn`, `hc_head.hc_fn`, top-level `head.weight`), which this module's
attribute names follow.

KV cache (models/generate.py `KVCache`; docs/models/deepseek-v4.md): each layer's `cache.k` holds the rotated K = V
sliding key of every slot (no `cache.v`), and `cache.extra[str(i)]` compressed layer i's state
(`DeepseekV4Config.cache_extra`), every row keyed by slot:

    entries [B, S // m, Hd]  the finished compressed entries: entry w (rotated at w·m) at row w
    index   [B, S // m, DI]  CSA only: the indexer compressor's entries, at the same rows
    ring    [B, P, F]        the per-token [kv | gate] projections (CSA: then the indexer's) of the last P slots,
                             slot s at row s mod P; P = span + call_width − 1, span = m (HCA) or 2m (CSA's overlap)

A call of T tokens at slots start..start+T−1 pools only the ⌈T / m⌉ windows that may close in it, gathered from the
ring and its own projections (`Compressor.step`: O(T + m) compressor work per call whatever S), writes the closed
ones' entries at their rows and its projections into the ring. `rollback` (lowering `length`) needs nothing more: an
entry closed by rejected tokens is visible only to queries at or past its closing slot, and the call that writes
that slot again rewrites the entry first; the ring's call_width − 1 spare rows keep the open window's slots that a
rollback into a call of up to call_width tokens (speculative verification, k + 1) needs again. transformers'
`DeepseekV4HCACache` / `DeepseekV4CSACache` keep the same state (the entries emitted so far, a buffer of the open
window's projections, the previous window's overlap halves) as growing lists; here the shapes are fixed for `jit`.

Shape legend: B batch, T length, S key slots (the cache length with a cache), D model, n streams, N heads,
Hd head dim, R rope dims, Q q latent, G o_groups, O o_lora_rank, H indexer heads, DI indexer head dim, m rate,
W compressed entries, E experts, k experts per token.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.decoder import Context, DecoderLM
from models.deepseek_v4_config import (  # noqa: F401  (re-exported: the family's names live here too)
    ARCHITECTURE,
    CSA,
    DEFAULT_HASH_LAYERS,
    HCA,
    LAYER_TYPES,
    MLP_LAYER_TYPES,
    RATIO_TO_TYPE,
    SCORING,
    SLIDING,
    DeepseekV4Config,
)
from models.deepseek_v32 import Indexer as DSAIndexer
from models.generate import KVCache
from models.layers import Buffer, Linear, RMSNorm, attention, param
from models.moe import Experts, MoE, Router

# the registry record (models/families.py): HF architecture -> the config.json model_types it ships with
REGISTRY = {"DeepseekV4ForCausalLM": ("deepseek_v4",)}

# ------------------------------------------------------------------------------------------------
# Small pieces: interleaved RoPE on the trailing dims, the unweighted RMS norm, mHC weights
# ------------------------------------------------------------------------------------------------


def rope_tail(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, X] with its last 2·len(cos) dims rotated in adjacent pairs (x0, x1), (x2, x3), ... by the
    tables cos, sin [B, T, R/2] (transformers `apply_rotary_pos_emb`: in fp32, cast back; the leading dims pass)."""
    R = 2 * cos.shape[-1]
    rot = x[..., -R:].astype(jnp.float32)
    even, odd = rot[..., 0::2], rot[..., 1::2]  # [B, T, N, R/2]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    rotated = jnp.stack([even * c - odd * s, odd * c + even * s], axis=-1).reshape(rot.shape)
    return jnp.concatenate([x[..., :-R], rotated.astype(x.dtype)], axis=-1)


def unweighted_rms(x: jax.Array, eps: float) -> jax.Array:
    """x · rsqrt(mean(x²) + eps) over the last axis, statistics in fp32 (transformers' unweighted RMSNorm)."""
    x32 = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps).astype(x.dtype)


def fp32_norm(features: int, eps: float, axis_name: str = "norm") -> RMSNorm:
    """An RMSNorm transformers keeps in fp32 (weight, multiply and file dtype), whatever the model's dtype."""
    norm = RMSNorm(features, eps=eps, axis_name=axis_name, param_dtype=jnp.float32, weight_in_fp32=True)
    norm.keep_fp32 = True
    return norm


def hyper_weights(streams: jax.Array, fn: jax.Array, base: jax.Array, scale: jax.Array, *, iters: int, eps: float,
                  norm_eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """mHC (transformers `DeepseekV4HyperConnection`): streams [B, T, n, D] -> (post [B, T, n], comb [B, T, n, n],
    the collapsed block input Σ_j pre_j · stream_j [B, T, D]); comb is projected towards a doubly-stochastic
    matrix by `iters` Sinkhorn-Knopp steps (columns first)."""
    B, T, n, D = streams.shape
    flat = unweighted_rms(streams.reshape(B, T, n * D).astype(jnp.float32), norm_eps)  # [B, T, nD]
    mixes = flat @ fn.astype(jnp.float32).T  # [B, T, (2 + n) n]
    pre_w, post_w, comb_w = mixes[..., :n], mixes[..., n:2 * n], mixes[..., 2 * n:].reshape(B, T, n, n)
    pre = jax.nn.sigmoid(pre_w * scale[0] + base[:n]) + eps
    post = 2 * jax.nn.sigmoid(post_w * scale[1] + base[n:2 * n])
    comb = jax.nn.softmax(comb_w * scale[2] + base[2 * n:].reshape(n, n), axis=-1) + eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

    def sinkhorn_step(_: int, comb: jax.Array) -> jax.Array:  # rows, then columns
        comb = comb / (jnp.sum(comb, axis=-1, keepdims=True) + eps)
        return comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

    # The same steps either way. On a GPU / TPU unrolled: XLA fuses them and a rolled loop would pay a host round
    # trip per iteration; on the CPU (tests, smoke releases) rolled: iters - 1 copies of the step in every mix of
    # every layer made the tiny V4's forward compile 2.8 s and its gradient 11.9 s, rolled 1.3 s and 3.6 s.
    comb = jax.lax.fori_loop(0, iters - 1, sinkhorn_step, comb, unroll=jax.default_backend() != "cpu")
    collapsed = jnp.sum(pre[..., None] * streams, axis=2).astype(streams.dtype)  # [B, T, D]
    return post, comb, collapsed


# ------------------------------------------------------------------------------------------------
# Compressors and the indexer
# ------------------------------------------------------------------------------------------------


class Compressor(nnx.Module):
    """One compressed entry per closed window of m tokens (HF `...compressor.{wkv, wgate, ape, norm}`): softmax
    over the window of wgate(x) + ape, times wkv(x), summed, RMS-normed, rotated at the window's first position.
    `overlap` (CSA): projections of 2·X, entry w mixes window w−1's first halves with window w's second halves."""

    def __init__(self, config: DeepseekV4Config, rate: int, dim: int, overlap: bool, *, rngs: nnx.Rngs, dtype: Any,
                 param_dtype: Any):
        c, width = config, (2 if overlap else 1) * dim
        self.config, self.rate, self.dim, self.overlap = config, rate, dim, overlap
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.wkv = Linear(c.hidden_size, width, axes=("embed", "head_dim"), **kw)
        self.wgate = Linear(c.hidden_size, width, axes=("embed", "head_dim"), **kw)
        self.ape = param(jnp.zeros((rate, width), jnp.float32), (None, "head_dim"))  # transformers keeps it fp32
        self.norm = fp32_norm(dim, c.rms_norm_eps, "head_dim")
        self.hf_raw = ("ape",)
        self.keep_fp32 = True

    @property
    def raw_width(self) -> int:
        return 2 * (2 if self.overlap else 1) * self.dim

    @property
    def span(self) -> int:
        """Tokens one entry pools: 2m with the overlap (window w−1, then window w), else m."""
        return (2 if self.overlap else 1) * self.rate

    def project(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> per-token [kv | gate] [B, T, raw_width] (what the open windows keep)."""
        return jnp.concatenate([self.wkv(x), self.wgate(x)], axis=-1)

    def pool(self, raw: jax.Array, before: jax.Array | None, w: jax.Array) -> jax.Array:
        """The tokens of windows w [B, W]: raw [B, W, span, raw_width] (with the overlap, window w−1's m tokens then
        window w's; `before` [B, W, span] marks slots before 0, which weigh nothing) -> entries [B, W, X]."""
        m, X = self.rate, self.dim
        half = raw.shape[-1] // 2
        kv = raw[..., :half]
        gate = raw[..., half:].astype(jnp.float32) + jnp.tile(self.ape[...], (self.span // m, 1))
        if before is not None:
            kv = jnp.where(before[..., None], 0, kv)
            gate = jnp.where(before[..., None], -jnp.inf, gate)
        if self.overlap:  # [B, W, 2m, X]: window w−1's first halves, then window w's second halves
            kv = jnp.concatenate([kv[:, :, :m, :X], kv[:, :, m:, X:]], axis=2)
            gate = jnp.concatenate([gate[:, :, :m, :X], gate[:, :, m:, X:]], axis=2)
        weights = jax.nn.softmax(gate, axis=2).astype(kv.dtype)
        entries = self.norm(jnp.sum(kv * weights, axis=2))  # [B, W, X]
        cos, sin = self.config.rope_tables(w * m, compressed=True)  # rotated at the window's first slot
        return rope_tail(entries[:, :, None, :], cos, sin)[:, :, 0]

    def __call__(self, raw: jax.Array) -> jax.Array:
        """raw [B, S, raw_width] of key slots 0..S-1 -> entries [B, S // m, X], entry w closing at slot (w+1)·m − 1."""
        B, S, F = raw.shape
        m, W = self.rate, S // self.rate
        windows = raw[:, :W * m].reshape(B, W, m, F)
        w = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (B, W))
        if not self.overlap:
            return self.pool(windows, None, w)
        prev = jnp.pad(windows, ((0, 0), (1, 0), (0, 0), (0, 0)))[:, :W]  # window w−1's tokens (none before 0)
        before = jnp.broadcast_to((jnp.arange(2 * m) < m) & (jnp.arange(W) == 0)[:, None], (B, W, 2 * m))
        return self.pool(jnp.concatenate([prev, windows], axis=2), before, w)

    def step(self, raw: jax.Array, ring: jax.Array, start: jax.Array, entries: jax.Array, end: jax.Array
             ) -> tuple[jax.Array, jax.Array]:
        """One cached call: this call's raw [B, T, raw_width] at slots start..start+T−1 (start [B]), the ring
        [B, P, raw_width] of slot s at row s mod P (the slots before start that open windows need), entries
        [B, S // m, X] -> (entries with every window that closes in this call written at its row, the ring with
        this call's slots below end [B] (one past its last real token) written). Pools ⌈T / m⌉ windows of `span`
        slots each, gathered from the ring and this call: O(T + m) whatever the cache length."""
        B, T, F = raw.shape
        P, m, Wmax = ring.shape[1], self.rate, entries.shape[1]
        rows = jnp.arange(B)[:, None]
        # the slots start−P .. start+T−1: the ring's oldest first, then this call's
        src = jnp.concatenate([jnp.take_along_axis(ring, ((start[:, None] + jnp.arange(P)) % P)[..., None], axis=1),
                               raw.astype(ring.dtype)], axis=1)  # [B, P + T, F]
        w = start[:, None] // m + jnp.arange(-(-T // m), dtype=jnp.int32)  # [B, Wc]: the windows that may close
        slots = (w[..., None] + 1) * m - self.span + jnp.arange(self.span)  # [B, Wc, span]
        at = jnp.clip(slots - (start[:, None, None] - P), 0, P + T - 1)  # never clipped for a window that closes
        pooled = self.pool(jnp.take_along_axis(src, at.reshape(B, -1, 1), axis=1).reshape(*slots.shape, F),
                           slots < 0, w)  # [B, Wc, X]
        closed = (w + 1) * m <= start[:, None] + T
        entries = entries.at[rows, jnp.where(closed, w, Wmax)].set(pooled.astype(entries.dtype), mode="drop")
        new = start[:, None] + jnp.arange(T)  # [B, T]
        keep = (new < end[:, None]) & (new >= end[:, None] - P)  # the last P below end: no row written twice
        ring = ring.at[rows, jnp.where(keep, new % P, P)].set(raw.astype(ring.dtype), mode="drop")
        return entries, ring


class V4Indexer(nnx.Module):
    """CSA's lightning indexer (HF `...attn.indexer.{wq_b, weights_proj, compressor}`): its own overlapping
    compressor at index_head_dim, queries from the q latent rotated at the query positions, and V3.2's top-k
    selection (score Σ_h w_h · relu(q_h · k) · DI^-0.5 with w = weights_proj(x) · H^-0.5)."""

    scores = DSAIndexer.scores  # q, weights, keys -> the index scores [B, T, W]
    select = DSAIndexer.select  # [B, T, W] visible entries -> the index_topk best of each query

    def __init__(self, config: DeepseekV4Config, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        c = config
        self.n_heads, self.head_dim, self.index_topk = c.index_n_heads, c.index_head_dim, c.index_topk
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.wq_b = Linear(c.q_lora_rank, c.index_n_heads * c.index_head_dim, axes=("q_lora", "heads"), **kw)
        self.weights_proj = Linear(c.hidden_size, c.index_n_heads, axes=("embed", "heads"), **kw)
        self.compressor = Compressor(c, c.compress_rate_csa, c.index_head_dim, True, **kw)

    def __call__(self, x: jax.Array, q_latent: jax.Array, keys: jax.Array, visible: jax.Array,
                 rope: tuple[jax.Array, jax.Array]) -> jax.Array:
        """x [B, T, D], q_latent [B, T, Q], the compressor's entries [B, W, DI], visible entries [B, T, W]
        -> the kept ones [B, T, W]."""
        B, T, _ = x.shape
        q = rope_tail(self.wq_b(q_latent).reshape(B, T, self.n_heads, self.head_dim), *rope)  # [B, T, H, DI]
        weights = self.weights_proj(x).astype(jnp.float32) * self.n_heads**-0.5  # [B, T, H]
        return self.select(q, weights, keys.astype(q.dtype), visible)


# ------------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------------


class V4Attention(nnx.Module):
    """Shared-KV MQA with a sink per head over the sliding window plus the layer's compressed entries, and the
    grouped low-rank output projection (transformers `DeepseekV4Attention`; HF `layers.{i}.attn.*`)."""

    def __init__(self, config: DeepseekV4Config, layer: int, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        c = config
        D, N, Hd, Q, G, O = c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank, c.o_groups, c.o_lora_rank
        self.kind, self.rate = c.layer_types[layer], c.compress_rate(layer)
        self.num_heads, self.head_dim, self.groups, self.eps = N, Hd, G, c.rms_norm_eps
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.wq_a = Linear(D, Q, axes=("embed", "q_lora"), **kw)
        self.q_norm = fp32_norm(Q, c.rms_norm_eps, "q_lora")
        self.wq_b = Linear(Q, N * Hd, axes=("q_lora", "heads"), **kw)
        self.wkv = Linear(D, Hd, axes=("embed", "head_dim"), **kw)
        self.norm = fp32_norm(Hd, c.rms_norm_eps, "head_dim")
        self.wo_a = Linear(N * Hd // G, G * O, axes=("heads", "q_lora"), **kw)  # G blocks [N·Hd/G -> O]
        self.wo_b = Linear(G * O, D, axes=("q_lora", "embed"), **kw)
        self.attn_sink = param(jnp.zeros((N,), jnp.float32), ("heads",))
        self.hf_raw = ("attn_sink",)
        self.keep_fp32 = True  # the sink stays fp32 on disk, as transformers keeps it
        self.compressor = nnx.data(None if self.kind == SLIDING else
                                   Compressor(c, self.rate, Hd, self.kind == CSA, **kw))
        self.indexer = nnx.data(V4Indexer(c, **kw) if self.kind == CSA else None)

    def __call__(self, x: jax.Array, ctx: Context, cache: KVCache | None, layer: int, window: int | None = None
                 ) -> tuple[jax.Array, KVCache | None]:
        B, T, _ = x.shape
        N, Hd = self.num_heads, self.head_dim
        rope = ctx.rope["main" if self.kind == SLIDING else "compress"]  # cos, sin [B, T, R/2]
        q_latent = self.q_norm(self.wq_a(x))  # [B, T, Q]
        q = rope_tail(unweighted_rms(self.wq_b(q_latent).reshape(B, T, N, Hd), self.eps), *rope)  # [B, T, N, Hd]
        kv = rope_tail(self.norm(self.wkv(x))[:, :, None, :], *rope)  # [B, T, 1, Hd]
        mask = ctx.mask(window)  # [B, T, S]
        if cache is not None:  # the sliding keys over the cache's slots; this call's rows written first
            cache = cache.write(layer, ctx.slots, kv, kv[..., :0])  # K = V: no v
            keys = cache.k[layer][:, 0]  # [B, S, Hd]
        else:
            keys = kv[:, :, 0]  # [B, T, Hd]
        if self.compressor is not None:
            entries, index_keys, cache = self.compress(x, ctx, cache, layer)  # [B, W, Hd], [B, W, DI] or None
            W, m = entries.shape[1], self.rate
            # entry w is visible where its closing slot (w+1)·m − 1 is (causality and padding of the full mask)
            visible = ctx.mask(None)[:, :, m - 1:W * m:m]  # [B, T, W]
            if self.indexer is not None:
                visible = self.indexer(x, q_latent, index_keys, visible, rope)
            keys = jnp.concatenate([keys, entries.astype(keys.dtype)], axis=1)  # [B, S + W, Hd]
            mask = jnp.concatenate([mask, visible], axis=-1)
        k = keys[:, None]  # [B, 1, S(+W), Hd]: K = V
        out = attention(q, k, k, mask, sinks=self.attn_sink[...])  # [B, T, N, Hd]
        cos, sin = rope
        out = rope_tail(out, cos, -sin)  # undo the values' rotation at the query position
        grouped = out.reshape(B, T, self.groups, N * Hd // self.groups)  # [B, T, G, N·Hd/G]
        # the effective weight (dequantized, any LoRA folded in: no lora_dropout here, as peft's ParamWrapper on
        # transformers' o_a_proj.weight has none)
        w = self.wo_a.weight().astype(self.wo_a.dtype).reshape(N * Hd // self.groups, self.groups, -1)  # [in, G, O]
        low = jnp.einsum("btgi,igo->btgo", grouped.astype(self.wo_a.dtype), w)  # [B, T, G, O]
        return self.wo_b(low.reshape(B, T, -1)), cache

    def compress(self, x: jax.Array, ctx: Context, cache: KVCache | None, layer: int
                 ) -> tuple[jax.Array, jax.Array | None, KVCache | None]:
        """The compressed entries [B, W, Hd] and the indexer's [B, W, DI] (CSA; else None) this call attends to:
        without a cache every closed window of x; with one, the cache's entries [B, S // m, ·] after this call's
        closing windows are written (`Compressor.step`; the ring, entries and index rows in `cache.extra`)."""
        raw = self.compressor.project(x)  # [B, T, F]
        F = raw.shape[-1]
        if self.indexer is not None:
            raw = jnp.concatenate([raw, self.indexer.compressor.project(x)], axis=-1)
        if cache is None:
            index_keys = None if self.indexer is None else self.indexer.compressor(raw[..., F:])
            return self.compressor(raw[..., :F]), index_keys, None
        state, start = dict(cache.extra[str(layer)]), ctx.slots[:, 0]  # [B]
        T = x.shape[1]
        real = jnp.take_along_axis(cache.valid, ctx.slots, axis=1)  # [B, T]: this call's real tokens
        end = start + 1 + jnp.max(jnp.where(real, jnp.arange(T), -1), axis=1)  # [B]: past the last real one
        state["entries"], ring = self.compressor.step(raw[..., :F], state["ring"][..., :F], start, state["entries"],
                                                       end)
        if self.indexer is not None:
            state["index"], ring_i = self.indexer.compressor.step(raw[..., F:], state["ring"][..., F:], start,
                                                                  state["index"], end)
            ring = jnp.concatenate([ring, ring_i], axis=-1)
        state["ring"] = ring
        cache = dataclasses.replace(cache, extra={**cache.extra, str(layer): state})
        return state["entries"], state.get("index"), cache


# ------------------------------------------------------------------------------------------------
# MoE pieces, the decoder layer and the model
# ------------------------------------------------------------------------------------------------


class ClampedMLP(nnx.Module):
    """The shared expert: w2(silu(min(w1 x, limit)) · clip(w3 x, ±limit)) (HF `...ffn.shared_experts.w{1,2,3}`)."""

    def __init__(self, hidden_size: int, width: int, limit: float, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.limit = limit
        self.w1 = Linear(hidden_size, width, axes=("embed", "mlp"), **kw)
        self.w3 = Linear(hidden_size, width, axes=("embed", "mlp"), **kw)
        self.w2 = Linear(width, hidden_size, axes=("mlp", "embed"), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        gate = jnp.minimum(self.w1(x), self.limit)
        return self.w2(jax.nn.silu(gate) * jnp.clip(self.w3(x), -self.limit, self.limit))


class HashRouter(Router):
    """Experts from a fixed token-id table `tid2eid` [V, k] (a Buffer), weights from the router's scores of those
    experts, renormalised, × routed_scaling_factor (transformers `DeepseekV4HashRouter`)."""

    def __init__(self, config: DeepseekV4Config, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        c = config
        super().__init__(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, scoring=c.scoring_func,
                         norm_topk_prob=True, routed_scaling_factor=c.routed_scaling_factor, rngs=rngs, dtype=dtype,
                         param_dtype=param_dtype)
        self.e_score_correction_bias = nnx.data(None)
        self.tid2eid = param(jnp.zeros((c.vocab_size, c.num_experts_per_tok), jnp.int32), ("vocab", None), Buffer)
        self.hf_raw = ("weight", "tid2eid")
        self.hf_int64 = ("tid2eid",)  # int64 on disk, as transformers writes it

    def __call__(self, x: jax.Array, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [T, D], token ids [T] -> (weights [T, k], experts [T, k], logits [T, E])."""
        from models.moe import BIASED_SCORES

        logits = x.astype(jnp.float32) @ self.weight[...].astype(jnp.float32).T  # [T, E]
        scores = BIASED_SCORES[self.scoring](logits)
        idx = jnp.take(self.tid2eid[...], tokens, axis=0).astype(jnp.int32)  # [T, k]
        w = jnp.take_along_axis(scores, idx, axis=-1)
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
        return w * self.routed_scaling_factor, idx, logits


class V4Router(Router):
    """The sqrt-softplus top-k router; its e_score_correction_bias is `gate.bias` on disk (the reference's name)."""

    def __init__(self, config: DeepseekV4Config, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        c = config
        super().__init__(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, scoring=c.scoring_func,
                         norm_topk_prob=True, routed_scaling_factor=c.routed_scaling_factor, rngs=rngs, dtype=dtype,
                         param_dtype=param_dtype)
        self.bias = self.e_score_correction_bias  # the same variable under its HF name (not a logits bias)
        self.hf_raw = ("weight", "bias")


def v4_moe(config: DeepseekV4Config, layer: int, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any) -> MoE:
    """Router `gate` (hash or sqrt-softplus top-k), clamped SwiGLU experts stored as `experts.{e}.w1/w3/w2`, and
    the clamped shared expert."""
    c, kw = config, dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
    if c.mlp_layer_types[layer] == "hash_moe":
        router: Router = HashRouter(c, **kw)
    else:
        router = V4Router(c, **kw)
    experts = Experts(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, activation="silu_clamped",
                      limit=c.swiglu_limit, hf_names=("w1", "w3", "w2"), **kw)
    return MoE(router, experts, ClampedMLP(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit, **kw))


class V4Layer(nnx.Module):
    """mHC around attention and around the MoE (HF `layers.{i}.{attn, ffn, attn_norm, ffn_norm, hc_attn_*,
    hc_ffn_*}`): streams [B, T, n, D] in and out."""

    def __init__(self, config: DeepseekV4Config, layer: int, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        c = config
        n, D = c.hc_mult, c.hidden_size
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.config, self.window = config, c.layer_window(layer)
        self.hashed = c.mlp_layer_types[layer] == "hash_moe"  # its router reads the token ids
        self.attn_norm = fp32_norm(D, c.rms_norm_eps)
        self.attn = V4Attention(c, layer, **kw)
        self.ffn_norm = fp32_norm(D, c.rms_norm_eps)
        self.ffn = v4_moe(c, layer, **kw)
        init = nnx.initializers.normal(0.02)
        for part in ("attn", "ffn"):  # fp32 in memory and on disk, as transformers keeps them
            setattr(self, f"hc_{part}_fn", param(init(rngs.params(), ((2 + n) * n, n * D), jnp.float32), (None, None)))
            setattr(self, f"hc_{part}_base", param(jnp.zeros(((2 + n) * n,), jnp.float32), (None,)))
            setattr(self, f"hc_{part}_scale", param(jnp.ones((3,), jnp.float32), (None,)))
        self.hf_raw = tuple(f"hc_{p}_{w}" for p in ("attn", "ffn") for w in ("fn", "base", "scale"))
        self.keep_fp32 = True

    def mix(self, part: str, streams: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        c = self.config
        return hyper_weights(streams, getattr(self, f"hc_{part}_fn")[...], getattr(self, f"hc_{part}_base")[...],
                             getattr(self, f"hc_{part}_scale")[...], iters=c.hc_sinkhorn_iters, eps=c.hc_eps,
                             norm_eps=c.rms_norm_eps)

    def __call__(self, x: jax.Array, ctx: Context, cache: KVCache | None, layer: int):
        post, comb, h = self.mix("attn", x)
        h, cache = self.attn(self.attn_norm(h), ctx, cache, layer, self.window)
        x = post.astype(x.dtype)[..., None] * h[:, :, None, :] + jnp.einsum("btjk,btjd->btkd", comb.astype(x.dtype), x)
        post, comb, h = self.mix("ffn", x)
        h = self.ffn(self.ffn_norm(h), ctx.input_ids if self.hashed else None)
        x = post.astype(x.dtype)[..., None] * h[:, :, None, :] + jnp.einsum("btjk,btjd->btkd", comb.astype(x.dtype), x)
        return x, cache


class HyperHead(nnx.Module):
    """The final collapse of the streams (HF `model.hc_head.{hc_fn, hc_base, hc_scale}`): Σ_j pre_j · stream_j with
    pre = sigmoid(rms(flatten(streams)) · hc_fn · hc_scale + hc_base) + hc_eps."""

    def __init__(self, config: DeepseekV4Config, *, rngs: nnx.Rngs):
        n, D = config.hc_mult, config.hidden_size
        self.eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        self.hc_fn = param(nnx.initializers.normal(0.02)(rngs.params(), (n, n * D), jnp.float32), (None, None))
        self.hc_base = param(jnp.zeros((n,), jnp.float32), (None,))
        self.hc_scale = param(jnp.ones((1,), jnp.float32), (None,))
        self.hf_raw = ("hc_fn", "hc_base", "hc_scale")
        self.keep_fp32 = True

    def __call__(self, streams: jax.Array) -> jax.Array:
        B, T, n, D = streams.shape
        flat = unweighted_rms(streams.reshape(B, T, n * D).astype(jnp.float32), self.norm_eps)
        pre = jax.nn.sigmoid(flat @ self.hc_fn[...].T * self.hc_scale[...] + self.hc_base[...]) + self.eps  # [B, T, n]
        return jnp.sum(pre[..., None] * streams, axis=2).astype(streams.dtype)  # [B, T, D]


class DeepseekV4(DecoderLM):
    """embed -> n streams -> L × V4Layer -> hc_head -> RMSNorm -> `head` (tied to the embedding when configured)."""

    def __init__(self, config: DeepseekV4Config, *, rngs: nnx.Rngs, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32):
        super().__init__(config, lambda kw: [V4Layer(config, i, **kw) for i in range(config.num_hidden_layers)],
                         rngs=rngs, dtype=dtype, param_dtype=param_dtype, norm_weight_in_fp32=True)
        self.norm.keep_fp32 = True
        self.hc_head = HyperHead(config, rngs=rngs)

    # The LM head is the module `head` (transformers writes it as top-level `head.weight`); `lm_head` is the same
    # module under the name every family answers to (drafts, rotations, the quantizer's ignore), so V4 reads as
    # untied unless `tie_word_embeddings` (then both are None). A property, not a second attribute: the graph
    # (and so every HF name) holds the head once, as `head`.
    @property
    def lm_head(self) -> Linear | None:
        return self.head

    @lm_head.setter
    def lm_head(self, value: Linear | None) -> None:  # DecoderLM.__init__ builds the head as `lm_head`
        self.head = nnx.data(value)

    @staticmethod
    def hf_published_name(name: str) -> str:
        """The published files' (the reference's) name of a tensor -> transformers' save name, which the loader
        reads: `embed.weight`, `norm.weight`, `hc_head_fn` and `layers.{i}.…` gain the `model.` prefix transformers'
        conversion mapping gives them; `head.weight` and the MTP layer's `mtp.{k}.…` keep theirs."""
        if name in ("embed.weight", "norm.weight"):
            return "model.embed_tokens.weight" if name == "embed.weight" else "model.norm.weight"
        if name.startswith("hc_head_"):
            return "model.hc_head.hc_" + name.removeprefix("hc_head_")
        return "model." + name if name.startswith("layers.") else name

    # PEFT export (models/lora.py `lora_state_to_peft`): peft adapts transformers' modules, which are named as
    # transformers' conversion mapping renames the checkpoint's tensors at load (`conversion_mapping.py`
    # "deepseek_v4": attn -> self_attn, ffn -> mlp, wq_a -> q_a_proj, the indexer under the compressor, ...).
    # transformers' `o_a_proj` (DeepseekV4GroupedLinear) multiplies G blocks of its input by G blocks of its
    # weight, so peft's lora.Linear (a branch over the whole input, to the whole output) does not fit it: peft
    # adapts it through its weight (a ParamWrapper, W + B·A), as this model does (V4Attention reads `wo_a.weight()`).
    PEFT_RENAMES = (
        (r"\.attn\.indexer\.weights_proj$", ".self_attn.compressor.indexer.scorer.weights_proj"),
        (r"\.attn\.indexer\.(compressor\.)?", ".self_attn.compressor.indexer."),
        (r"\.attn\.", ".self_attn."),
        (r"\.ffn\.", ".mlp."),
        (r"\.wq_a$", ".q_a_proj"), (r"\.wq_b$", ".q_b_proj"), (r"\.wkv$", ".kv_proj"), (r"\.wgate$", ".gate_proj"),
        (r"\.wo_a$", ".o_a_proj"), (r"\.wo_b$", ".o_b_proj"),
        (r"\.shared_experts\.w1$", ".shared_experts.gate_proj"), (r"\.shared_experts\.w3$", ".shared_experts.up_proj"),
        (r"\.shared_experts\.w2$", ".shared_experts.down_proj"),
        (r"^head$", "lm_head"),
    )
    peft_weight_only = ("o_a_proj",)

    @classmethod
    def peft_module_name(cls, name: str) -> str:
        """An adapted module's HF path (`model.layers.1.attn.indexer.compressor.wkv`) -> transformers' module path
        (`model.layers.1.self_attn.compressor.indexer.kv_proj`)."""
        for pattern, repl in cls.PEFT_RENAMES:
            name = re.sub(pattern, repl, name)
        return name

    def hf_accepts(self, name: str) -> bool:
        """The published MTP layer (`mtp.{k}.…`), which transformers ignores and this model does not build."""
        return name.startswith("mtp.") or super().hf_accepts(name)

    def rope(self, positions: jax.Array) -> dict[str, tuple[jax.Array, jax.Array]]:
        c = self.config
        return {"main": c.rope_tables(positions, compressed=False),
                "compress": c.rope_tables(positions, compressed=True)}

    def streams_in(self, x: jax.Array) -> jax.Array:
        return jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], self.config.hc_mult, x.shape[-1]))

    def streams_out(self, x: jax.Array) -> jax.Array:
        return self.hc_head(x)

    def layer_feature(self, x: jax.Array) -> jax.Array:
        """A layer's streams [B, T, n, D] -> its feature [B, T, D] (`return_hidden`, the drafts' taps): the mean of
        the streams. mHC's comb is doubly stochastic (Sinkhorn), so Σ_k of the streams after a block is Σ_k before
        plus (Σ_k post_k)·h: the stream mean accumulates the blocks exactly as a single residual stream does, with
        no weight of its own. The `hc_head` collapse instead weighs the streams by pre-weights learned for the
        last layer only, on the last layer's statistics."""
        return jnp.mean(x, axis=2)


FAMILY = (DeepseekV4Config, DeepseekV4)  # registered by REGISTRY, at the top
