"""EAGLE-3 draft head in Flax NNX: one Llama decoder layer on fused target features, a pruned draft
vocabulary, the training-time-test (TTT) loss, and the SGLang / vLLM-speculators checkpoint layouts.

Mirrors /work/shared/reference/speculative-and-quantization-formats.md §A2 (architecture), §A3 (TTT
unroll and loss), §A4 (draft vocabulary: ascending ids, `d2t` offsets, `t2d` mask) and §A8 (export
layouts), cross-checked against vllm-project/speculators 0.9.0 (`models/eagle3/{core,
model_definitions,config}.py`: `Eagle3FirstLayerMixin` splits `[embeds, hidden]`, normalises each,
keeps the *un-normalised* hidden as the residual) and SGLang's `LlamaForCausalLMEagle3`.

    cfg = Eagle3Config.for_target(target.config, draft_vocab_size=32000)
    draft = Eagle3Draft(cfg, rngs=nnx.Rngs(0))
    draft.load_embedding(target.embed_tokens.weight[...])            # frozen, never exported
    feats = jnp.concatenate(target(ids, return_hidden=draft.target_layers)[1], -1)   # [B, T, 3·D_t]
    logits, hidden, _ = draft(next_ids, features=feats, positions=pos)  # [B, T, Vd], [B, T, D]

One draft step at position p: f = fc(features_p) (or the draft's own previous `hidden`),
a = [input_layernorm(embed(token)); hidden_norm(f)] (embedding first, 2D wide), h = f + attn(a),
out = h + mlp(post_attention_layernorm(h)), logits = lm_head(norm(out)); `out` is what the next
step feeds back.

Layer ids: `aux_layer_ids` are output-of-layer indices (DecoderLM `return_hidden`; default 1, N//2-1, N-4).
The SGLang layout stores them as they are (`eagle_config`, SpecForge's convention; SGLang adds 1
internally); the speculators layout stores hidden-state boundary ids, one higher (vLLM and
speculators read id i as the residual stream entering layer i: default [2, N//2, N-3]).

Tests: `pytest tests/unit/test_eagle3.py` (cache decode, TTT against explicit loops, a numpy reference
of the exported tensors, both layouts' round trip, `for_target` on every family).

Shape legend: B batch, T length, S cache length, D draft width, D_t target width, N heads, K kv heads,
G = N/K, H head dim, F ffn width, V target vocab, Vd draft vocab, k TTT step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import flax.core
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors.numpy
from flax import nnx

from models.decoder import Context, build_context
from models.generate import KVCache
from models.hf import SafetensorsCheckpoint, load_config, readable_dir, writable_dir
from models.layers import (
    INIT_STD,
    MLP,
    NEG_INF,
    Buffer,
    Linear,
    RMSNorm,
    apply_rope,
    attention,
    param,
    rope_config_from_hf,
    rope_cos_sin,
    rope_frequencies,
)

log = logging.getLogger(__name__)

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
SPECULATORS_VERSION = "0.9.0"  # the vllm-project/speculators release whose config schema this writes
DRAFT_ROPE_TYPES = ("default", "llama3")  # target RoPE the draft copies; anything else -> plain theta 10000
DEFAULT_DRAFT_THETA = 10000.0
WEIGHTS_FILE = "model.safetensors"


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low/mid/high target features: the outputs of layers 1, N//2-1 and N-4 (0-indexed),
    i.e. the residual stream entering layers 2, N//2 and N-3 (speculative-and-quantization-formats.md
    §A2). For shallow targets (N < 7) that formula repeats or reorders layers (N=4 gives 1, 1, 0), which
    the serving loaders refuse (speculators rejects duplicates) and which wastes the draft's input; there
    the ids are spread evenly over layers 1..N-1 instead (N=4: 1, 2, 3); with N < 4 they are layers 0, 1, 2
    (repeating the last layer when N < 3: serving engines always fuse three features)."""
    n = num_layers
    ids = (1, n // 2 - 1, n - 4)
    if ids[0] < ids[1] < ids[2]:
        return ids
    if n < 4:
        return tuple(min(i, n - 1) for i in range(3))
    spread = tuple(int(round(x)) for x in np.linspace(1, n - 1, 3))
    return spread if len(set(spread)) == 3 else tuple(range(n - 3, n))


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """The draft layer's own geometry (Llama-style GQA, SwiGLU) plus the vocabularies and the target
    features it reads. Defaults are the Llama-3.1-8B draft's (§A8.1)."""

    hidden_size: int = 4096  # D
    intermediate_size: int = 14336  # F
    num_attention_heads: int = 32  # N
    num_key_value_heads: int | None = 8  # K; None -> N
    head_dim: int | None = 128  # H; None -> D // N
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: Mapping[str, Any] | None = None  # None (plain RoPE) or {"rope_type": "llama3", ...}
    max_position_embeddings: int = 2048
    vocab_size: int = 128256  # V: the TARGET's vocabulary (embedding rows, t2d length)
    draft_vocab_size: int = 32000  # Vd: lm_head rows, d2t length
    target_hidden_size: int | None = None  # D_t; None -> D
    aux_layer_ids: tuple[int, ...] = (1, 15, 28)  # target `return_hidden` indices, low -> high

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)
        if self.num_key_value_heads is None:
            set_("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        if self.target_hidden_size is None:
            set_("target_hidden_size", self.hidden_size)
        set_("aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
        if self.rope_scaling is not None:  # hashable, so that the config can live in a graphdef
            set_("rope_scaling", flax.core.FrozenDict(self.rope_scaling))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in [1, vocab_size={self.vocab_size}]")
        if not self.aux_layer_ids:
            raise ValueError("aux_layer_ids must name at least one target layer")

    @property
    def num_hidden_layers(self) -> int:
        """One decoder layer (what KVCache.init reads)."""
        return 1

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @classmethod
    def tiny(cls, vocab_size: int = 256, draft_vocab_size: int = 64, **overrides: Any) -> Eagle3Config:
        """D 64, 4 heads / 2 kv heads of 16, F 128, aux layers of a 2-layer target: for unit tests."""
        kw = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512, vocab_size=vocab_size,
                  draft_vocab_size=draft_vocab_size, aux_layer_ids=default_aux_layer_ids(2))
        return cls(**{**kw, **overrides})

    @classmethod
    def for_target(cls, target_config: Any, *, draft_vocab_size: int, aux_layer_ids: Sequence[int] | None = None,
                   **overrides: Any) -> Eagle3Config:
        """Draft geometry derived from any family config in models/ (Llama, Qwen3, Qwen3-MoE,
        DeepSeek-V3, GPT-OSS, GLM-4.5); `overrides` win.

        - D = D_t; heads / kv heads / head_dim are the target's, except for MLA (DeepSeek-V3, Kimi K2),
          whose attention has no GQA equivalent: N = K = the target's heads, H = D // N.
        - F = the target's dense FFN width; for an all-MoE target (GPT-OSS, or Qwen3-MoE / DeepSeek /
          GLM without dense layers) F = top_k × expert width, NeMo Automodel's sizing (§A2), i.e.
          the FFN width a token actually passes through.
        - RoPE: the target's theta and scaling when it is plain or llama3 RoPE; otherwise (YaRN,
          linear) plain RoPE with theta 10000 -- the draft only sees a few positions' differences
          and engines build a plain Llama rotary for it. Partial rotary (GLM) is not copied: the
          draft rotates whole heads.
        - aux_layer_ids default to `default_aux_layer_ids(num_hidden_layers)`.
        """
        t = target_config
        D_t = int(t.hidden_size)
        D = int(overrides.get("hidden_size", D_t))
        heads = int(t.num_attention_heads)
        if hasattr(t, "kv_lora_rank"):  # MLA
            kv_heads, head_dim = heads, D // heads
        else:
            kv_heads = int(t.num_key_value_heads or heads)
            head_dim = int(getattr(t, "head_dim", None) or D // heads)
        scaling = dict(t.rope_scaling) if getattr(t, "rope_scaling", None) else None
        rope_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type in DRAFT_ROPE_TYPES:
            theta, scaling = float(t.rope_theta), None if rope_type == "default" else scaling
        else:
            theta, scaling = DEFAULT_DRAFT_THETA, None
        kw = dict(
            hidden_size=D, intermediate_size=_draft_ffn_width(t), num_attention_heads=heads,
            num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=float(t.rms_norm_eps),
            rope_theta=theta, rope_scaling=scaling, max_position_embeddings=int(t.max_position_embeddings),
            vocab_size=int(t.vocab_size), draft_vocab_size=int(draft_vocab_size), target_hidden_size=D_t,
            aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids is not None
            else default_aux_layer_ids(int(t.num_hidden_layers)),
        )
        return cls(**{**kw, **overrides})

    # -- config.json ------------------------------------------------------------------------------

    def _rope_legacy(self) -> dict[str, Any]:
        scaling = None if self.rope_scaling is None else dict(self.rope_scaling)
        return {"rope_theta": self.rope_theta, "rope_scaling": scaling}

    def to_hf(self, dtype: str = "bfloat16", *, target_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The SGLang / EAGLE-official `config.json` (§A8.1, SpecForge's `llama3-8B-eagle3.json`
        fields; RoPE in the legacy `rope_theta` / `rope_scaling` spelling every engine reads)."""
        d: dict[str, Any] = {
            "architectures": [SGLANG_ARCHITECTURE],
            **self._llama_layer_fields(dtype, target_config),
            **self._rope_legacy(),
            "draft_vocab_size": self.draft_vocab_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                             "use_aux_hidden_state": True},
        }
        if self.target_hidden_size != self.hidden_size:
            d["target_hidden_size"] = self.target_hidden_size
        return d

    def transformer_layer_config(self, dtype: str = "bfloat16",
                                 target_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The speculators `transformer_layer_config`: a full transformers LlamaConfig dict of the
        draft layer whose `vocab_size` is the verifier's (§A8.2, speculators PR #188). RoPE in both
        spellings (transformers 5 `rope_parameters`, legacy `rope_theta` / `rope_scaling`)."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**dict(self.rope_scaling), "rope_theta": self.rope_theta}
        return {**self._llama_layer_fields(dtype, target_config), "rope_parameters": rope, **self._rope_legacy(),
                "attention_dropout": 0.0, "dtype": dtype}

    def _llama_layer_fields(self, dtype: str, target_config: Mapping[str, Any] | None) -> dict[str, Any]:
        """The transformers LlamaConfig fields of the one draft layer, as both layouts write them
        (`vocab_size` is the target's; special token ids are the target's)."""
        t = dict(target_config or {})
        return {
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "pretraining_tp": 1,
            "initializer_range": INIT_STD,
            "tie_word_embeddings": False,
            "use_cache": True,
            "bos_token_id": t.get("bos_token_id"),
            "eos_token_id": t.get("eos_token_id"),
            "pad_token_id": t.get("pad_token_id"),
            "torch_dtype": dtype,
        }

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], source: str = "config.json") -> Eagle3Config:
        """Read either layout's config.json: SGLang (`LlamaForCausalLMEagle3`, aux ids under
        `eagle_config`) or speculators (`Eagle3Speculator`, geometry in `transformer_layer_config`)."""
        if d.get("speculators_model_type") is not None:
            if d["speculators_model_type"] != "eagle3":
                raise ValueError(f"{source}: speculators_model_type {d['speculators_model_type']!r} is not eagle3")
            layer = d["transformer_layer_config"]
            aux = d.get("eagle_aux_hidden_state_layer_ids")
            if aux is not None:  # hidden-state boundary ids (0 = embedding output) -> output-of-layer ids
                if min(aux) < 1:
                    raise NotImplementedError(f"{source}: aux layer id 0 (the embedding output) is not supported")
                aux = [i - 1 for i in aux]
            target_hidden = d.get("target_hidden_size")
            for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"):
                if d.get(flag):
                    raise NotImplementedError(f"{source}: {flag}=true (EAGLE 3.x variant) is not supported")
        else:
            archs = d.get("architectures") or []
            if SGLANG_ARCHITECTURE not in archs:
                raise ValueError(f"{source}: architectures {archs} is neither {SGLANG_ARCHITECTURE} nor "
                                 f"{SPECULATORS_ARCHITECTURE}")
            layer = d
            aux = (d.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
            target_hidden = d.get("target_hidden_size")
        if aux is None:
            raise ValueError(f"{source}: no eagle_aux_hidden_state_layer_ids (the target layers the draft reads)")
        if layer.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"{source}: hidden_act {layer['hidden_act']!r} (only silu)")
        if layer.get("num_hidden_layers", 1) != 1:
            raise NotImplementedError(f"{source}: num_hidden_layers {layer['num_hidden_layers']} (only 1)")
        if layer.get("attention_bias") or layer.get("mlp_bias"):
            raise NotImplementedError(f"{source}: attention_bias / mlp_bias (the EAGLE-3 layer has none)")
        theta, _, scaling = rope_config_from_hf(layer, source=source)
        heads = layer["num_attention_heads"]
        return cls(
            hidden_size=layer["hidden_size"],
            intermediate_size=layer["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=layer.get("num_key_value_heads") or heads,
            head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
            rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=layer.get("max_position_embeddings", 2048),
            vocab_size=layer["vocab_size"],
            draft_vocab_size=d.get("draft_vocab_size") or layer["vocab_size"],
            target_hidden_size=target_hidden,
            aux_layer_ids=tuple(aux),
        )


def _draft_ffn_width(t: Any) -> int:
    """The target's dense FFN width, else top_k × its expert width (see Eagle3Config.for_target)."""
    L = int(t.num_hidden_layers)
    if hasattr(t, "is_moe_layer"):  # Qwen3-MoE, DeepSeek-V3, GLM-4.5: dense layers are optional
        has_dense = any(not t.is_moe_layer(i) for i in range(L))
    else:  # Llama / Qwen3 dense, or GPT-OSS (every layer MoE, `intermediate_size` is per expert)
        has_dense = not hasattr(t, "num_local_experts")
    if has_dense:
        return int(t.intermediate_size)
    expert = getattr(t, "moe_intermediate_size", None) or t.intermediate_size
    return int(t.num_experts_per_tok) * int(expert)


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------


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


class Eagle3Draft(nnx.Module):
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

    # -- target-side wiring -------------------------------------------------------------------------

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
        c = self.config
        d2t, t2d = np.asarray(d2t), np.asarray(t2d, bool)
        if d2t.shape != (c.draft_vocab_size,) or t2d.shape != (c.vocab_size,):
            raise ValueError(f"d2t {d2t.shape} / t2d {t2d.shape}: expected ({c.draft_vocab_size},) / ({c.vocab_size},)")
        ids = np.arange(c.draft_vocab_size) + d2t
        if ids.min() < 0 or ids.max() >= c.vocab_size or np.any(np.diff(ids) <= 0):
            raise ValueError("d2t must map draft ids to strictly ascending target ids inside the vocabulary")
        if not np.array_equal(np.flatnonzero(t2d), ids):
            raise ValueError("t2d does not mark exactly the target ids that d2t maps to")
        self.d2t.set_value(jnp.asarray(d2t, jnp.int32))
        self.t2d.set_value(jnp.asarray(t2d))

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


# ------------------------------------------------------------------------------------------------
# Training-time test (TTT) loss (§A3)
# ------------------------------------------------------------------------------------------------


def _shift(x: jax.Array, s: int) -> jax.Array:
    """x[:, s:] padded at the end with zeros (False) back to length T: row p holds x[p + s]. [B, T, ...]"""
    T = x.shape[1]
    if s >= T:
        return jnp.zeros_like(x)
    pad = [(0, 0), (0, s)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x[:, s:], pad)


def ttt_attention(q: jax.Array, k0: jax.Array, v0: jax.Array, mask0: jax.Array,
                  k_diag: Sequence[jax.Array], v_diag: Sequence[jax.Array]) -> jax.Array:
    """Attention of TTT step k without a cache: query p sees the step-0 keys k0 allowed by `mask0`
    (causal within its segment) plus the same position's keys from steps 1..k (`k_diag`), all in one
    softmax. Scores: [B, K, G, T, T] for step 0 plus one diagonal column per earlier step.

    q [B, T, N, H] (rotated, unscaled), k0 / v0 [B, T, K, H], mask0 [B, T, T], k_diag / v_diag: k
    arrays [B, T, K, H] -> [B, T, N, H]. Softmax in fp32; a query with no allowed key (padding at
    step 0) gets a uniform distribution, as in models.layers.attention.
    """
    B, T, N, H = q.shape
    K = k0.shape[2]
    q = (q * jnp.asarray(H**-0.5, q.dtype)).reshape(B, T, K, N // K, H)  # [B, T, K, G, H]
    s0 = jnp.einsum("btkgh,bskh->bkgts", q, k0).astype(jnp.float32)  # [B, K, G, T, T]
    s0 = jnp.where(mask0[:, None, None], s0, NEG_INF)
    cols = [jnp.einsum("btkgh,btkh->bkgt", q, kj).astype(jnp.float32)[..., None] for kj in k_diag]  # [B,K,G,T,1]
    probs = jax.nn.softmax(jnp.concatenate([s0, *cols], axis=-1), axis=-1).astype(v0.dtype)  # [B, K, G, T, T+k]
    out = jnp.einsum("bkgts,bskh->btkgh", probs[..., :T], v0)  # [B, T, K, G, H]
    for j, vj in enumerate(v_diag):
        out = out + jnp.einsum("bkgt,btkh->btkgh", probs[..., T + j], vj)
    return out.reshape(B, T, N, H)


def ttt_unroll(draft: Eagle3Draft, token_ids: jax.Array, features: jax.Array, *, positions: jax.Array,
               segment_ids: jax.Array | None, steps: int) -> Iterator[jax.Array]:
    """Yield the draft logits [B, T, Vd] of TTT steps 0..steps-1 (no cache, one pass per step).

    Step k at position p: token token_ids[p + k] (0 past the end), f = fc(features_p) at k = 0 else
    the step k-1 output at p, rotary position positions[p] + k; attention over the step-0 keys of
    positions <= p in p's segment plus p's own keys from steps 1..k (the diagonal extension).
    """
    B, T = token_ids.shape
    attn, layer = draft.midlayer.self_attn, draft.midlayer
    ctx, _ = build_context(T, B, positions=positions, segment_ids=segment_ids, cache=None, windows=set())
    mask0 = ctx.mask()  # [B, T, T] causal within segments
    f = draft.fuse(features)  # [B, T, D]
    k0 = v0 = None
    k_diag: list[jax.Array] = []
    v_diag: list[jax.Array] = []
    for k in range(steps):
        cos, sin = draft.rope(ctx.positions + k)
        emb = draft.embed_tokens(_shift(token_ids, k))  # [B, T, D]
        q, kk, vv = attn.project(layer.attn_input(emb, f), cos, sin)
        if k == 0:
            k0, v0 = kk, vv
        else:
            k_diag.append(kk)
            v_diag.append(vv)
        o = ttt_attention(q, k0, v0, mask0, k_diag, v_diag)  # [B, T, N, H]
        f = layer.finish(f, attn.o_proj(o.reshape(B, T, -1)))  # [B, T, D]: the next step's input
        yield draft.lm_head(draft.norm(f))  # [B, T, Vd]


def ttt_loss(draft: Eagle3Draft, batch: Mapping[str, jax.Array], features: jax.Array, target_logits: jax.Array,
             *, steps: int = 7, decay: float = 0.8) -> tuple[jax.Array, dict[str, jax.Array]]:
    """EAGLE-3 training-time-test loss over one packed batch (jit / grad friendly, no cache).

    batch: data_prep's packed columns `target_ids`, `positions`, `segment_ids`, `loss_mask` [B, T]
    (target_ids[p] = t_{p+1}); features [B, T, num_aux·D_t]; target_logits [B, T, V] (the target's
    logits at every position).

    Step k at position p (see `ttt_unroll`) consumes target_ids[p + k] and is scored against
    softmax(target_logits[p + 1 + k]) over the draft vocabulary (columns `target_token_ids`,
    renormalised), under the mask m = loss_mask[p + 1 + k] ∧ (p + 1 + k in p's segment) ∧ (the
    target's full-vocabulary argmax there is in the draft vocabulary).

    Returns (Σ_k decay^k Σ_{b,p} m · (−Σ_v P_v log Q_v), stats) with stats (each [steps], fp32):
    `loss` the unweighted per-step sums, `acc_num` masked positions where the draft argmax equals
    the restricted target argmax, `acc_den` masked positions. The caller divides by its token count.
    """
    if steps < 1:
        raise ValueError("steps must be >= 1")
    ids, positions = batch["target_ids"], batch["positions"]
    seg, loss_mask = batch["segment_ids"], batch["loss_mask"] != 0

    # labels, once: the target restricted to the draft vocabulary (ascending target ids == t2d columns)
    full = target_logits.astype(jnp.float32)  # [B, T, V]
    restricted = jnp.take(full, draft.target_token_ids, axis=-1)  # [B, T, Vd]
    probs = jax.nn.softmax(restricted, axis=-1)  # [B, T, Vd]
    label_arg = jnp.argmax(restricted, axis=-1)  # [B, T]
    in_draft = jnp.take(draft.t2d[...], jnp.argmax(full, axis=-1))  # [B, T] bool
    scored = loss_mask & in_draft  # [B, T]: position q may be a label

    total = jnp.zeros((), jnp.float32)
    losses, nums, dens = [], [], []
    for k, logits in enumerate(ttt_unroll(draft, ids, features, positions=positions, segment_ids=seg, steps=steps)):
        s = 1 + k  # label position offset
        m = (_shift(scored, s) & (_shift(seg, s) == seg) & (seg != 0)).astype(jnp.float32)  # [B, T]
        logits = logits.astype(jnp.float32)
        ce = -jnp.sum(_shift(probs, s) * jax.nn.log_softmax(logits, axis=-1), axis=-1)  # [B, T]
        loss_k = jnp.sum(m * ce)
        correct = (jnp.argmax(logits, axis=-1) == _shift(label_arg, s)).astype(jnp.float32)
        total = total + (decay**k) * loss_k
        losses.append(loss_k)
        nums.append(jnp.sum(m * correct))
        dens.append(jnp.sum(m))
    stats = {"loss": jnp.stack(losses), "acc_num": jnp.stack(nums), "acc_den": jnp.stack(dens)}
    return total, stats


# ------------------------------------------------------------------------------------------------
# Draft vocabulary (§A4)
# ------------------------------------------------------------------------------------------------


def build_draft_vocab(counts: np.ndarray | Sequence[int], draft_vocab_size: int
                      ) -> tuple[np.ndarray, np.ndarray, float]:
    """Token counts [V] (loss-masked answer tokens) -> (d2t int64 [Vd], t2d bool [V], coverage).

    Keeps the `draft_vocab_size` most frequent ids (ties: the lower id), sorted ASCENDING so that draft
    column i is the i-th smallest kept target id (the order boolean `t2d` selects columns in);
    d2t[i] = used[i] - i; coverage = the kept share of all counted tokens (0 when nothing counted).
    """
    counts = np.asarray(counts)
    V = counts.shape[0]
    if counts.ndim != 1 or not 1 <= draft_vocab_size <= V:
        raise ValueError(f"counts must be [V] and 1 <= draft_vocab_size <= V (got {counts.shape}, {draft_vocab_size})")
    top = np.argsort(-counts, kind="stable")[:draft_vocab_size]
    used = np.sort(top)  # [Vd] ascending target ids
    d2t = (used - np.arange(draft_vocab_size)).astype(np.int64)
    t2d = np.zeros((V,), bool)
    t2d[used] = True
    total = counts.sum()
    coverage = float(counts[used].sum() / total) if total > 0 else 0.0
    return d2t, t2d, coverage


# ------------------------------------------------------------------------------------------------
# Export / import: SGLang (`midlayer.*`, §A8.1) and vLLM speculators (`layers.0.*`, §A8.2)
# ------------------------------------------------------------------------------------------------

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}


def _weight_modules(draft: Eagle3Draft) -> dict[str, nnx.Module]:
    """SGLang tensor prefix -> Linear / RMSNorm of every exported weight (not the target embedding)."""
    out = {}
    for path, node in nnx.iter_graph(draft):
        if isinstance(node, (Linear, RMSNorm)):
            out[".".join(str(p) for p in path)] = node
    return dict(sorted(out.items()))


def draft_tensors(draft: Eagle3Draft, dtype: str = "bfloat16", prefix: str = "midlayer.") -> dict[str, np.ndarray]:
    """The exported tensors: HF [out, in] weights in `dtype` (LoRA folded in), d2t int64, t2d bool.
    `prefix` renames the decoder layer (speculators: "layers.0.")."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    np_dtype = DTYPES[dtype]
    out: dict[str, np.ndarray] = {}
    for name, mod in _weight_modules(draft).items():
        w = mod.weight().T if isinstance(mod, Linear) else mod.weight[...]  # [out, in] / [D]
        name = prefix + name[len("midlayer."):] if name.startswith("midlayer.") else name
        out[f"{name}.weight"] = np.ascontiguousarray(np.asarray(jnp.asarray(w, jnp.float32)).astype(np_dtype))
    out["d2t"] = np.asarray(draft.d2t[...]).astype(np.int64)
    out["t2d"] = np.asarray(draft.t2d[...]).astype(bool)
    return out


def _check_target(draft: Eagle3Draft, target_config: Mapping[str, Any]) -> None:
    V = target_config.get("vocab_size")
    if V is not None and V != draft.config.vocab_size:
        raise ValueError(f"target vocab_size {V} != the draft's vocab_size {draft.config.vocab_size} "
                         "(the draft must be built for this target)")


def _write(folder: str, config: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
    safetensors.numpy.save_file(tensors, os.path.join(folder, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def save_sglang(draft: Eagle3Draft, path_or_url: str, *, target_config: Mapping[str, Any],
                dtype: str = "bfloat16") -> None:
    """SGLang / EAGLE-official layout (also loaded by vLLM): config.json (`LlamaForCausalLMEagle3`,
    vocab_size = the target's) + model.safetensors (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`;
    no `embed_tokens`: engines reuse the target's). `target_config` is the target's config.json dict."""
    _check_target(draft, target_config)
    aux = draft.config.aux_layer_ids
    if aux[0] != 1:
        log.warning("aux_layer_ids %s do not start at 1: SGLang (>= sgl-project/sglang#25454) reads such ids as "
                    "hidden-state boundaries (one layer earlier) and vLLM ignores eagle_config ids in this layout; "
                    "prefer the speculators layout", list(aux))
    tensors = draft_tensors(draft, dtype, prefix="midlayer.")
    with writable_dir(path_or_url) as folder:
        _write(folder, draft.config.to_hf(dtype, target_config=target_config), tensors)


def speculators_layer_ids(aux_layer_ids: Sequence[int]) -> list[int]:
    """Our output-of-layer ids -> the hidden-state boundary ids that speculators and vLLM use for
    `eagle_aux_hidden_state_layer_ids` (id i = the residual stream entering layer i, 0 = embedding
    output; their default [2, N//2, N-3] is our default_aux_layer_ids + 1)."""
    return [int(i) + 1 for i in aux_layer_ids]


def speculators_config(config: Eagle3Config, *, target_config: Mapping[str, Any], verifier_name_or_path: str,
                       num_speculative_tokens: int, dtype: str = "bfloat16") -> dict[str, Any]:
    """The speculators `Eagle3SpeculatorConfig` config.json (§A8.2; field names from speculators 0.9.0
    `models/eagle3/config.py`, `config.py` and `proposals/greedy.py`)."""
    if num_speculative_tokens < 1:
        raise ValueError("num_speculative_tokens must be >= 1")
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": config.transformer_layer_config(dtype, target_config),
        "draft_vocab_size": config.draft_vocab_size,
        "eagle_aux_hidden_state_layer_ids": speculators_layer_ids(config.aux_layer_ids),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "target_hidden_size": None if config.target_hidden_size == config.hidden_size else config.target_hidden_size,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path,
                         "architectures": list(target_config.get("architectures") or [])},
        },
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def save_speculators(draft: Eagle3Draft, path_or_url: str, *, target_config: Mapping[str, Any],
                     verifier_name_or_path: str, num_speculative_tokens: int, dtype: str = "bfloat16") -> None:
    """vLLM speculators layout (`Eagle3Speculator`): config.json + model.safetensors with `fc`,
    `layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d` (no `embed_tokens`)."""
    _check_target(draft, target_config)
    if len(set(draft.config.aux_layer_ids)) != len(draft.config.aux_layer_ids):
        log.warning("aux_layer_ids %s repeat a layer (a target shallower than 8 layers): speculators refuses to "
                    "load such a config", list(draft.config.aux_layer_ids))
    config = speculators_config(draft.config, target_config=target_config, verifier_name_or_path=verifier_name_or_path,
                                num_speculative_tokens=num_speculative_tokens, dtype=dtype)
    tensors = draft_tensors(draft, dtype, prefix="layers.0.")
    with writable_dir(path_or_url) as folder:
        _write(folder, config, tensors)


def load_eagle3(path_or_url: str, embed_tokens: jax.Array | np.ndarray, *, dtype: Any = jnp.float32,
                param_dtype: Any = jnp.float32) -> Eagle3Draft:
    """Load either layout (told apart by `speculators_model_type` in config.json) and install the
    target's embedding [V, D]. Every missing, unexpected or mis-shaped tensor is reported in one
    ValueError. Without `d2t`/`t2d` (a full-vocabulary draft) the mapping is the identity."""
    with readable_dir(path_or_url) as folder:
        d = load_config(folder)
        config = Eagle3Config.from_hf(d, source=os.path.join(folder, "config.json"))
        tensors = SafetensorsCheckpoint(folder)
        draft = nnx.eval_shape(lambda: Eagle3Draft(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype))
        prefix = "layers.0." if d.get("speculators_model_type") is not None else "midlayer."
        used: set[str] = set()
        missing: list[str] = []
        misshaped: list[str] = []

        def get(name: str, shape: tuple[int, ...]) -> np.ndarray | None:
            if name not in tensors:
                missing.append(name)
                return None
            used.add(name)
            if tuple(tensors.shape(name)) != shape:
                misshaped.append(f"{name} {list(tensors.shape(name))} (expected {list(shape)})")
                return None
            return np.asarray(tensors[name])

        for name, mod in _weight_modules(draft).items():
            file_name = prefix + name[len("midlayer."):] if name.startswith("midlayer.") else name
            if isinstance(mod, Linear):
                w = get(f"{file_name}.weight", (mod.out_features, mod.in_features))
                if w is not None:
                    mod.kernel.set_value(jnp.asarray(w.astype(np.float32).T, param_dtype))
            else:
                w = get(f"{file_name}.weight", tuple(mod.weight.get_value().shape))
                if w is not None:
                    mod.weight.set_value(jnp.asarray(w.astype(np.float32), param_dtype))
        Vd, V = config.draft_vocab_size, config.vocab_size
        if "d2t" in tensors or "t2d" in tensors or Vd != V:
            d2t, t2d = get("d2t", (Vd,)), get("t2d", (V,))
        else:  # full-vocabulary draft: no mapping (speculators #200)
            d2t, t2d = np.zeros((Vd,), np.int64), np.ones((V,), bool)
        unexpected = sorted(set(tensors) - used - {"embed_tokens.weight"})
        if missing or unexpected or misshaped:
            parts = [f"{len(n)} {label}: {', '.join(n)}" for label, n in
                     (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)) if n]
            raise ValueError(f"{os.path.join(folder, WEIGHTS_FILE)}: tensors do not match the EAGLE-3 draft: "
                             + "; ".join(parts))
    draft.set_vocab(d2t, t2d)
    draft.load_embedding(embed_tokens)
    return draft
