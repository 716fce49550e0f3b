"""The DFlash block drafter in Flax NNX: a few Qwen3-style layers that propose a whole block of tokens
in ONE forward, conditioned on the target's hidden-state features.

A block anchored at position a: slot 0 holds the real token t_a, slots 1..bs-1 the mask token, at
positions a..a+bs-1; slot j (j >= 1) predicts the token at a+j. The target features f_p of the
context (p < a, same sequence) are fused once, c_p = hidden_norm(fc(f_p)), and every layer reads the
SAME c: its attention's keys / values are [k_proj / v_proj(c_p) for p < a ; k_proj / v_proj of the
block's own hidden states] (k_norm on both, q_norm on the block's queries, RoPE at the context's and
the block's positions), and the block attends to all of its slots (bidirectional). Then
logits = lm_head(norm(h)). Context keys never change, so decoding caches them per layer (`context`,
`propose`); the block itself is recomputed by every proposal.

Mirrors vllm-project/speculators 0.9.0 `src/speculators/models/dflash/core.py` (`DFlashDraftModel.
_backbone_forward`), `model_definitions.py` (`Qwen3DFlashAttention`, `Qwen3DFlashDecoderLayer`) and
`attention.py` (`create_anchor_block_mask_mod`); DFlash: Chen et al., "DFlash: Block Diffusion for
Flash Speculative Decoding" (arXiv 2602.06036). Like there, the draft shares the target's embedding
(a frozen Buffer) and, by default, its LM head rows of the draft vocabulary (frozen; see
`DFlashConfig.train_lm_head`). Attribute names are the exported tensor names. See
docs/formats/dflash.md.

Shape legend: B batch, T length, S context / cache length, n blocks per row, bs block slots, D width,
N heads, K kv heads, G = N / K, H head dim, F ffn width / feature width, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.decoder import segment_positions
from models.dflash.config import DFlashConfig
from models.eagle3.model import TargetEmbedding, TargetWiring
from models.generate import KVCache
from models.layers import (
    MLP,
    NEG_INF,
    Buffer,
    Linear,
    RMSNorm,
    apply_rope,
    param,
    rope_cos_sin,
    rope_frequencies,
)


def block_attention(q: jax.Array, k_ctx: jax.Array, v_ctx: jax.Array, ctx_mask: jax.Array,
                    k_blk: jax.Array, v_blk: jax.Array) -> jax.Array:
    """One softmax over the allowed context keys and all of the query's own block.

    q [B, n, bs, N, H] (rotated, unscaled), k_ctx / v_ctx [B, K, S, H] (the context keys, cache
    layout), ctx_mask [B, n, S] (True = block i may read context slot s), k_blk / v_blk
    [B, n, bs, K, H] -> [B, n, bs, N, H]. Softmax in fp32 (scale H^-0.5, as speculators' eager path).
    """
    B, n, bs, N, H = q.shape
    K = k_ctx.shape[1]
    q = (q * jnp.asarray(H**-0.5, q.dtype)).reshape(B, n, bs, K, N // K, H)  # [B, n, bs, K, G, H]
    s_ctx = jnp.einsum("bnikgh,bksh->bnkgis", q, k_ctx).astype(jnp.float32)  # [B, n, K, G, bs, S]
    s_ctx = jnp.where(ctx_mask[:, :, None, None, None, :], s_ctx, NEG_INF)
    s_blk = jnp.einsum("bnikgh,bnjkh->bnkgij", q, k_blk).astype(jnp.float32)  # [B, n, K, G, bs, bs]
    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1)  # [B, n, K, G, bs, S + bs]
    S = k_ctx.shape[2]
    p_ctx, p_blk = probs[..., :S].astype(v_ctx.dtype), probs[..., S:].astype(v_blk.dtype)
    out = jnp.einsum("bnkgis,bksh->bnikgh", p_ctx, v_ctx) + jnp.einsum("bnkgij,bnjkh->bnikgh", p_blk, v_blk)
    return out.reshape(B, n, bs, N, H)


class DFlashAttention(nnx.Module):
    """Qwen3 GQA without biases: q_proj [D -> N·H], k/v_proj [D -> K·H], o_proj [N·H -> D],
    q_norm / k_norm RMSNorm(H) before NeoX RoPE."""

    def __init__(self, config: DFlashConfig, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        c = config
        D, N, K, H = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = N, K, H
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.q_proj = Linear(D, N * H, axes=("embed", "heads"), **kw)
        self.k_proj = Linear(D, K * H, axes=("embed", "kv_heads"), **kw)
        self.v_proj = Linear(D, K * H, axes=("embed", "kv_heads"), **kw)
        self.o_proj = Linear(N * H, D, axes=("heads", "embed"), **kw)
        self.q_norm = RMSNorm(H, eps=c.rms_norm_eps, param_dtype=param_dtype)
        self.k_norm = RMSNorm(H, eps=c.rms_norm_eps, param_dtype=param_dtype)

    def key_value(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [B, T, D] -> rotated k_norm(k) [B, T, K, H], v [B, T, K, H]."""
        B, T, _ = x.shape
        K, H = self.num_kv_heads, self.head_dim
        k = self.k_norm(self.k_proj(x).reshape(B, T, K, H))  # [B, T, K, H]
        v = self.v_proj(x).reshape(B, T, K, H)  # [B, T, K, H]
        return apply_rope(k, cos, sin), v

    def query(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """x [B, T, D] -> rotated q_norm(q) [B, T, N, H]."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, T, self.num_heads, self.head_dim))  # [B, T, N, H]
        return apply_rope(q, cos, sin)

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], k_ctx: jax.Array, v_ctx: jax.Array,
                 ctx_mask: jax.Array) -> jax.Array:
        """Blocks x [B, n, bs, D] at rope (cos, sin [B, n·bs, H]) over the context k_ctx / v_ctx
        [B, K, S, H] (ctx_mask [B, n, S]) -> [B, n, bs, D]."""
        B, n, bs, D = x.shape
        flat = x.reshape(B, n * bs, D)
        q = self.query(flat, *rope).reshape(B, n, bs, self.num_heads, self.head_dim)
        k, v = self.key_value(flat, *rope)
        k = k.reshape(B, n, bs, self.num_kv_heads, self.head_dim)
        v = v.reshape(B, n, bs, self.num_kv_heads, self.head_dim)
        out = block_attention(q, k_ctx, v_ctx, ctx_mask, k, v)  # [B, n, bs, N, H]
        return self.o_proj(out.reshape(B, n, bs, self.num_heads * self.head_dim))


class DFlashLayer(nnx.Module):
    """h = x + attn(input_layernorm(x), context), out = h + mlp(post_attention_layernorm(h))."""

    def __init__(self, config: DFlashConfig, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        c = config
        norm = dict(eps=c.rms_norm_eps, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(c.hidden_size, **norm)
        self.self_attn = DFlashAttention(c, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, **norm)
        self.mlp = MLP(c.hidden_size, c.intermediate_size, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], k_ctx: jax.Array, v_ctx: jax.Array,
                 ctx_mask: jax.Array) -> jax.Array:
        h = x + self.self_attn(self.input_layernorm(x), rope, k_ctx, v_ctx, ctx_mask)  # [B, n, bs, D]
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(TargetWiring, nnx.Module):
    """DFlash block drafter: `fc` (num_aux·D -> D), `hidden_norm`, `layers.{i}`, `norm` are the
    trainable `nnx.Param`s; `lm_head` (D -> Vd) too when `config.train_lm_head`, else its kernel is a
    Buffer holding the target's LM-head rows of the draft vocabulary (`load_lm_head`);
    `embed_tokens` (the target's), `d2t` [Vd] and `t2d` [V] are Buffers."""

    def __init__(self, config: DFlashConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32):
        c = config
        self.config = c
        self.dtype, self.param_dtype = dtype, param_dtype
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.embed_tokens = TargetEmbedding(c.vocab_size, c.hidden_size, **kw)
        self.fc = Linear(c.num_aux * c.target_hidden_size, c.hidden_size, axes=("mlp", "embed"), **kw)
        self.hidden_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)
        self.layers = nnx.List([DFlashLayer(c, **kw) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = Linear(c.hidden_size, c.draft_vocab_size, axes=("embed", "vocab"), **kw)
        if not c.train_lm_head:  # the target's head rows, frozen (speculators DraftVocabMixin)
            self.lm_head.kernel = param(self.lm_head.kernel.get_value(), ("embed", "vocab"), Buffer)
        # identity mapping onto the first Vd target ids until set_vocab (build_draft_vocab) is called
        Vd, V = c.draft_vocab_size, c.vocab_size
        self.d2t = param(jnp.zeros((Vd,), jnp.int32), (None,), Buffer)
        self.t2d = param(jnp.arange(V) < Vd, (None,), Buffer)

    # -- target-side wiring -------------------------------------------------------------------------

    @property
    def max_block(self) -> int:
        """The most tokens one forward proposes: block_size - 1."""
        return self.config.block_size - 1

    def load_lm_head(self, weight: jax.Array | np.ndarray) -> None:
        """Install the target's LM head [V, D] (HF layout; a tied target passes its embedding): the
        rows of the draft vocabulary become `lm_head` (call after `set_vocab`)."""
        shape = (self.config.vocab_size, self.config.hidden_size)
        if tuple(np.shape(weight)) != shape:
            raise ValueError(f"lm_head {tuple(np.shape(weight))}: the draft expects the target's {shape}")
        rows = jnp.take(jnp.asarray(weight), self.target_token_ids, axis=0)  # [Vd, D]
        self.lm_head.kernel.set_value(rows.T.astype(self.lm_head.kernel.get_value().dtype))  # [D, Vd]

    # -- pieces -------------------------------------------------------------------------------------

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = self.config
        inv_freq, scaling = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
        return rope_cos_sin(positions, inv_freq, self.dtype, scaling)  # [B, T, H] each

    def fuse(self, features: jax.Array) -> jax.Array:
        """Target features [B, T, num_aux·D] -> the context c = hidden_norm(fc(f)) [B, T, D]."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, features: jax.Array, positions: jax.Array) -> list[tuple[jax.Array, jax.Array]]:
        """Per layer, the context keys / values [B, T, K, H] of features [B, T, F] at positions [B, T]."""
        c = self.fuse(features)  # [B, T, D]: the same input for every layer
        cos, sin = self.rope(positions)
        return [layer.self_attn.key_value(c, cos, sin) for layer in self.layers]

    def blocks(self, block_ids: jax.Array, block_positions: jax.Array, kv_ctx: list[tuple[jax.Array, jax.Array]],
               ctx_mask: jax.Array) -> jax.Array:
        """Run blocks block_ids [B, n, bs] at block_positions [B, n, bs] over the per-layer context
        kv_ctx ([B, K, S, H] each) under ctx_mask [B, n, S] -> logits [B, n, bs, Vd]."""
        B, n, bs = block_ids.shape
        h = self.embed_tokens(block_ids.reshape(B, n * bs)).reshape(B, n, bs, -1)  # [B, n, bs, D]
        rope = self.rope(block_positions.reshape(B, n * bs))  # [B, n·bs, H] each
        for layer, (k_ctx, v_ctx) in zip(self.layers, kv_ctx, strict=True):
            h = layer(h, rope, k_ctx, v_ctx, ctx_mask)
        return self.lm_head(self.norm(h))  # [B, n, bs, Vd]

    def block_inputs(self, anchor_ids: jax.Array, anchor_positions: jax.Array, slots: int
                     ) -> tuple[jax.Array, jax.Array]:
        """Anchor tokens / positions [B, n] -> block ids [B, n, slots] ([t_a, mask, ...]) and positions
        [B, n, slots] (a, a+1, ...)."""
        B, n = anchor_ids.shape
        mask = jnp.full((B, n, slots - 1), self.config.mask_token_id, jnp.int32)
        ids = jnp.concatenate([anchor_ids.astype(jnp.int32)[..., None], mask], axis=-1)  # [B, n, slots]
        pos = anchor_positions.astype(jnp.int32)[..., None] + jnp.arange(slots, dtype=jnp.int32)  # [B, n, slots]
        return ids, pos

    # -- training forward (no cache) ---------------------------------------------------------------

    def __call__(self, input_ids: jax.Array, features: jax.Array, anchors: jax.Array, *,
                 positions: jax.Array | None = None, segment_ids: jax.Array | None = None) -> jax.Array:
        """Blocks at `anchors` of packed rows -> logits [B, n, bs, Vd] (bs = config.block_size).

        input_ids [B, T] (t_p at p), features [B, T, num_aux·D] (f_p: the target's aux hidden states
        after reading t_p), anchors [B, n] (indices into T). Block i: [t_a, mask...] at positions
        positions[a] + j; it reads the context p < a of a's segment (`segment_ids`, 0 = padding;
        default one segment; default positions per segment). Slot j predicts the token at a + j.
        """
        B, T = input_ids.shape
        seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids
        if positions is None:
            positions = segment_positions(seg)
        kv = [(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))  # [B, K, T, H]
              for k, v in self.context_kv(features, positions)]
        a_tok = jnp.take_along_axis(input_ids, anchors, axis=1)  # [B, n]
        a_pos = jnp.take_along_axis(positions, anchors, axis=1)  # [B, n]
        a_seg = jnp.take_along_axis(seg, anchors, axis=1)  # [B, n]
        p = jnp.arange(T, dtype=jnp.int32)[None, None, :]  # [1, 1, T]
        ctx_mask = (p < anchors[..., None]) & (seg[:, None, :] == a_seg[..., None]) & (a_seg[..., None] != 0)
        ids, pos = self.block_inputs(a_tok, a_pos, self.config.block_size)
        return self.blocks(ids, pos, kv, ctx_mask)  # [B, n, bs, Vd]

    # -- decoding (cached context) -----------------------------------------------------------------

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> KVCache:
        """An empty cache of the context keys / values, [L, B, K, max_len, H] (L draft layers)."""
        return KVCache.init(self.config, batch, max_len, self.dtype if dtype is None else dtype)

    def _write(self, cache: KVCache, features: jax.Array, positions: jax.Array, valid: jax.Array) -> KVCache:
        """Write the context K/V of features [B, T, F] at each row's cache.length (+ T), valid [B, T]."""
        T = features.shape[1]
        slots = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
        cache = cache.advance(slots, valid)
        for i, (k, v) in enumerate(self.context_kv(features, positions)):
            cache = cache.write(i, slots, k, v)
        return cache

    def context(self, input_ids: jax.Array, features: jax.Array, *, positions: jax.Array | None = None,
                segment_ids: jax.Array | None = None, cache: KVCache) -> KVCache:
        """Cache the context K/V of features [B, T, F] (f_p at positions [B, T]; default the slots) at
        each row's cache.length; `segment_ids != 0` marks valid entries (None = all). input_ids is
        unused (DFlash reads no token of the context). The length moves by T, as DecoderLM's."""
        B, T = features.shape[:2]
        if positions is None:
            positions = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        valid = jnp.ones((B, T), bool) if segment_ids is None else segment_ids != 0
        return self._write(cache, features, positions, valid)

    def propose(self, input_ids: jax.Array, features: jax.Array, num_valid: jax.Array, *, cache: KVCache,
                k: int) -> tuple[jax.Array, KVCache]:
        """Cache the pending entries and draft k tokens per row in one block forward.

        input_ids [B, W] (entry j: token t_{p+1}), features [B, W, F] (entry j: f_p), at positions
        p = cache.length + j; entries j < num_valid [B] are real. Their context K/V are written (the
        returned cache's length is old length + num_valid). The block of each row: the anchor
        x = input_ids[b, num_valid - 1] at P = old length + num_valid, then k mask tokens at P+1..P+k,
        over the context slots < P. Returns logits [B, k, Vd] (logits[:, i]: the token at P+1+i).
        """
        if not 1 <= k <= self.max_block:
            raise ValueError(f"k={k} must be in [1, {self.max_block}] (block_size - 1)")
        B, W = input_ids.shape
        num_valid = jnp.asarray(num_valid, jnp.int32)
        old = cache.length
        slots = old[:, None] + jnp.arange(W, dtype=jnp.int32)[None, :]  # [B, W]: positions too
        cache = self._write(cache, features, slots, slots - old[:, None] < num_valid[:, None])
        P = old + num_valid  # [B]
        cache = cache.rollback(P)
        anchor = jnp.take_along_axis(input_ids, jnp.maximum(num_valid - 1, 0)[:, None], axis=1)  # [B, 1]
        ids, pos = self.block_inputs(anchor, P[:, None], k + 1)  # [B, 1, k + 1]
        s = jnp.arange(cache.max_len, dtype=jnp.int32)[None, :]  # [1, S]
        ctx_mask = (cache.valid & (s < P[:, None]))[:, None, :]  # [B, 1, S]
        kv = [(cache.k[i], cache.v[i]) for i in range(self.config.num_hidden_layers)]  # [B, K, S, H]
        logits = self.blocks(ids, pos, kv, ctx_mask)  # [B, 1, k + 1, Vd]
        return logits[:, 0, 1:], cache
