"""The decoder skeleton every family shares: masks, positions and the KV cache for one call, the
grouped-query attention block (Llama, Qwen3, Qwen3-MoE, GLM-4.5, GPT-OSS), the pre-norm decoder
layer and the causal-LM forward (the SwiGLU MLP is in models/layers.py, where models/moe.py uses it too).

Mirrors docs/models/decoder.md (pre-norm skeleton, GQA, masks, sliding window = W keys including the
current token, tied heads, QK-norm before RoPE), docs/models/gpt-oss.md (sinks) and
docs/models/glm4-moe.md (q/k/v bias without an o bias, partial rotary).

A family file (models/llama.py, models/qwen3_moe.py, models/gpt_oss.py, ...) builds its layers
from these pieces and subclasses `DecoderLM`, providing `rope(positions)` (the rotary tables its
attention blocks read from `ctx.rope`) and, through its config, `layer_window(i)` (None for full
attention, W for a sliding-window layer).

Shape legend: B batch, T query length, S key length (cache length when decoding), D model width,
N query heads, K kv heads, H head dim, F ffn width, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from models.generate import KVCache
from models.layers import Embed, Linear, RMSNorm, apply_rope, attention, param
from models.numerics import quantize_kv_fp8

# Activation checkpointing per decoder layer (`DecoderLM.remat`, set by the trainer):
#   "none": keep every activation; "full": keep only each layer's input and recompute the rest;
#   "dots": also keep the matmul outputs (recompute only the cheap elementwise work).
REMAT_POLICIES: dict[str, tuple[Callable | None] | None] = {
    "none": None,
    "full": (None,),
    "dots": (jax.checkpoint_policies.dots_with_no_batch_dims_saveable,),
}


def set_compute_dtype(model: nnx.Module, dtype: Any) -> nnx.Module:
    """Run every layer's matmuls in `dtype` (e.g. bf16) while the parameters keep their own dtype
    (fp32 master weights); norms, softmax and the loss upcast to fp32 themselves, and MoE routers stay
    in fp32 so that expert selection does not flip on bf16 rounding."""
    from models.moe import Router

    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and hasattr(node, "dtype") and not isinstance(node, RMSNorm | Router):
            node.dtype = dtype
    return model

# ------------------------------------------------------------------------------------------------
# Per-call context: positions, masks (full and per sliding window), cache slots, rotary tables
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Context:
    positions: jax.Array  # [B, T] rotary positions
    slots: jax.Array | None  # [B, T] cache slots of this call's tokens (None without a cache)
    causal: bool  # True without a cache: the keys are this call's own queries
    masks: dict[int | None, jax.Array]  # window (None = full attention) -> [B, T, S] bool
    rope: Any = None  # family-specific rotary tables, e.g. (cos, sin)
    carry: dict[str, jax.Array] = dataclasses.field(default_factory=dict)  # passed from layer to later layers
    input_ids: jax.Array | None = None  # [B, T] this call's tokens (DeepSeek-V4's hash routers read them)

    def mask(self, window: int | None = None) -> jax.Array:
        return self.masks[window]


def segment_positions(segment_ids: jax.Array) -> jax.Array:
    """Position of each token inside its segment: [1,1,1,2,2,0] -> [0,1,2,0,1,0]. [B, T] -> [B, T]."""
    T = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), segment_ids.shape)
    prev = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    start = jax.lax.cummax(jnp.where(segment_ids != prev, idx, 0), axis=1)
    return idx - start


def build_context(
    T: int, B: int, *, positions: jax.Array | None, segment_ids: jax.Array | None, cache: KVCache | None,
    windows: set[int | None], tree_mask: jax.Array | None = None,
) -> tuple[Context, KVCache | None]:
    """Masks and positions for one forward call (see DecoderLM.__call__ for the semantics).

    A sliding window W keeps key j for query i iff i - j < W (W keys including the current one),
    counted in token slots: within a packed segment, or in cache slots when decoding.

    `tree_mask` [B, T, T] (True = query i may attend to this call's token j) replaces causality among
    this call's tokens (tree verification in models/speculative.py). With a cache every query also
    sees the whole cached prefix. Window distances are then measured in positions: this call's
    tokens sit at `positions`, and prefix slot s at position s + positions[:, 0] - cache.length (the
    prefix ends right before the call's first token, the tree's root), so a sliding-window layer sees
    exactly the keys it would see decoding the tree path token by token.
    """
    valid = jnp.ones((B, T), bool) if segment_ids is None else segment_ids != 0
    if tree_mask is not None and tree_mask.shape != (B, T, T):
        raise ValueError(f"tree_mask must be [B, T, T] = {(B, T, T)}, got {tree_mask.shape}")
    if cache is None:
        seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else segment_ids
        if positions is None:
            positions = segment_positions(seg)
        same = (seg[:, :, None] == seg[:, None, :]) & valid[:, :, None]  # [B, T, T]
        if tree_mask is None:
            q_idx = jnp.arange(T, dtype=jnp.int32)[None, :, None]  # [1, T, 1]
            k_idx = jnp.arange(T, dtype=jnp.int32)[None, None, :]  # [1, 1, T]
            base = (k_idx <= q_idx) & same  # [B, T, T]
        else:
            q_idx, k_idx = positions[:, :, None], positions[:, None, :]  # window in positions
            base = tree_mask & same
        slots = None
    else:
        slots = cache.length[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]  # [B, T]
        if positions is None:
            positions = slots
        start = cache.length  # [B] first slot of this call
        cache = cache.advance(slots, valid)
        k_idx = jnp.arange(cache.max_len, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
        if tree_mask is None:
            q_idx = slots[:, :, None]  # [B, T, 1]
            base = cache.valid[:, None, :] & (k_idx <= q_idx)  # [B, T, S]
        else:
            j = k_idx - start[:, None, None]  # [B, 1, S]: index of slot s inside this call
            in_call = (j >= 0) & (j < T)
            jc = jnp.clip(j, 0, T - 1)
            among = jnp.take_along_axis(tree_mask, jnp.broadcast_to(jc, (B, T, cache.max_len)), axis=2)  # [B, T, S]
            base = cache.valid[:, None, :] & jnp.where(in_call, among, j < 0)  # [B, T, S]
            # window distances in slot units: this call's tokens at start + (positions - positions[:, 0])
            rel = start[:, None] + positions - positions[:, :1]  # [B, T]
            q_idx = rel[:, :, None]  # [B, T, 1]
            k_idx = jnp.where(in_call, jnp.take_along_axis(rel, jc[:, 0], axis=1)[:, None, :], k_idx)  # [B, 1, S]
    masks = {w: base if w is None else base & (q_idx - k_idx < w) for w in windows | {None}}
    causal = cache is None and tree_mask is None
    return Context(positions=positions, slots=slots, causal=causal, masks=masks), cache


# ------------------------------------------------------------------------------------------------
# Attention (GQA with the optional pieces of every non-MLA family)
# ------------------------------------------------------------------------------------------------


class GQAttention(nnx.Module):
    """q/k/v/o projections, optional q/k/v bias and o bias, per-head QK-norm before RoPE, learned
    sinks, (partial) NeoX RoPE from `ctx.rope = (cos, sin)`, GQA attention over `ctx.mask(window)`. With an FP8
    KV cache (`k_scale` / `v_scale`, models/quant/kv_cache.py) the keys (after QK-norm and RoPE) and values are
    quantized-dequantized with their static scales before the cache write and attention, as an engine's FP8
    cache stores them, so full-sequence and cached calls see the same K and V."""

    def __init__(
        self, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rms_norm_eps: float,
        qkv_bias: bool = False, o_bias: bool = False, qk_norm: bool = False, sinks: bool = False,
        rngs: nnx.Rngs, dtype: Any, param_dtype: Any,
    ):
        D, N, K, H = hidden_size, num_heads, num_kv_heads, head_dim
        if N % K:
            raise ValueError(f"num_attention_heads {N} is not a multiple of num_key_value_heads {K}")
        self.num_heads, self.num_kv_heads, self.head_dim = N, K, H
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.q_proj = Linear(D, N * H, axes=("embed", "heads"), use_bias=qkv_bias, **kw)
        self.k_proj = Linear(D, K * H, axes=("embed", "kv_heads"), use_bias=qkv_bias, **kw)
        self.v_proj = Linear(D, K * H, axes=("embed", "kv_heads"), use_bias=qkv_bias, **kw)
        self.o_proj = Linear(N * H, D, axes=("heads", "embed"), use_bias=o_bias, **kw)
        if qk_norm:
            self.q_norm = RMSNorm(H, eps=rms_norm_eps, axis_name="head_dim", param_dtype=param_dtype)
            self.k_norm = RMSNorm(H, eps=rms_norm_eps, axis_name="head_dim", param_dtype=param_dtype)
        else:
            self.q_norm = self.k_norm = nnx.data(None)
        # raw parameters stored under their own HF name (models/hf.py reads `hf_raw`)
        self.sinks = nnx.data(param(jnp.zeros((N,), param_dtype), ("heads",)) if sinks else None)
        self.hf_raw = ("sinks",) if sinks else ()
        # FP8 KV cache (models/quant/kv_cache.py): static scales QuantScale [1] or [K, 1, 1]; None = model dtype
        self.k_scale = nnx.data(None)
        self.v_scale = nnx.data(None)
        self.kv_calibrating = False  # sow the K / V this call caches (models/quant/kv_cache.py)

    def __call__(
        self, x: jax.Array, ctx: Context, cache: KVCache | None, layer: int, window: int | None = None
    ) -> tuple[jax.Array, KVCache | None]:
        B, T, _ = x.shape
        N, K, H = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).reshape(B, T, N, H)  # [B, T, N, H]
        k = self.k_proj(x).reshape(B, T, K, H)  # [B, T, K, H]
        v = self.v_proj(x).reshape(B, T, K, H)  # [B, T, K, H]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = ctx.rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.kv_calibrating:
            self.sow(nnx.Intermediate, "calib_k", k)  # [B, T, K, H]: the keys the cache stores
            self.sow(nnx.Intermediate, "calib_v", v)
        if self.k_scale is not None:  # FP8 KV cache: every path attends to what the engine's cache holds
            k, v = quantize_kv_fp8(k, self.k_scale[...]), quantize_kv_fp8(v, self.v_scale[...])
        if cache is not None:  # write this call's keys at each row's slots, attend over the whole cache
            cache = cache.write(layer, ctx.slots, k, v)
            k, v = cache.k[layer], cache.v[layer]  # [B, K, S, H]
        else:
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, H]
        sinks = None if self.sinks is None else self.sinks[...]
        out = attention(q, k, v, ctx.mask(window), causal=ctx.causal, sinks=sinks)  # [B, T, N, H]
        return self.o_proj(out.reshape(B, T, N * H)), cache


class DecoderLayer(nnx.Module):
    """x + attn(norm(x)), then + mlp(norm(x)). `window` is None (full attention) or the sliding width."""

    def __init__(self, self_attn: nnx.Module, mlp: nnx.Module, *, hidden_size: int, rms_norm_eps: float,
                 param_dtype: Any, window: int | None = None, norm_weight_in_fp32: bool = False):
        norm = dict(eps=rms_norm_eps, param_dtype=param_dtype, weight_in_fp32=norm_weight_in_fp32)
        self.input_layernorm = RMSNorm(hidden_size, **norm)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, **norm)
        self.mlp = mlp
        self.window = window

    def __call__(self, x: jax.Array, ctx: Context, cache: KVCache | None, layer: int):
        h, cache = self.self_attn(self.input_layernorm(x), ctx, cache, layer, self.window)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, cache


class SharedHead(nnx.Module):
    """The MTP layer's `shared_head`: its own final norm; the LM head itself is the main model's."""

    def __init__(self, hidden_size: int, *, rms_norm_eps: float, param_dtype: Any):
        self.norm = RMSNorm(hidden_size, eps=rms_norm_eps, param_dtype=param_dtype)


class MTPLayer(DecoderLayer):
    """A DeepSeek-V3 / GLM-4.5 multi-token-prediction layer (docs/models/deepseek-v3.md, MTP), stored
    after the main stack at `model.layers.{L + m}`: a full decoder block plus `enorm`, `hnorm`,
    `eh_proj` [2D -> D] and `shared_head.norm`.

    For position i: u = eh_proj([enorm(embed(t_{i+1})), hnorm(h_i)]) (embedding first), then the
    block, then shared_head.norm and the main LM head -> logits for t_{i+2}. `h_i` is the main
    model's final-normed hidden state, as transformers 5.24's MTP drafting (`MTPCandidateGenerator`
    feeding `MtpModel` with `hidden_states[-1]`) does; the tests check this against `MtpModel`.
    """

    def __init__(self, self_attn: nnx.Module, mlp: nnx.Module, *, hidden_size: int, rms_norm_eps: float,
                 rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        super().__init__(self_attn, mlp, hidden_size=hidden_size, rms_norm_eps=rms_norm_eps,
                         param_dtype=param_dtype)
        norm = dict(eps=rms_norm_eps, param_dtype=param_dtype)
        self.enorm = RMSNorm(hidden_size, **norm)
        self.hnorm = RMSNorm(hidden_size, **norm)
        self.eh_proj = Linear(2 * hidden_size, hidden_size, axes=("mlp", "embed"), rngs=rngs, dtype=dtype,
                              param_dtype=param_dtype)
        self.shared_head = SharedHead(hidden_size, rms_norm_eps=rms_norm_eps, param_dtype=param_dtype)

    def predict(self, emb_next: jax.Array, hidden: jax.Array, ctx: Context, layer: int) -> jax.Array:
        """emb_next, hidden [B, T, D] -> normed MTP hidden [B, T, D] (feed to the LM head)."""
        u = self.eh_proj(jnp.concatenate([self.enorm(emb_next), self.hnorm(hidden)], axis=-1))  # [B, T, D]
        u, _ = self(u, ctx, None, layer)
        return self.shared_head.norm(u)


# ------------------------------------------------------------------------------------------------
# The causal LM forward shared by every family
# ------------------------------------------------------------------------------------------------


class DecoderLM(nnx.Module):
    """embed -> L × layer -> RMSNorm -> LM head (tied when `lm_head` is None).

    Subclasses pass their config (`num_hidden_layers`, `vocab_size`, `hidden_size`, `rms_norm_eps`,
    `tie_word_embeddings`) and a layer builder to `__init__` — the first `num_hidden_layers` layers
    are the main stack; DeepSeek/GLM keep their MTP layers after them — and implement `rope(positions)`.
    """

    config: Any
    embed_tokens: Embed
    layers: nnx.List
    norm: RMSNorm
    lm_head: Linear | None

    def __init__(self, config: Any, build_layers: Callable[[dict[str, Any]], list[nnx.Module]], *,
                 rngs: nnx.Rngs, dtype: Any, param_dtype: Any, norm_weight_in_fp32: bool = False):
        """Embedding, `build_layers(kw)` (kw = rngs/dtype/param_dtype for the layers' modules), final norm
        (fp32 weight multiplied in fp32 with `norm_weight_in_fp32`, GPT-OSS) and the LM head (none when
        `config.tie_word_embeddings`)."""
        self.config = config
        self.dtype, self.param_dtype = dtype, param_dtype
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.embed_tokens = Embed(config.vocab_size, config.hidden_size, **kw)
        self.layers = nnx.List(build_layers(kw))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, weight_in_fp32=norm_weight_in_fp32,
                            param_dtype=jnp.float32 if norm_weight_in_fp32 else param_dtype)
        if config.tie_word_embeddings:
            self.lm_head = nnx.data(None)
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, axes=("embed", "vocab"), **kw)
        self.activation_sharding: Any = None  # set_activation_sharding: the residual stream's [B, T, D] layout

    def constrain(self, x: jax.Array) -> jax.Array:
        """x [B, ...] laid out as `activation_sharding` (rows over the batch axes) when one is set and the
        rows divide evenly (a batch-1 decode is left to XLA)."""
        sharding = self.activation_sharding
        if sharding is None:
            return x
        rows = sharding.spec[0] if len(sharding.spec) else None
        axes = rows if isinstance(rows, tuple) else (rows,) if rows else ()
        if x.shape[0] % math.prod(sharding.mesh.shape[a] for a in axes):
            return x
        free = jax.sharding.PartitionSpec.UNCONSTRAINED  # the other dims: XLA's choice (e.g. vocab over tensor)
        spec = jax.sharding.PartitionSpec(rows, *([free] * (x.ndim - 1)))
        return jax.lax.with_sharding_constraint(x, type(sharding)(sharding.mesh, spec))

    def rope(self, positions: jax.Array) -> Any:  # pragma: no cover - every family overrides it
        raise NotImplementedError

    def layer_window(self, i: int) -> int | None:
        fn = getattr(self.config, "layer_window", None)
        return fn(i) if fn is not None else None

    def streams_in(self, x: jax.Array) -> jax.Array:
        """The embeddings [B, T, D] -> the residual the layers carry (DeepSeek-V4: several streams)."""
        return x

    def streams_out(self, x: jax.Array) -> jax.Array:
        """The last layer's residual -> [B, T, D] for the final norm (DeepSeek-V4 mixes its streams)."""
        return x

    def layer_feature(self, x: jax.Array) -> jax.Array:
        """A decoder layer's output residual -> the [B, T, D] hidden state `return_hidden` gives for it (the
        residual itself; DeepSeek-V4 reduces its streams)."""
        return x

    def lm_logits(self, x: jax.Array) -> jax.Array:
        """Normed hidden [B, T, D] -> logits [B, T, V]."""
        return self.embed_tokens.attend(x) if self.lm_head is None else self.lm_head(x)

    # -- MTP layers (DeepSeek-V3 / V3.2, GLM-4.5 / GLM-5): kept after the main stack, usable as extra heads

    @property
    def num_mtp_layers(self) -> int:
        return len(self.layers) - self.config.num_hidden_layers

    def mtp_logits(self, input_ids: jax.Array, hidden: jax.Array, *, depth: int = 0,
                   positions: jax.Array | None = None) -> jax.Array:
        """Logits of MTP layer `depth` for the token after next: input_ids [B, T] and `hidden` [B, T, D]
        (the main model's `return_hidden=(-1,)`: its final-normed hidden states) -> [B, T - 1, V];
        row i predicts t_{i+2} from h_i and t_{i+1}. Rotary positions default to 0..T-2 (transformers
        uses 1..T-1; without a cache only position differences matter, so the logits are the same)."""
        L = self.config.num_hidden_layers
        if not 0 <= depth < self.num_mtp_layers:
            raise ValueError(f"mtp depth {depth}: the model has {self.num_mtp_layers} MTP layers")
        B, T = input_ids.shape
        ctx, _ = build_context(T - 1, B, positions=None if positions is None else positions[:, :-1],
                               segment_ids=None, cache=None, windows=set())
        ctx.rope = self.rope(ctx.positions)
        mtp = self.layers[L + depth]
        normed = mtp.predict(self.embed_tokens(input_ids[:, 1:]), hidden[:, :-1], ctx, L + depth)
        return self.lm_logits(normed)  # [B, T-1, V]

    def hf_extra_export(self) -> dict[str, jax.Array]:
        """Published MTP layers carry copies of the embedding and the LM head; write them too."""
        L, out = self.config.num_hidden_layers, {}
        for m in range(self.num_mtp_layers):
            out[f"model.layers.{L + m}.embed_tokens.weight"] = self.embed_tokens.weight[...]
            head = self.embed_tokens.weight[...] if self.lm_head is None else self.lm_head.weight().T
            out[f"model.layers.{L + m}.shared_head.head.weight"] = head
        return out

    def hf_accepts(self, name: str) -> bool:
        """The MTP copies of the embedding / LM head (identical to the main ones in published checkpoints)."""
        L = self.config.num_hidden_layers
        copies = ("embed_tokens.weight", "shared_head.head.weight")
        return any(name == f"model.layers.{L + m}.{c}" for m in range(self.num_mtp_layers) for c in copies)

    def __call__(
        self,
        input_ids: jax.Array,
        *,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        cache: KVCache | None = None,
        return_hidden: tuple[int, ...] = (),
        tree_mask: jax.Array | None = None,
    ):
        """input_ids [B, T] -> logits [B, T, V] (+ new cache if `cache`) (+ hidden list if `return_hidden`).

        Without a cache, `segment_ids` [B, T] packs sequences: tokens attend causally within equal
        nonzero ids (0 = padding) and default positions restart at every segment. With a cache, the
        T tokens are written at slots length..length+T-1 of each row, `segment_ids != 0` marks which
        of them are valid keys, default positions are the slots, and the new cache has length + T.
        `return_hidden` indices: i in [0, L) = output of decoder layer i; -1 or L = final normed hidden.
        `tree_mask` [B, T, T] (True = may attend) replaces causality among this call's tokens, e.g. a draft
        tree verified in one forward: pass each node's `positions` (prefix length + depth); with a cache
        every node also sees the cached prefix (see build_context for sliding windows).
        """
        B, T = input_ids.shape
        L = self.config.num_hidden_layers
        wanted = {L if i == -1 else i for i in return_hidden}
        if any(not 0 <= i <= L for i in wanted):
            raise ValueError(f"return_hidden {return_hidden}: indices must be in [0, {L}] or -1")
        windows = {self.layer_window(i) for i in range(L)}
        ctx, cache = build_context(T, B, positions=positions, segment_ids=segment_ids, cache=cache,
                                   windows=windows, tree_mask=tree_mask)
        ctx.rope = self.rope(ctx.positions)
        ctx.input_ids = input_ids
        x = self.constrain(self.streams_in(self.embed_tokens(input_ids)))  # [B, T, D] (or streams)
        hidden: dict[int, jax.Array] = {}
        policy = REMAT_POLICIES[getattr(self, "remat", "none")]
        for i in range(L):
            if policy is not None and cache is None:
                # Recompute the layer in the backward pass instead of keeping its activations; what it passes
                # on to later layers (ctx.carry, GLM-5's shared top-k) leaves the remat as an output.
                def run(layer: nnx.Module, h: jax.Array, carry: dict, i: int = i) -> tuple[jax.Array, dict]:
                    inner = dataclasses.replace(ctx, carry=dict(carry))
                    return layer(h, inner, None, i)[0], inner.carry

                x, ctx.carry = nnx.remat(run, policy=policy[0], prevent_cse=True)(self.layers[i], x, ctx.carry)
            else:
                x, cache = self.layers[i](x, ctx, cache, i)
            x = self.constrain(x)
            if i in wanted:
                hidden[i] = self.layer_feature(x)  # [B, T, D]
        x = self.norm(self.streams_out(x))
        hidden[L] = x
        logits = self.constrain(self.lm_logits(x))  # [B, T, V]

        out: tuple = (logits,)
        if cache is not None:
            out += (cache,)
        if return_hidden:
            out += ([hidden[L if i == -1 else i] for i in return_hidden],)
        return out[0] if len(out) == 1 else out
