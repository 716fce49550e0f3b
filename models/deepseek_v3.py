"""DeepSeek-V3 / R1 (and V3-0324, V3.1) and Kimi K2 in Flax NNX, numerically matching transformers 5.24
`DeepseekV3ForCausalLM`.

Mirrors docs/models/deepseek-v3.md (config, MLA, interleaved RoPE, softmax scale with the YaRN mscale²,
absorbed decode form, sigmoid group-limited router, shared experts, dense first layers, MTP layout, FP8 block
weights, on-disk tensors, Kimi K2: the same graph with other hyper-parameters, `model_type: kimi_k2`,
pitfalls), docs/models/decoder.md (YaRN, parity conventions); the parity authority is transformers
`models/deepseek_v3/modeling_deepseek_v3.py` and `configuration_deepseek_v3.py`.

Module attribute names mirror the HF tensor names (models/hf.py maps them structurally):
`layers.{i}.self_attn.{q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa, kv_a_layernorm,
kv_b_proj, o_proj}`, dense `layers.{i}.mlp.{gate,up,down}_proj` for i < first_k_dense_replace, else
`layers.{i}.mlp.gate.{weight, e_score_correction_bias}`, `layers.{i}.mlp.experts.{e}.{gate,up,down}_proj`
and `layers.{i}.mlp.shared_experts.*`. MTP layers follow the main stack at `layers.{L + m}` (models/decoder.py
`MTPLayer`). Published FP8 checkpoints (`weight_scale_inv`) are dequantized on load by models/quant/formats/.

MLA (multi-head latent attention), per token:
    q        = q_b_proj(q_a_layernorm(q_a_proj(x)))  (or q_proj(x))        -> N × (P nope | R rope)
    [c, k_r] = kv_a_proj_with_mqa(x);  c = kv_a_layernorm(c)               -> latent C, one shared rope key R
    [k_n, v] = kv_b_proj(c)                                                  -> N × (P | Vd)
    scores   = [q_n, rope(q_r)] · [k_n, rope(k_r)] · qk_head_dim^-0.5 · mscale²
Without a cache (training, prefill, verify-free scoring) the keys and values are expanded per head. With a
KV cache the cache holds only c (cache.k, [L, B, 1, S, C]) and rope(k_r) (cache.v, [L, B, 1, S, R]) and the
attention runs in latent space (the absorbed form): W_UK is folded into the query, softmax over [c, k_r], W_UV applied
after — the same logits up to matmul reassociation.

    from models.deepseek_v3 import DeepseekV3, DeepseekV3Config
    model = DeepseekV3(DeepseekV3Config.tiny(), rngs=nnx.Rngs(0))
    logits = model(jnp.zeros((2, 8), jnp.int32))                       # [B, T, V]

Shape legend: B batch, T length, S cache length, D model, N heads, P qk_nope_head_dim, R qk_rope_head_dim,
Vd v_head_dim, C kv_lora_rank, Q q_lora_rank, E routed experts, k experts per token, I expert width,
F dense ffn width, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import flax.core
import jax
import jax.numpy as jnp
from flax import nnx

from models.decoder import Context, DecoderLayer, DecoderLM, MTPLayer
from models.flops import LayerFlops, routed_ffn, swiglu
from models.generate import KVCache
from models.layers import (
    MLP,
    Linear,
    RMSNorm,
    apply_rope,
    attention,
    rope_config_from_hf,
    rope_cos_sin,
    rope_frequencies,
)
from models.moe import MoE, sigmoid_moe

ARCHITECTURE = "DeepseekV3ForCausalLM"
# the registry record (models/families.py): HF architecture -> the config.json model_types it ships with
# (kimi_k2: the same graph; transformers only knows deepseek_v3)
REGISTRY = {"DeepseekV3ForCausalLM": ("deepseek_v3", "kimi_k2")}
MODEL_TYPES = REGISTRY[ARCHITECTURE]
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")
LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps
REQUIRED_ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}  # defaults when absent (transformers 5)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """0.1 · mscale · ln(scale) + 1 for scale > 1, else 1 (transformers `yarn_get_mscale`)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
    """Class defaults are transformers 5.24's `DeepseekV3Config` defaults (the 671B shapes, no YaRN,
    max_position_embeddings 4096); the published checkpoints are the presets below."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432  # dense layers (i < first_k_dense_replace)
    moe_intermediate_size: int = 2048  # per routed expert; shared experts are n_shared_experts times wider
    num_hidden_layers: int = 61  # main stack, without the MTP layers
    num_attention_heads: int = 128
    num_key_value_heads: int | None = None  # nominal for MLA; None -> num_attention_heads
    q_lora_rank: int | None = 1536  # None: one q_proj instead of q_a_proj / q_a_layernorm / q_b_proj
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 3
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Mapping[str, Any] | None = None  # None (plain RoPE) or {"rope_type": "yarn", "factor": ...}
    rope_interleave: bool = True  # rotary coordinates stored as adjacent pairs
    max_position_embeddings: int = 4096
    attention_bias: bool = False  # q_a_proj / kv_a_proj_with_mqa / o_proj biases
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1
    pad_token_id: int | None = None
    num_nextn_predict_layers: int = 1  # MTP layers the config declares
    num_mtp_layers: int | None = None  # MTP layers actually built; None -> num_nextn_predict_layers
    model_type: str = "deepseek_v3"  # or "kimi_k2"
    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES  # the model_type values this config class accepts

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)
        if self.num_key_value_heads is None:
            set_("num_key_value_heads", self.num_attention_heads)
        if self.num_mtp_layers is None:
            set_("num_mtp_layers", self.num_nextn_predict_layers)
        if self.rope_scaling is not None:  # hashable, so that the config can live in a graphdef
            set_("rope_scaling", flax.core.FrozenDict(self.rope_scaling))
        if isinstance(self.eos_token_id, Sequence):
            set_("eos_token_id", tuple(int(e) for e in self.eos_token_id))
        if self.model_type not in self.model_types:
            raise ValueError(f"model_type {self.model_type!r} (known: {', '.join(self.model_types)})")
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even for rotary embeddings")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank {self.q_lora_rank} (a positive rank, or None for a plain q_proj)")
        if self.n_routed_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"n_group {self.n_group} / topk_group {self.topk_group} do not fit "
                             f"{self.n_routed_experts} experts")
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise ValueError("group-limited routing scores each group by its top-2 experts: "
                             f"{self.n_routed_experts} experts in {self.n_group} groups is too few")
        if not 1 <= self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} with {self.n_routed_experts} experts")
        if self.num_mtp_layers < 0 or self.num_nextn_predict_layers < 0:
            raise ValueError("num_nextn_predict_layers / num_mtp_layers must be >= 0")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise NotImplementedError(f"rope_type {rope_type!r} (supported: {SUPPORTED_ROPE_TYPES})")

    # -- derived ---------------------------------------------------------------------------------

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key width P + R (192 for V3)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_type(self) -> str:
        return "default" if self.rope_scaling is None else self.rope_scaling.get("rope_type", "default")

    @property
    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5, × mscale(factor, mscale_all_dim)² when the RoPE is scaled and mscale_all_dim is
        set (transformers `yarn_apply_mscale`). V3: 0.1352338; K2: 0.1308608; K2-0905: 0.1446796."""
        scale = self.qk_head_dim**-0.5
        p = self.rope_scaling or {}
        if self.rope_type != "default" and p.get("mscale_all_dim"):
            factor = p.get("factor")
            if factor is None:  # DeepSeek-style: the extended / pretraining length ratio
                factor = self.max_position_embeddings / p["original_max_position_embeddings"]
            m = yarn_mscale(float(factor), float(p["mscale_all_dim"]))
            scale = scale * m * m
        return scale

    def is_moe_layer(self, i: int) -> bool:
        """Main-stack layer i uses the MoE block (the first `first_k_dense_replace` are dense); MTP layers
        are always MoE."""
        return i >= self.first_k_dense_replace

    def kv_cache_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """What the KV cache holds per token per layer: k = the normalised latent (1 × C), v = the rotated
        shared rope key (1 × R) — 576 values for V3 instead of N·(P+R+Vd) = 40960."""
        return (1, self.kv_lora_rank), (1, self.qk_rope_head_dim)

    def for_checkpoint(self, tensor_names: set[str]) -> DeepseekV3Config:
        """This config with `num_mtp_layers` = the MTP layers the files actually hold (consecutive layers
        from num_hidden_layers with an `enorm`): transformers writes num_nextn_predict_layers 1 and no MTP
        tensors, published V3/R1 checkpoints hold layer 61."""
        L, m = self.num_hidden_layers, 0
        while f"model.layers.{L + m}.enorm.weight" in tensor_names:
            m += 1
        return self if m == self.num_mtp_layers else dataclasses.replace(self, num_mtp_layers=m)

    # -- presets ---------------------------------------------------------------------------------

    def layer_flops(self) -> list[LayerFlops]:
        """Per-layer cost of a token (models/flops.py): MLA in its expanded (training) form -- q through
        the optional q_lora_rank bottleneck, the kv latent and the shared rope key, k_nope/v up-projections,
        o -- then dense SwiGLU in the first `first_k_dense_replace` layers, a routed MoE with shared experts
        after."""
        D, N, P, R, Vd, C, Q = (self.hidden_size, self.num_attention_heads, self.qk_nope_head_dim,
                                self.qk_rope_head_dim, self.v_head_dim, self.kv_lora_rank, self.q_lora_rank)
        q_proj = D * N * (P + R) if Q is None else D * Q + Q * N * (P + R)
        attn = q_proj + D * (C + R) + C * N * (P + Vd) + N * Vd * D
        moe = routed_ffn(self, self.n_routed_experts, self.moe_intermediate_size, self.n_shared_experts)
        dense = swiglu(D, self.intermediate_size)
        return [LayerFlops(attn + (moe if self.is_moe_layer(i) else dense), N * (P + R), N * Vd, None)
                for i in range(self.num_hidden_layers)]

    @classmethod
    def tiny(cls, vocab_size: int = 256, **overrides: Any) -> DeepseekV3Config:
        """3 layers (1 dense + 2 MoE) of width 64, 4 heads with q_lora 32 / kv_lora 16 / nope 16 / rope 8 /
        v 16, 8 experts of 32 in 4 groups (top-2 groups, top-2 experts), 1 shared expert, no MTP."""
        kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=160, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, q_lora_rank=32, kv_lora_rank=16,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                  num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                  max_position_embeddings=256, num_nextn_predict_layers=0)
        return cls(**{**kw, **overrides})

    @classmethod
    def deepseek_v3(cls, **overrides: Any) -> DeepseekV3Config:
        """deepseek-ai/DeepSeek-V3 (and R1, V3-0324, V3.1: the same graph) as published."""
        kw = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                  num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
                  kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                  n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
                  routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=3, rms_norm_eps=1e-6,
                  rope_theta=10000.0, max_position_embeddings=163840,
                  rope_scaling={"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096},
                  attention_bias=False, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                  num_nextn_predict_layers=1, model_type="deepseek_v3")
        return cls(**{**kw, **overrides})

    deepseek_r1 = deepseek_v3

    @classmethod
    def kimi_k2(cls, **overrides: Any) -> DeepseekV3Config:
        """moonshotai/Kimi-K2-Instruct: 384 experts, 64 heads, no group routing, scaling 2.827, one dense
        layer, theta 5e4, YaRN ×32 with beta_fast = beta_slow = 1, no MTP. Token ids and eps [memory]."""
        kw = dict(vocab_size=163840, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
                  n_group=1, topk_group=1, routed_scaling_factor=2.827, first_k_dense_replace=1,
                  rope_theta=50000.0, max_position_embeddings=131072,
                  rope_scaling={"rope_type": "yarn", "factor": 32.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                "beta_fast": 1.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096},
                  bos_token_id=163584, eos_token_id=163585, num_nextn_predict_layers=0, model_type="kimi_k2")
        return cls.deepseek_v3(**{**kw, **overrides})

    @classmethod
    def kimi_k2_0905(cls, **overrides: Any) -> DeepseekV3Config:
        """moonshotai/Kimi-K2-Instruct-0905 (256K context): K2 with YaRN ×64. eos_token_id [memory]."""
        base = cls.kimi_k2()
        kw = dict(max_position_embeddings=262144, eos_token_id=163586,
                  rope_scaling={**dict(base.rope_scaling), "factor": 64.0})
        return cls.kimi_k2(**{**kw, **overrides})

    # -- HF config.json --------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> DeepseekV3Config:
        """Build from a config.json dict in the transformers-5 or the legacy (Hub / remote-code) spelling
        (docs/formats/hf-checkpoint.md): rope_parameters or rope_theta + rope_scaling, dtype or torch_dtype,
        num_nextn_predict_layers or num_mtp_layers, absent topk_method / scoring_func (defaulted to noaux_tc /
        sigmoid)."""
        archs = d.get("architectures") or [ARCHITECTURE]
        if ARCHITECTURE not in archs:
            raise ValueError(f"config.json: architectures {archs} is not {ARCHITECTURE}")
        model_type = d.get("model_type") or "deepseek_v3"
        if model_type not in MODEL_TYPES:
            raise ValueError(f"config.json: model_type {model_type!r} (supported: {', '.join(MODEL_TYPES)})")
        return cls(**cls.fields_from_hf(d), model_type=model_type)

    @classmethod
    def fields_from_hf(cls, d: Mapping[str, Any]) -> dict[str, Any]:
        """The DeepSeek-V3 fields of a config.json dict (both spellings; `cls`'s defaults where a key is absent),
        after refusing the routing, activation and MoE-frequency values this graph does not implement."""
        for field, want in REQUIRED_ROUTING.items():
            if d.get(field) not in (None, want):
                raise NotImplementedError(f"config.json: {field} {d[field]!r} is not supported (only {want!r})")
        if d.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"config.json: hidden_act {d['hidden_act']!r} (only silu)")
        if d.get("moe_layer_freq", 1) != 1:
            raise NotImplementedError(f"config.json: moe_layer_freq {d['moe_layer_freq']!r} (only 1)")
        theta, _, scaling = rope_config_from_hf(d)
        heads = d.get("num_attention_heads", cls.num_attention_heads)
        nextn = d.get("num_nextn_predict_layers", d.get("num_mtp_layers", cls.num_nextn_predict_layers))

        def get(name: str, if_null: Any = None) -> Any:  # the transformers class default when absent
            value = d.get(name, getattr(cls, name))
            return if_null if value is None and if_null is not None else value

        return dict(
            vocab_size=get("vocab_size"),
            hidden_size=get("hidden_size"),
            intermediate_size=get("intermediate_size"),
            moe_intermediate_size=get("moe_intermediate_size"),
            num_hidden_layers=get("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            q_lora_rank=d.get("q_lora_rank", cls.q_lora_rank),
            kv_lora_rank=get("kv_lora_rank"),
            qk_nope_head_dim=get("qk_nope_head_dim"),
            qk_rope_head_dim=get("qk_rope_head_dim"),
            v_head_dim=d.get("v_head_dim") or cls.v_head_dim,
            n_routed_experts=d.get("n_routed_experts") or d.get("num_local_experts") or cls.n_routed_experts,
            n_shared_experts=get("n_shared_experts", 0),
            num_experts_per_tok=get("num_experts_per_tok", cls.num_experts_per_tok),
            n_group=get("n_group", 1),
            topk_group=get("topk_group", 1),
            routed_scaling_factor=float(get("routed_scaling_factor")),
            norm_topk_prob=bool(get("norm_topk_prob", False)),
            first_k_dense_replace=get("first_k_dense_replace", 0),
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=float(theta),
            rope_scaling=scaling,
            rope_interleave=bool(get("rope_interleave", True)),
            max_position_embeddings=get("max_position_embeddings"),
            attention_bias=bool(get("attention_bias")),
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            bos_token_id=get("bos_token_id"),
            eos_token_id=get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            num_nextn_predict_layers=int(nextn or 0),
        )

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict that transformers 5 AutoConfig / AutoModelForCausalLM load into the same model.

        `num_nextn_predict_layers` is the number of MTP layers this model holds (and save_pretrained writes);
        `topk_method` / `scoring_func` are written for the readers that need them (vLLM, remote code).
        `model_type` is always "deepseek_v3": transformers has no `kimi_k2` config class (the Hub's Kimi
        checkpoints use remote code), and the graph is the same."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope = {**dict(self.rope_scaling), "rope_theta": self.rope_theta}
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "deepseek_v3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "qk_head_dim": self.qk_head_dim,
            "head_dim": self.qk_rope_head_dim,  # what transformers derives (the rotary width), not a head width
            "v_head_dim": self.v_head_dim,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob,
            "first_k_dense_replace": self.first_k_dense_replace,
            "topk_method": REQUIRED_ROUTING["topk_method"],
            "scoring_func": REQUIRED_ROUTING["scoring_func"],
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "rope_interleave": self.rope_interleave,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "num_nextn_predict_layers": self.num_mtp_layers,
            "initializer_range": 0.02,
            "pretraining_tp": 1,
            "output_router_logits": False,
            "use_cache": True,
            "dtype": dtype,
        }


