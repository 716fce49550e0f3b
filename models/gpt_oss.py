"""GPT-OSS (20B / 120B) in Flax NNX, numerically matching transformers 5.24 `GptOssForCausalLM`.

Mirrors docs/models/gpt-oss.md (config, alternating sliding/full layers, attention with learned sinks,
top-k-then-softmax router with a bias, interleaved clamped-SwiGLU experts with biases, on-disk layout,
MXFP4, GPT-OSS RMSNorm: × weight in fp32, then cast, norm weights kept in fp32; YaRN with
`truncate: false`: cos and sin × the attention factor, softmax scale head_dim^-0.5; pitfalls) and
docs/models/decoder.md; the parity authority is transformers
`models/gpt_oss/modeling_gpt_oss.py` and `configuration_gpt_oss.py`.

Module attribute names mirror the HF tensor names (models/hf.py maps them structurally):
`layers.{i}.self_attn.{q,k,v,o}_proj` (+ bias), `layers.{i}.self_attn.sinks` [N],
`layers.{i}.mlp.router.{weight,bias}`, `layers.{i}.mlp.experts.{gate_up_proj,gate_up_proj_bias,
down_proj,down_proj_bias}` (transformers' fused [E, in, out] layout, gate/up interleaved on disk,
converted by models/moe.py `Experts(hf_layout="gpt_oss")`). Published MXFP4 expert weights
(`*_blocks` / `*_scales`) are dequantized on load by models/quant/formats/.

    from models.gpt_oss import GptOss, GptOssConfig
    model = GptOss(GptOssConfig.tiny(), rngs=nnx.Rngs(0))
    logits = model(jnp.zeros((2, 8), jnp.int32))                       # [B, T, V]

Shape legend: B batch, T length, S cache length, D model, N heads, K kv heads, H head dim,
E experts, k experts per token, I per-expert ffn width, V vocab, L layers.
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
from models.flops import LayerFlops, gqa_layer, routed_ffn
from models.layers import ROPE_TYPES, rope_config_from_hf, rope_cos_sin, rope_frequencies
from models.moe import Experts, MoE, Router

ARCHITECTURE = "GptOssForCausalLM"
MODEL_TYPE = "gpt_oss"
SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_THETA = 150000.0  # transformers GptOssConfig.default_theta
# transformers' GptOssConfig.__post_init__ default when config.json has no RoPE parameters
DEFAULT_YARN: dict[str, Any] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 4096}


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """Even-indexed layers slide, odd layers attend fully (transformers `(i + 1) % 2`)."""
    return tuple(SLIDING if (i + 1) % 2 else FULL for i in range(num_layers))


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GptOssConfig:
    """Class defaults are transformers 5.24's `GptOssConfig` defaults (the 120B shapes)."""

    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880  # per expert
    num_hidden_layers: int = 36
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    sliding_window: int | None = 128
    layer_types: tuple[str, ...] | None = None  # None -> alternating, even layers sliding
    rope_theta: float = DEFAULT_THETA
    rope_scaling: Mapping[str, Any] | None = None  # None -> DEFAULT_YARN; {"rope_type": "default"} for none
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    attention_bias: bool = True  # q/k/v and o biases
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    router_aux_loss_coef: float = 0.001
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)
        if self.layer_types is None:
            set_("layer_types", default_layer_types(self.num_hidden_layers))
        set_("layer_types", tuple(self.layer_types))
        # hashable, so that the config can live in a graphdef
        set_("rope_scaling", flax.core.FrozenDict(DEFAULT_YARN if self.rope_scaling is None else self.rope_scaling))
        if isinstance(self.eos_token_id, Sequence):
            set_("eos_token_id", tuple(int(e) for e in self.eos_token_id))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if bad := sorted(set(self.layer_types) - {SLIDING, FULL}):
            raise ValueError(f"layer_types: unknown {bad} (known: {SLIDING}, {FULL})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")
        if not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} with {self.num_local_experts} experts")
        rope_type = self.rope_scaling.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            raise NotImplementedError(f"rope_type {rope_type!r} (supported: {ROPE_TYPES})")

    def layer_window(self, i: int) -> int | None:
        """Sliding-window width of layer i (W keys including the current one), None for full attention."""
        return self.sliding_window if self.layer_types[i] == SLIDING else None

    # -- presets ---------------------------------------------------------------------------------

    def layer_flops(self) -> list[LayerFlops]:
        """Per-layer cost of a token (models/flops.py): GQA attention (128-token windows on alternate
        layers) and a routed MoE in every layer, no shared expert."""
        ffn = routed_ffn(self, self.num_local_experts, self.intermediate_size)
        return [gqa_layer(self, ffn, self.layer_window(i)) for i in range(self.num_hidden_layers)]

    @classmethod
    def tiny(cls, vocab_size: int = 256, **overrides: Any) -> GptOssConfig:
        """4 layers (sliding, full, sliding, full) of width 64, window 8, 8 experts of 64, top-2,
        YaRN from 16 to 64 positions: the size the unit and parity tests use."""
        kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                  num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
                  rope_scaling={**DEFAULT_YARN, "factor": 4.0, "original_max_position_embeddings": 16})
        return cls(**{**kw, **overrides})

    @classmethod
    def gpt_oss_20b(cls, **overrides: Any) -> GptOssConfig:
        """openai/gpt-oss-20b: 24 layers, 32 experts, router_aux_loss_coef 0.9 as released."""
        kw = dict(num_hidden_layers=24, num_local_experts=32, router_aux_loss_coef=0.9, **_PUBLISHED)
        return cls(**{**kw, **overrides})

    @classmethod
    def gpt_oss_120b(cls, **overrides: Any) -> GptOssConfig:
        """openai/gpt-oss-120b: 36 layers, 128 experts. router_aux_loss_coef 0.9 assumes the
        120b file matches the 20b one (unverified)."""
        kw = dict(num_hidden_layers=36, num_local_experts=128, router_aux_loss_coef=0.9, **_PUBLISHED)
        return cls(**{**kw, **overrides})

    # -- HF config.json --------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> GptOssConfig:
        """Build from a config.json dict in the transformers-5 or the legacy spelling.

        RoPE follows transformers' precedence: a legacy `rope_scaling` dict wins over
        `rope_parameters`; neither present -> the class default YaRN dict; `rope_theta` from the
        dict, else the top-level field, else 150000; a YaRN dict without
        `original_max_position_embeddings` takes `max_position_embeddings`.
        """
        archs = d.get("architectures") or ([ARCHITECTURE] if d.get("model_type") == MODEL_TYPE else [])
        if ARCHITECTURE not in archs:
            raise ValueError(f"config.json: architectures {archs} is not {ARCHITECTURE}")
        max_pos = d.get("max_position_embeddings", 131072)
        theta, _, rope = rope_config_from_hf(d, default_theta=DEFAULT_THETA, default=DEFAULT_YARN)
        rope = dict(rope or {"rope_type": "default"})
        if rope["rope_type"] == "yarn":
            rope.setdefault("original_max_position_embeddings", max_pos)
        heads = d.get("num_attention_heads", 64)
        hidden = d.get("hidden_size", 2880)
        layers = d.get("num_hidden_layers", 36)
        kv_heads = d.get("num_key_value_heads", 8)  # absent -> the class default; null -> heads
        head_dim = d.get("head_dim", 64)  # absent -> the class default 64; null -> hidden // heads
        experts = d.get("num_local_experts", d.get("num_experts", 128))
        top_k = d.get("num_experts_per_tok", d.get("experts_per_token", 4))
        eos = d.get("eos_token_id")
        return cls(
            vocab_size=d.get("vocab_size", 201088),
            hidden_size=hidden,
            intermediate_size=d.get("intermediate_size", 2880),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads if kv_heads is None else kv_heads,
            head_dim=hidden // heads if head_dim is None else head_dim,
            num_local_experts=experts,
            num_experts_per_tok=top_k,
            sliding_window=d.get("sliding_window", 128),
            layer_types=tuple(d.get("layer_types") or default_layer_types(layers)),
            rope_theta=float(theta),
            rope_scaling=rope,
            max_position_embeddings=max_pos,
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            attention_bias=bool(d.get("attention_bias", True)),
            swiglu_limit=float(d.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
            router_aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=d.get("pad_token_id"),
        )

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict that transformers 5 loads to the same model (never a quantization_config:
        save_pretrained writes float experts)."""
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {
            "architectures": [ARCHITECTURE],
            "model_type": MODEL_TYPE,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_local_experts": self.num_local_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types),
            "rope_parameters": {**dict(self.rope_scaling), "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "swiglu_limit": self.swiglu_limit,
            "swiglu_alpha": self.swiglu_alpha,
            "router_aux_loss_coef": self.router_aux_loss_coef,
            "output_router_logits": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",  # unused by the experts; written like transformers does
            "initializer_range": 0.02,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "dtype": dtype,
        }


_PUBLISHED = dict(  # published configs; eos 200002 = <|return|> is from memory of the released config.json
    vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
    head_dim=64, num_experts_per_tok=4, sliding_window=128, rope_theta=150000.0, rope_scaling=DEFAULT_YARN,
    max_position_embeddings=131072, rms_norm_eps=1e-5, attention_bias=True, swiglu_limit=7.0, swiglu_alpha=1.702,
    tie_word_embeddings=False, pad_token_id=199999, eos_token_id=200002,
)


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------


class GptOss(DecoderLM):
    """embed -> L × (sink attention, sliding on even layers + top-k MoE) -> RMSNorm -> LM head.

    The three kinds of RMSNorm keep fp32 weights and multiply in fp32 before the cast
    (transformers `_keep_in_fp32_modules`), whatever `param_dtype` is.
    """

    def __init__(self, config: GptOssConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32):
        c = config
        D, E = c.hidden_size, c.num_local_experts
        super().__init__(config, lambda kw: [
            DecoderLayer(
                GQAttention(hidden_size=D, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
                            head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, qkv_bias=c.attention_bias,
                            o_bias=c.attention_bias, sinks=True, **kw),
                MoE(Router(D, E, c.num_experts_per_tok, scoring="softmax_topk", use_bias=True, **kw),
                    Experts(E, D, c.intermediate_size, activation="gpt_oss", use_bias=True, hf_layout="gpt_oss",
                            alpha=c.swiglu_alpha, limit=c.swiglu_limit, **kw),
                    router_name="router"),
                hidden_size=D, rms_norm_eps=c.rms_norm_eps, param_dtype=jnp.float32, window=c.layer_window(i),
                norm_weight_in_fp32=True)
            for i in range(c.num_hidden_layers)
        ], rngs=rngs, dtype=dtype, param_dtype=param_dtype, norm_weight_in_fp32=True)

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """cos, sin [B, T, H] (YaRN: both × the attention factor), shared by every layer."""
        c = self.config
        inv_freq, attention_scaling = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling,
                                                       c.max_position_embeddings)
        return rope_cos_sin(positions, inv_freq, self.dtype, attention_scaling)


# the registry record (models/families.py): HF architecture -> the config.json model_types it ships with
REGISTRY = {"GptOssForCausalLM": ("gpt_oss",)}
FAMILY = (GptOssConfig, GptOss)
