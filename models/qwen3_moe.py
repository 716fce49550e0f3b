"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen3 attention (per-head QK-norm before RoPE,
explicit head_dim) with a sparse softmax-routed MoE FFN on most layers.

Mirrors docs/models/qwen3-moe.md (forward, config fields, on-disk tensors), docs/models/decoder.md
(shared conventions, RoPE incl. YaRN) and transformers 5.24.0
`models/qwen3_moe/modeling_qwen3_moe.py` / `configuration_qwen3_moe.py`, which define parity:

* layer i is a sparse MoE block iff i ∉ mlp_only_layers and num_experts > 0 and
  (i + 1) % decoder_sparse_step == 0, else a dense SwiGLU of width `intermediate_size`;
* router `mlp.gate.weight` [E, D]: softmax over all E in fp32, top-k, renormalised iff
  `norm_topk_prob` (no epsilon), no shared expert, no routed scaling;
* experts on disk per expert: `mlp.experts.{e}.{gate,up,down}_proj.weight`;
* `use_sliding_window` (false in every published config): transformers 5.24 then slides every layer
  with `sliding_window` keys (its qwen3_moe ignores `max_window_layers`), and so do we.

    from models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig
    model = Qwen3Moe(Qwen3MoeConfig.tiny(), rngs=nnx.Rngs(0))
    logits = model(jnp.zeros((2, 8), jnp.int32))                      # [B, T, V]

Shape legend: B batch, T length, D model, N heads, K kv heads, H head dim, F dense FFN width,
E experts, k experts per token, I expert width, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import flax.core
import jax
import jax.numpy as jnp
from flax import nnx