# ------------------------------------------------------------------------------------------------
# Multi-head latent attention
# ------------------------------------------------------------------------------------------------


def rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate adjacent pairs (x0, x1), (x2, x3), ... of x [B, T, N, R] by one frequency each and return
    them de-interleaved (rotated evens, then rotated odds), as transformers 5.24
    `apply_rotary_pos_emb_interleave` does; applied to q and k alike, q·k is the upstream rotation."""
    x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)  # [B, T, N, R] pairs -> halves
    return apply_rope(x, cos, sin)


class MLAttention(nnx.Module):
    """DeepSeek MLA: expanded per-head K/V without a cache, latent-space (absorbed) attention
    with a cache that stores the normalised latent and the rotated shared rope key."""

    def __init__(self, config: DeepseekV3Config, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        c = config
        D, N, Q, C = c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
        P, R, Vd = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.num_heads, self.nope_dim, self.rope_dim, self.v_dim, self.kv_lora_rank = N, P, R, Vd, C
        self.interleave = c.rope_interleave
        self.scale = c.softmax_scale
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        norm = dict(eps=LATENT_NORM_EPS, param_dtype=param_dtype)
        if Q is None:
            self.q_proj = Linear(D, N * (P + R), axes=("embed", "heads"), **kw)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = nnx.data(None)
        else:
            self.q_proj = nnx.data(None)
            self.q_a_proj = Linear(D, Q, axes=("embed", "q_lora"), use_bias=c.attention_bias, **kw)
            self.q_a_layernorm = RMSNorm(Q, axis_name="q_lora", **norm)
            self.q_b_proj = Linear(Q, N * (P + R), axes=("q_lora", "heads"), **kw)
        self.kv_a_proj_with_mqa = Linear(D, C + R, axes=("embed", "kv_lora"), use_bias=c.attention_bias, **kw)
        self.kv_a_layernorm = RMSNorm(C, axis_name="kv_lora", **norm)
        self.kv_b_proj = Linear(C, N * (P + Vd), axes=("kv_lora", "heads"), **kw)
        self.o_proj = Linear(N * Vd, D, axes=("heads", "embed"), use_bias=c.attention_bias, **kw)

    def rotate(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        return rope_interleaved(x, cos, sin) if self.interleave else apply_rope(x, cos, sin)

    def project(self, x: jax.Array, ctx: Context) -> tuple[jax.Array | None, jax.Array, jax.Array, jax.Array,
                                                           jax.Array]:
        """x [B, T, D] -> (q latent [B, T, Q] (None with a plain q_proj), q_nope [B, T, N, P], rotated q_rot
        [B, T, N, R], normed kv latent [B, T, C], rotated shared rope key [B, T, 1, R])."""
        B, T, _ = x.shape
        N, P, R, C = self.num_heads, self.nope_dim, self.rope_dim, self.kv_lora_rank
        if self.q_proj is not None:
            q_latent, q = None, self.q_proj(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))  # [B, T, Q]
            q = self.q_b_proj(q_latent)
        q = q.reshape(B, T, N, P + R)  # [B, T, N, P+R]
        ckv = self.kv_a_proj_with_mqa(x)  # [B, T, C+R]
        latent = self.kv_a_layernorm(ckv[..., :C])  # [B, T, C]
        k_rot = ckv[..., C:][:, :, None, :]  # [B, T, 1, R]: one rope key shared by every head, not normalised
        cos, sin = ctx.rope
        return q_latent, q[..., :P], self.rotate(q[..., P:], cos, sin), latent, self.rotate(k_rot, cos, sin)

    def expand(self, q_nope: jax.Array, q_rot: jax.Array, latent: jax.Array, k_rot: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Per-head queries, keys and values from this call's latent: (q [B, T, N, P+R], k [B, T, N, P+R],
        v [B, T, N, Vd])."""
        B, T, N, P = q_nope.shape
        R, Vd = self.rope_dim, self.v_dim
        kv = self.kv_b_proj(latent).reshape(B, T, N, P + Vd)  # [B, T, N, P+Vd]
        k = jnp.concatenate([kv[..., :P], jnp.broadcast_to(k_rot, (B, T, N, R))], axis=-1)  # [B, T, N, P+R]
        q = jnp.concatenate([q_nope, q_rot], axis=-1)  # [B, T, N, P+R]
        return q, k, kv[..., P:]

    def expanded(self, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, causal: bool) -> jax.Array:
        """Attention over `expand`'s per-head q, k, v (no cache): [B, T, N, Vd]."""
        return attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask, causal=causal,
                         scale=self.scale)  # [B, T, N, Vd]

    def absorbed(self, q_nope: jax.Array, q_rot: jax.Array, c_kv: jax.Array, k_pe: jax.Array,
                 mask: jax.Array) -> jax.Array:
        """Latent-space attention over the cached latent c_kv [B, 1, S, C] and rope keys k_pe [B, 1, S, R]
        (one shared "kv head"), W_UK folded into the query and W_UV applied after: [B, T, N, Vd]."""
        N, P, Vd, C = self.num_heads, self.nope_dim, self.v_dim, self.kv_lora_rank
        w = self.kv_b_proj.weight().astype(q_nope.dtype).reshape(C, N, P + Vd)  # [C, N, P+Vd]
        q_lat = jnp.einsum("btnp,cnp->btnc", q_nope, w[..., :P])  # [B, T, N, C]
        qa = jnp.concatenate([q_lat, q_rot.astype(q_lat.dtype)], axis=-1)  # [B, T, N, C+R]
        ka = jnp.concatenate([c_kv, k_pe], axis=-1).astype(qa.dtype)  # [B, 1, S, C+R]
        o_lat = attention(qa, ka, c_kv.astype(qa.dtype), mask, causal=False, scale=self.scale)  # [B, T, N, C]
        return jnp.einsum("btnc,cnv->btnv", o_lat, w[..., P:])  # [B, T, N, Vd]

    def __call__(
        self, x: jax.Array, ctx: Context, cache: KVCache | None, layer: int, window: int | None = None
    ) -> tuple[jax.Array, KVCache | None]:
        B, T, _ = x.shape
        _, q_nope, q_rot, latent, k_rot = self.project(x, ctx)
        mask = ctx.mask(window)
        if cache is None:  # expanded: per-head keys and values from the latent
            out = self.expanded(*self.expand(q_nope, q_rot, latent, k_rot), mask, ctx.causal)
        else:  # absorbed: the cache holds the latent and the rope key
            cache = cache.write(layer, ctx.slots, latent[:, :, None, :], k_rot)
            out = self.absorbed(q_nope, q_rot, cache.k[layer], cache.v[layer], mask)
        return self.o_proj(out.reshape(B, T, self.num_heads * self.v_dim)), cache


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------


