"""Llama and Qwen3 dense decoders in Flax NNX, numerically matching transformers 5.24.

Mirrors docs/models/decoder.md (skeleton, RMSNorm, attention, RoPE incl. default and llama3, SwiGLU,
tied head) and docs/models/llama-qwen3.md (Llama / Qwen3: QK-norm before RoPE, head_dim that may differ
from D/N, config fields). Module attribute names mirror the HF tensor names, so
`layers.3.self_attn.q_proj.kernel` is `model.layers.3.self_attn.q_proj.weight` transposed
(models/hf.py).

    from models import Llama, LlamaConfig
    model = Llama(LlamaConfig.tiny(256), rngs=nnx.Rngs(0))
    logits = model(jnp.zeros((2, 8), jnp.int32))                       # [B, T, V]

Shape legend: B batch, T length, S cache length, D model, N heads, K kv heads, G = N/K,
H head dim, F ffn, V vocab, L layers.
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
from models.flops import LayerFlops, gqa_layer, swiglu
from models.layers import MLP, rope_config_from_hf, rope_cos_sin, rope_frequencies

ARCH_TO_MODEL_TYPE = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3"}
MODEL_TYPE_TO_ARCH = {v: k for k, v in ARCH_TO_MODEL_TYPE.items()}


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None -> num_attention_heads
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None  # None (default RoPE) or {"rope_type": "llama3", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    pad_token_id: int | None = None
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)
        if self.num_key_value_heads is None:
            set_("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            set_("head_dim", self.hidden_size // self.num_attention_heads)
        if self.rope_scaling is not None:  # hashable, so that the config can live in a graphdef
            set_("rope_scaling", flax.core.FrozenDict(self.rope_scaling))
        if isinstance(self.eos_token_id, Sequence):
            set_("eos_token_id", tuple(int(e) for e in self.eos_token_id))
        if self.architecture not in ARCH_TO_MODEL_TYPE:
            known = sorted(ARCH_TO_MODEL_TYPE)
            raise ValueError(f"unknown architecture {self.architecture!r}; known: {known}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")

    # -- presets ---------------------------------------------------------------------------------

    def layer_flops(self) -> list[LayerFlops]:
        """Per-layer cost of a token (models/flops.py): GQA attention and a SwiGLU MLP in every layer."""
        return [gqa_layer(self, swiglu(self.hidden_size, self.intermediate_size))] * self.num_hidden_layers

    @classmethod
    def tiny(cls, vocab_size: int = 256, **overrides: Any) -> LlamaConfig:
        """2 layers, D 64, 4 heads / 2 kv heads of 16: the size the unit and parity tests use."""
        kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
        return cls(**{**kw, **overrides})

    @classmethod
    def small(cls, vocab_size: int = 8192, **overrides: Any) -> LlamaConfig:
        """D 512, 8 layers, 8 heads of 64, F 1376: the ~34M-parameter CPU benchmark size."""
        kw = dict(vocab_size=vocab_size, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=8, head_dim=64, max_position_embeddings=2048)
        return cls(**{**kw, **overrides})

    @classmethod
    def qwen3_tiny(cls, vocab_size: int = 256, **overrides: Any) -> LlamaConfig:
        """Tiny Qwen3: QK-norm, head_dim 32 ≠ D/N = 16, tied embeddings, theta 1e6."""
        kw = dict(head_dim=32, qk_norm=True, tie_word_embeddings=True, rope_theta=1e6,
                  architecture="Qwen3ForCausalLM", bos_token_id=None, eos_token_id=None)
        return cls.tiny(vocab_size, **{**kw, **overrides})

    # -- HF config.json --------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> LlamaConfig:
        """Build from a config.json dict in the transformers-5 or the legacy spelling."""
        archs = d.get("architectures") or [MODEL_TYPE_TO_ARCH.get(d.get("model_type", ""), "")]
        arch = archs[0]
        if arch not in ARCH_TO_MODEL_TYPE:
            raise ValueError(f"config.json: architecture {arch!r} is not a Llama/Qwen3 dense model")
        if d.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"config.json: hidden_act {d['hidden_act']!r} (only silu)")
        if d.get("use_sliding_window"):
            raise NotImplementedError("config.json: Qwen3 use_sliding_window=true is not supported")
        theta, _, scaling = rope_config_from_hf(d)
        heads = d["num_attention_heads"]
        if heads % (d.get("num_key_value_heads") or heads):
            raise ValueError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                             f"{d['num_key_value_heads']}")
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            qk_norm=arch == "Qwen3ForCausalLM",
            architecture=arch,
        )

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict that transformers 5 AutoConfig / AutoModelForCausalLM load."""
        model_type = ARCH_TO_MODEL_TYPE[self.architecture]
        if self.qk_norm != (model_type == "qwen3"):
            raise ValueError(f"qk_norm={self.qk_norm} cannot be expressed as {self.architecture}")
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**dict(self.rope_scaling), "rope_theta": self.rope_theta}
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "initializer_range": 0.02,
            "use_cache": True,
            "dtype": dtype,
        }
        if model_type == "llama":
            d["mlp_bias"] = self.mlp_bias
            d["pretraining_tp"] = 1
        else:
            if self.mlp_bias:
                raise ValueError("Qwen3 has no mlp_bias")
            n = self.num_hidden_layers
            d.update(use_sliding_window=False, sliding_window=None, max_window_layers=n,
                     layer_types=["full_attention"] * n)
        return d


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------


class Llama(DecoderLM):
    """Pre-norm decoder: embed -> L × (GQA attention + SwiGLU) -> RMSNorm -> LM head (tied or not)."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32):
        c = config
        super().__init__(config, lambda kw: [
            DecoderLayer(
                GQAttention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
                            num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                            qkv_bias=c.attention_bias, o_bias=c.attention_bias, qk_norm=c.qk_norm, **kw),
                MLP(c.hidden_size, c.intermediate_size, use_bias=c.mlp_bias, **kw),
                hidden_size=c.hidden_size, rms_norm_eps=c.rms_norm_eps, param_dtype=param_dtype)
            for _ in range(c.num_hidden_layers)
        ], rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        c = self.config
        inv_freq, scaling = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
        return rope_cos_sin(positions, inv_freq, self.dtype, scaling)  # [B, T, H] each, shared by all layers


# the registry record (models/families.py): HF architecture -> the config.json model_types it ships with
REGISTRY = {"LlamaForCausalLM": ("llama",)}
FAMILY = (LlamaConfig, Llama)
