"""The EAGLE-3 draft head in Flax NNX: one Llama decoder layer on fused target features, reading the
target's (frozen) embedding and predicting over a pruned draft vocabulary.

One draft step at position p: f = fc(features_p) (or the draft's own previous `hidden`),
a = [input_layernorm(embed(token)); hidden_norm(f)] (embedding first, 2D wide), h = f + attn(a),
out = h + mlp(post_attention_layernorm(h)), logits = lm_head(norm(out)); `out` is what the next
step feeds back.

Mirrors EAGLE-3 (Li et al. 2025, arXiv:2503.01840) as vllm-project/speculators 0.9.0 implements it
(`models/eagle3/core.py`, `model_definitions.py`: `Eagle3FirstLayerMixin` splits `[embeds, hidden]`,
normalises each, keeps the *un-normalised* hidden as the residual) and SGLang's `LlamaForCausalLMEagle3`.
Attribute names are the exported tensor names. See docs/speculative-decoding.md (architecture).

Shape legend: B batch, T length, S cache length, D draft width, D_t target width, N heads, K kv heads,
H head dim, F ffn width, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.decoder import Context, build_context
from models.eagle3.config import Eagle3Config
from models.eagle3.vocab import check_vocab
from models.generate import KVCache
from models.layers import (
    INIT_STD,
    MLP,
    Buffer,
    Linear,
    RMSNorm,
    apply_rope,
    attention,
    param,
    rope_cos_sin,
    rope_frequencies,
)


class TargetEmbedding(nnx.Module):
    """The target's token embedding [V, D], held as a `Buffer` (never an `nnx.Param`): frozen in
    training, not exported (engines reuse the target's)."""

    def __init__(self, num: int, features: int, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        self.dtype = dtype
        init = nnx.initializers.normal(INIT_STD)
        self.weight = param(init(rngs.params(), (num, features), param_dtype), ("vocab", "embed"), Buffer)

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0).astype(self.dtype)  # [B, T, D]


class Eagle3Attention(nnx.Module):
    """Llama GQA whose q/k/v read the 2D-wide [embedding; hidden] input: q_proj [2D -> N·H],
    k/v_proj [2D -> K·H], o_proj [N·H -> D], no biases, NeoX RoPE."""

    def __init__(self, config: Eagle3Config, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        c = config
        D, N, K, H = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = N, K, H
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.q_proj = Linear(2 * D, N * H, axes=("embed", "heads"), **kw)
        self.k_proj = Linear(2 * D, K * H, axes=("embed", "kv_heads"), **kw)
        self.v_proj = Linear(2 * D, K * H, axes=("embed", "kv_heads"), **kw)
        self.o_proj = Linear(N * H, D, axes=("heads", "embed"), **kw)

    def project(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, 2D] -> rotated q [B, T, N, H], rotated k [B, T, K, H], v [B, T, K, H]."""
        B, T, _ = x.shape
        N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).reshape(B, T, N, H)  # [B, T, N, H]
        k = self.k_proj(x).reshape(B, T, K, H)  # [B, T, K, H]
        v = self.v_proj(x).reshape(B, T, K, H)  # [B, T, K, H]
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def __call__(self, x: jax.Array, ctx: Context, cache: KVCache | None) -> tuple[jax.Array, KVCache | None]:
        B, T, _ = x.shape
        q, k, v = self.project(x, *ctx.rope)
        if cache is not None:  # write this call's keys at each row's slots, attend over the whole cache
            cache = cache.write(0, ctx.slots, k, v)
            k, v = cache.k[0], cache.v[0]  # [B, K, S, H]
        else:
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, H]
        out = attention(q, k, v, ctx.mask(), causal=ctx.causal)  # [B, T, N, H]
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim)), cache


class Eagle3Layer(nnx.Module):
    """The `midlayer`: h = f + attn([input_layernorm(emb); hidden_norm(f)]), out = h + mlp(norm(h)).
    The residual is the un-normalised f (speculators `norm_before_residual=False`, SGLang)."""

    def __init__(self, config: Eagle3Config, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        c = config
        norm = dict(eps=c.rms_norm_eps, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(c.hidden_size, **norm)
        self.hidden_norm = RMSNorm(c.hidden_size, **norm)
        self.self_attn = Eagle3Attention(c, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, **norm)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def attn_input(self, emb: jax.Array, f: jax.Array) -> jax.Array:
        """[input_layernorm(emb); hidden_norm(f)]: [B, T, 2D], embedding first."""
        return jnp.concatenate([self.input_layernorm(emb), self.hidden_norm(f).astype(emb.dtype)], axis=-1)

    def finish(self, f: jax.Array, attn_out: jax.Array) -> jax.Array:
        """Residual + MLP after the attention: [B, T, D]."""
        h = f.astype(attn_out.dtype) + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))

    def __call__(self, emb: jax.Array, f: jax.Array, ctx: Context, cache: KVCache | None):
        attn_out, cache = self.self_attn(self.attn_input(emb, f), ctx, cache)
        return self.finish(f, attn_out), cache


class TargetWiring:
    """What a feature-level draft (EAGLE-3, P-EAGLE, DFlash) shares about its target: the feature layers it
    reads, its draft -> target vocabulary map (`d2t` / `t2d` Buffers) and the target's frozen embedding
    (`embed_tokens`). Mixed into the nnx.Module of each draft."""

    @property
    def target_layers(self) -> tuple[int, ...]:
        """The target `return_hidden` indices whose concatenation is `features` (low -> high)."""
        return self.config.aux_layer_ids

    @property
    def target_token_ids(self) -> jax.Array:
        """Draft id -> target id: arange(Vd) + d2t, [Vd] int32 (ascending)."""
        return jnp.arange(self.config.draft_vocab_size, dtype=jnp.int32) + self.d2t[...].astype(jnp.int32)

    def load_embedding(self, weight: jax.Array | np.ndarray) -> None:
        """Install the target's embedding table [V, D] (kept frozen)."""
        shape = (self.config.vocab_size, self.config.hidden_size)
        if tuple(np.shape(weight)) != shape:
            raise ValueError(f"embed_tokens {tuple(np.shape(weight))}: the draft expects {shape}")
        self.embed_tokens.weight.set_value(jnp.asarray(weight, self.embed_tokens.weight.get_value().dtype))

    def set_vocab(self, d2t: jax.Array | np.ndarray, t2d: jax.Array | np.ndarray) -> None:
        """Install a draft vocabulary (build_draft_vocab): d2t [Vd] offsets, t2d [V] bool."""
        d2t, t2d = check_vocab(d2t, t2d, self.config.draft_vocab_size, self.config.vocab_size)
        self.d2t.set_value(jnp.asarray(d2t, jnp.int32))
        self.t2d.set_value(jnp.asarray(t2d))


class Eagle3Draft(TargetWiring, nnx.Module):
    """EAGLE-3 draft head: `fc` (num_aux·D_t -> D), `midlayer`, `norm`, `lm_head` (D -> Vd) are the
    trainable `nnx.Param`s; `embed_tokens` (the target's), `d2t` [Vd] and `t2d` [V] are Buffers.
    Attribute names are the exported tensor names (`midlayer.self_attn.q_proj.weight`, ...)."""

    def __init__(self, config: Eagle3Config, *, rngs: nnx.Rngs, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32):
        c = config
        self.config = c
        self.dtype, self.param_dtype = dtype, param_dtype
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.embed_tokens = TargetEmbedding(c.vocab_size, c.hidden_size, **kw)
        self.fc = Linear(c.num_aux * c.target_hidden_size, c.hidden_size, axes=("mlp", "embed"), **kw)
        self.midlayer = Eagle3Layer(c, **kw)
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = Linear(c.hidden_size, c.draft_vocab_size, axes=("embed", "vocab"), **kw)
        # identity mapping onto the first Vd target ids until set_vocab (build_draft_vocab) is called
        Vd, V = c.draft_vocab_size, c.vocab_size
        self.d2t = param(jnp.zeros((Vd,), jnp.int32), (None,), Buffer)
        self.t2d = param(jnp.arange(V) < Vd, (None,), Buffer)

    # -- forward ------------------------------------------------------------------------------------

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = self.config
        inv_freq, scaling = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
        return rope_cos_sin(positions, inv_freq, self.dtype, scaling)  # [B, T, H] each

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> KVCache:
        """An empty 1-layer KV cache [1, B, K, max_len, H]."""
        return KVCache.init(self.config, batch, max_len, self.dtype if dtype is None else dtype)

    def fuse(self, features: jax.Array) -> jax.Array:
        """Target features [B, T, num_aux·D_t] -> f [B, T, D]."""
        return self.fc(features)

    def __call__(
        self,
        input_ids: jax.Array,
        *,
        features: jax.Array | None = None,
        hidden: jax.Array | None = None,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        cache: KVCache | None = None,
    ) -> tuple[jax.Array, jax.Array, KVCache | None]:
        """input_ids [B, T] plus exactly one of features [B, T, num_aux·D_t] (target aux hidden states)
        or hidden [B, T, D] (the draft's own previous `hidden_out`) -> (logits [B, T, Vd],
        hidden_out [B, T, D] before the final norm, cache).

        Masks, positions and the cache behave as in DecoderLM: without a cache `segment_ids` packs
        sequences; with one, tokens are written at each row's `cache.length` and `segment_ids != 0`
        marks valid slots; default positions are the slots (with a cache) or per-segment offsets.
        """
        if (features is None) == (hidden is None):
            raise ValueError("pass exactly one of features= (target aux hidden states) or hidden= (draft output)")
        B, T = input_ids.shape
        ctx, cache = build_context(T, B, positions=positions, segment_ids=segment_ids, cache=cache, windows=set())
        ctx.rope = self.rope(ctx.positions)
        f = self.fuse(features) if features is not None else hidden.astype(self.dtype)  # [B, T, D]
        out, cache = self.midlayer(self.embed_tokens(input_ids), f, ctx, cache)  # [B, T, D]
        logits = self.lm_head(self.norm(out))  # [B, T, Vd]
        return logits, out, cache