from models.decoder import DecoderLayer, DecoderLM, GQAttention
from models.flops import LayerFlops, gqa_layer, routed_ffn, swiglu
from models.layers import MLP, rope_config_from_hf, rope_cos_sin, rope_frequencies
from models.moe import Experts, MoE, Router

ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPE = "qwen3_moe"
DEFAULT_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig:
    """Field names and class defaults are transformers 5.24.0 `Qwen3MoeConfig`'s, except that
    `head_dim` None means hidden_size // num_attention_heads (transformers' fallback when the field is
    absent; every published checkpoint sets it, and `from_hf` always reads it)."""

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144  # dense layers (mlp_only_layers / decoder_sparse_step)
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    num_experts: int = 128  # config.json: `num_local_experts` (transformers 5) or `num_experts` (legacy)
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = False  # class default; the published checkpoints set true
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_THETA
    rope_scaling: Mapping[str, Any] | None = None  # None (default RoPE) or {"rope_type": "yarn", ...}
    max_position_embeddings: int = 32768
    attention_bias: bool = False  # q/k/v and o biases
    use_sliding_window: bool = False
    sliding_window: int | None = None  # keys per query (incl. itself) on every layer, iff use_sliding_window
    tie_word_embeddings: bool = False
    router_aux_loss_coef: float = 0.001
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)
        if self.head_dim is None:
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        set_("mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if self.rope_scaling is not None:  # hashable, so that the config can live in a graphdef
            set_("rope_scaling", flax.core.FrozenDict(self.rope_scaling))
        if isinstance(self.eos_token_id, Sequence):
            set_("eos_token_id", tuple(int(e) for e in self.eos_token_id))
        if not self.use_sliding_window:
            set_("sliding_window", None)  # transformers nulls it unless enabled
        elif not self.sliding_window or self.sliding_window < 1:
            raise ValueError(f"use_sliding_window=true needs a positive sliding_window (got {self.sliding_window})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1 (got {self.decoder_sparse_step})")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} does not fit {self.num_experts} experts")

    def is_moe_layer(self, i: int) -> bool:
        """transformers' rule: sparse iff i ∉ mlp_only_layers, E > 0 and (i + 1) % decoder_sparse_step == 0."""
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)

    def layer_window(self, i: int) -> int | None:
        return self.sliding_window if self.use_sliding_window else None

    # -- presets ---------------------------------------------------------------------------------

    def layer_flops(self) -> list[LayerFlops]:
        """Per-layer cost of a token (models/flops.py): GQA attention; a routed MoE (softmax router, no
        shared expert) or, in `mlp_only_layers`, a dense SwiGLU MLP; sliding windows where configured."""
        return [gqa_layer(self, routed_ffn(self, self.num_experts, self.moe_intermediate_size) if self.is_moe_layer(i)
                          else swiglu(self.hidden_size, self.intermediate_size), self.layer_window(i))
                for i in range(self.num_hidden_layers)]

    @classmethod
    def tiny(cls, vocab_size: int = 256, **overrides: Any) -> Qwen3MoeConfig:
        """3 layers (layer 1 dense), D 64, 4 heads / 2 kv heads of 32 (≠ D/N), 8 experts of 32, top-2."""
        kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                  num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=(1,), rope_theta=1e6,
                  max_position_embeddings=512)
        return cls(**{**kw, **overrides})

    @classmethod
    def qwen3_30b_a3b(cls, **overrides: Any) -> Qwen3MoeConfig:
        """Qwen/Qwen3-30B-A3B (published config): D 2048, 48 layers, 32/4 heads of 128, 128 experts of 768, top-8,
        norm_topk_prob true, theta 1e6, eps 1e-6, 40960 positions. Unverified (memory of the Hub
        config.json): intermediate_size 6144 (unused: every layer is sparse) and bos/eos."""
        kw = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                  num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                  num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                  rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                  bos_token_id=151643, eos_token_id=151645)
        return cls(**{**kw, **overrides})

    @classmethod
    def qwen3_235b_a22b(cls, **overrides: Any) -> Qwen3MoeConfig:
        """Qwen/Qwen3-235B-A22B: D 4096, 94 layers, 64/4 heads of 128, 128 experts of 1536, top-8.

        Verified against the task brief: layers, D, heads, kv heads, head_dim, E, k, I, vocab.
        Unverified (memory of the Hub config.json): intermediate_size 12288 (unused: every layer
        is sparse), max_position_embeddings 40960, theta 1e6, eps 1e-6, bos/eos, norm_topk_prob true.
        """
        kw = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                  num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                  num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                  rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                  bos_token_id=151643, eos_token_id=151645)
        return cls(**{**kw, **overrides})

    # -- HF config.json --------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> Qwen3MoeConfig:
        """Build from a config.json dict in the transformers-5 or the legacy spelling."""
        archs = d.get("architectures") or [ARCHITECTURE if d.get("model_type") == MODEL_TYPE else ""]
        if archs[0] != ARCHITECTURE:
            raise ValueError(f"config.json: architecture {archs[0]!r} is not {ARCHITECTURE}")
        if d.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"config.json: hidden_act {d['hidden_act']!r} (only silu)")
        theta, _, scaling = rope_config_from_hf(d, default_theta=DEFAULT_THETA)
        heads = d.get("num_attention_heads", 32)
        hidden = d.get("hidden_size", 2048)
        experts = d.get("num_local_experts", d.get("num_experts", 128))
        use_sw = bool(d.get("use_sliding_window", False))
        return cls(
            vocab_size=d.get("vocab_size", 151936),
            hidden_size=hidden,
            intermediate_size=d.get("intermediate_size", 6144),
            moe_intermediate_size=d.get("moe_intermediate_size", 768),
            num_hidden_layers=d.get("num_hidden_layers", 24),
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or 4,
            head_dim=d.get("head_dim") or hidden // heads,
            num_experts=experts,
            num_experts_per_tok=d.get("num_experts_per_tok", 8),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            decoder_sparse_step=d.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            attention_bias=bool(d.get("attention_bias", False)),
            use_sliding_window=use_sw,
            sliding_window=d.get("sliding_window", 4096) if use_sw else None,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            router_aux_loss_coef=d.get("router_aux_loss_coef", 0.001),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
        )

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict (transformers-5 spelling) that AutoModelForCausalLM loads to this model."""
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**dict(self.rope_scaling), "rope_theta": self.rope_theta}
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "use_sliding_window": self.use_sliding_window,
            "sliding_window": self.sliding_window,
            "tie_word_embeddings": self.tie_word_embeddings,
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "output_router_logits": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "initializer_range": 0.02,
            "use_cache": True,
            "dtype": dtype,
        }


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------


class Qwen3Moe(DecoderLM):
    """embed -> L × (QK-norm GQA attention + sparse MoE or dense SwiGLU) -> RMSNorm -> LM head.

    MoE layers hold `mlp.gate` (Router, softmax) and `mlp.experts` (stacked gate_up [E, D, 2I],
    down [E, I, D]); dense layers hold `mlp.{gate,up,down}_proj` — the HF names, structurally.
    """

    def __init__(self, config: Qwen3MoeConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32):
        c = config
        super().__init__(config, lambda kw: [
            DecoderLayer(self._attention(kw), self._ffn(i, kw), hidden_size=c.hidden_size,
                         rms_norm_eps=c.rms_norm_eps, param_dtype=param_dtype, window=c.layer_window(i))
            for i in range(c.num_hidden_layers)
        ], rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def _attention(self, kw: dict[str, Any]) -> GQAttention:
        c = self.config
        return GQAttention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
                           num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                           qkv_bias=c.attention_bias, o_bias=c.attention_bias, qk_norm=True, **kw)

    def _ffn(self, i: int, kw: dict[str, Any]) -> nnx.Module:
        c = self.config
        if not c.is_moe_layer(i):
            return MLP(c.hidden_size, c.intermediate_size, **kw)
        router = Router(c.hidden_size, c.num_experts, c.num_experts_per_tok, scoring="softmax",
                        norm_topk_prob=c.norm_topk_prob, **kw)
        experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, hf_layout="per_expert", **kw)
        return MoE(router, experts, router_name="gate")

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = self.config
        inv_freq, scaling = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
        return rope_cos_sin(positions, inv_freq, self.dtype, scaling)  # [B, T, H] each, shared by all layers


# the registry record (models/families.py): HF architecture -> the config.json model_types it ships with
REGISTRY = {"Qwen3MoeForCausalLM": ("qwen3_moe",)}
FAMILY = (Qwen3MoeConfig, Qwen3Moe)