def moe_block(c: DeepseekV3Config, kw: dict[str, Any]) -> MoE:
    """Sigmoid group-limited router `gate` + E per-expert SwiGLUs + the shared SwiGLU."""
    return sigmoid_moe(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                       c.n_shared_experts, n_group=c.n_group, topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
                       routed_scaling_factor=c.routed_scaling_factor, **kw)


class DeepseekV3(DecoderLM):
    """embed -> L × (MLA + dense SwiGLU or MoE) -> RMSNorm -> LM head, then `num_mtp_layers` MTP layers."""

    attention_cls: type[nnx.Module] = MLAttention  # every layer's attention block (DeepSeek-V3.2: MLA + DSA)

    def __init__(self, config: DeepseekV3Config, *, rngs: nnx.Rngs, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32):
        c = config
        D, eps = c.hidden_size, c.rms_norm_eps

        attn, L = type(self).attention_block, c.num_hidden_layers

        def build_layers(kw: dict[str, Any]) -> list[nnx.Module]:
            main = [DecoderLayer(attn(c, i, kw),
                                 moe_block(c, kw) if c.is_moe_layer(i) else MLP(D, c.intermediate_size, **kw),
                                 hidden_size=D, rms_norm_eps=eps, param_dtype=param_dtype)
                    for i in range(L)]
            return main + [MTPLayer(attn(c, L + m, kw), moe_block(c, kw), hidden_size=D, rms_norm_eps=eps, **kw)
                           for m in range(c.num_mtp_layers)]

        super().__init__(config, build_layers, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    @classmethod
    def attention_block(cls, config: DeepseekV3Config, layer: int, kw: dict[str, Any]) -> nnx.Module:
        """Layer `layer`'s attention block (MTP layers from num_hidden_layers on): `attention_cls` for every
        layer here; GLM-5 picks a full or a shared DSA block per layer."""
        return cls.attention_cls(config, **kw)

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """cos, sin [B, T, R] for the rope slice of q and k, × the YaRN attention factor (1 when mscale ==
        mscale_all_dim, as for every published checkpoint: the temperature is in `softmax_scale`)."""
        c = self.config
        inv_freq, attention_scaling = rope_frequencies(c.qk_rope_head_dim, c.rope_theta, c.rope_scaling,
                                                       c.max_position_embeddings)
        return rope_cos_sin(positions, inv_freq, self.dtype, attention_scaling)


FAMILY = (DeepseekV3Config, DeepseekV3)  # registered by REGISTRY, at the top
