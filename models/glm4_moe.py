"""GLM-4.5 (355B-A32B) and GLM-4.5-Air (106B-A12B), transformers' `glm4_moe`: GQA attention with
q/k/v biases (no o bias), optional per-head QK-norm, partial NeoX RoPE on the first half of each
head, DeepSeek-style sigmoid-routed MoE with a shared expert, and MTP (NextN) layers kept after the
main stack.

Mirrors docs/models/glm4-moe.md (config, attention, MoE, MTP, tensors), docs/models/decoder.md,
docs/models/deepseek-v3.md (the router, the MTP layer) and transformers 5.24.0
`models/glm4_moe/modeling_glm4_moe.py` / `configuration_glm4_moe.py`, which define parity:

* rotary dim d = int(head_dim · partial_rotary_factor) (0.5 -> 64 of 128): inv_freq over d (not
  head_dim), cos/sin [B, T, d], the first d dims of each head rotate (NeoX halves of d/2), the rest
  pass through (`apply_rotary_pos_emb` there; `layers.apply_rope` here);
* QK-norm (GLM-4.5, not Air) before RoPE; layers i < first_k_dense_replace are dense SwiGLU;
* router `mlp.gate.weight` [E, D] + `mlp.gate.e_score_correction_bias` [E] (fp32): sigmoid, biased
  choice, group-limited top-k (group score = sum of its top-2), weights from the unbiased sigmoid,
  renormalised (+1e-20) iff norm_topk_prob, × routed_scaling_factor; plus `mlp.shared_experts`, a
  SwiGLU of width moe_intermediate_size · n_shared_experts, on every token;
* `head_dim` is REQUIRED in config.json: transformers' fallback hidden/heads is wrong for both
  published models (5120/96 = 53, 4096/96 = 42; they use 128);
* MTP layers sit at `model.layers.{num_hidden_layers + m}` (`enorm`, `hnorm`, `eh_proj`,
  `shared_head.norm`, copies of the embedding / LM head, and a full attention + MoE block);
  transformers' main model ignores them. `Glm4MoeConfig.for_checkpoint` sizes them to the files.

    from models.glm4_moe import Glm4Moe, Glm4MoeConfig
    model = Glm4Moe(Glm4MoeConfig.tiny(), rngs=nnx.Rngs(0))
    logits = model(jnp.zeros((2, 8), jnp.int32))                      # [B, T, V]

Shape legend: B batch, T length, D model, N heads, K kv heads, H head dim, d rotary dims, F dense
FFN width, E routed experts, k experts per token, I expert width, G router groups, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import flax.core
import jax
import jax.numpy as jnp
from flax import nnx

from models.decoder import DecoderLayer, DecoderLM, GQAttention, MTPLayer
from models.flops import LayerFlops, gqa_layer, routed_ffn, swiglu
from models.layers import MLP, rope_config_from_hf, rope_cos_sin, rope_frequencies
from models.moe import sigmoid_moe

ARCHITECTURE = "Glm4MoeForCausalLM"
MODEL_TYPE = "glm4_moe"
DEFAULT_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta
DEFAULT_PARTIAL_ROTARY = 0.5  # Glm4MoeConfig.__post_init__
ENORM = re.compile(r"model\.layers\.(\d+)\.enorm\.weight")


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Glm4MoeConfig:
    """Field names and class defaults are transformers 5.24.0 `Glm4MoeConfig`'s (which mirror
    GLM-4.5-Air, with `attention_bias` false) plus `head_dim` (128, both published models; required
    by `from_hf`). `num_nextn_predict_layers` is what config.json declares; `num_mtp_layers` is how
    many MTP layers this model builds (0 unless set, e.g. by `for_checkpoint`)."""

    vocab_size: int = 151552
    hidden_size: int = 4096
    intermediate_size: int = 10944  # dense layers (i < first_k_dense_replace)
    moe_intermediate_size: int = 1408  # routed experts and (× n_shared_experts) the shared expert
    num_hidden_layers: int = 46
    num_attention_heads: int = 96
    num_key_value_heads: int = 8
    head_dim: int = 128
    partial_rotary_factor: float = DEFAULT_PARTIAL_ROTARY
    attention_bias: bool = False  # q/k/v biases (o_proj never has one)
    use_qk_norm: bool = False
    n_routed_experts: int = 128
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 1
    rms_norm_eps: float = 1e-5
    rope_theta: float = DEFAULT_THETA
    rope_scaling: Mapping[str, Any] | None = None  # None (default RoPE) or {"rope_type": "yarn", ...}
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 1
    num_mtp_layers: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)
        if self.rope_scaling is not None:  # hashable, so that the config can live in a graphdef
            set_("rope_scaling", flax.core.FrozenDict(self.rope_scaling))
        if isinstance(self.eos_token_id, Sequence):
            set_("eos_token_id", tuple(int(e) for e in self.eos_token_id))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        d = self.rotary_dim
        if not 0 < d <= self.head_dim or d % 2:
            raise ValueError(f"rotary dim {d} (head_dim {self.head_dim} × partial_rotary_factor "
                             f"{self.partial_rotary_factor}) must be even and in (0, head_dim]")
        if self.n_routed_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"n_group {self.n_group} / topk_group {self.topk_group} do not fit "
                             f"{self.n_routed_experts} experts")
        if self.num_mtp_layers < 0:
            raise ValueError(f"num_mtp_layers must be >= 0 (got {self.num_mtp_layers})")

    @property
    def rotary_dim(self) -> int:
        """Rotated dims per head: int(head_dim · partial_rotary_factor), as transformers computes it."""
        return int(self.head_dim * self.partial_rotary_factor)

    def is_moe_layer(self, i: int) -> bool:
        """Main-stack layer i is MoE iff i >= first_k_dense_replace (MTP layers always are)."""
        return i >= self.first_k_dense_replace

    def for_checkpoint(self, tensor_names: Iterable[str]) -> Glm4MoeConfig:
        """This config with `num_mtp_layers` = the MTP layers the files hold: layers at index >=
        num_hidden_layers with an `enorm` tensor (found by name, never a hard-coded 92 / 46).
        They must be consecutive from num_hidden_layers."""
        L = self.num_hidden_layers
        found = sorted({int(m.group(1)) for n in tensor_names if (m := ENORM.fullmatch(n)) and int(m.group(1)) >= L})
        if found != list(range(L, L + len(found))):
            raise ValueError(f"MTP layers (tensors with an enorm) at {found}: expected consecutive layers from "
                             f"num_hidden_layers={L}")
        return dataclasses.replace(self, num_mtp_layers=len(found))

    # -- presets ---------------------------------------------------------------------------------

    def layer_flops(self) -> list[LayerFlops]:
        """Per-layer cost of a token (models/flops.py): GQA attention; dense SwiGLU in the first
        `first_k_dense_replace` layers, then a sigmoid-routed MoE with the shared expert."""
        moe = routed_ffn(self, self.n_routed_experts, self.moe_intermediate_size, self.n_shared_experts)
        dense = swiglu(self.hidden_size, self.intermediate_size)
        return [gqa_layer(self, moe if self.is_moe_layer(i) else dense) for i in range(self.num_hidden_layers)]

    @classmethod
    def tiny(cls, vocab_size: int = 256, **overrides: Any) -> Glm4MoeConfig:
        """3 layers (layer 0 dense), D 64, 4 heads / 2 kv heads of 32 (≠ D/N) with rotary dim 16, q/k/v
        biases, QK-norm, 8 experts of 32 in 2 groups (1 kept), top-2, 1 shared expert, scaling 2.5."""
        kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  attention_bias=True, use_qk_norm=True, n_routed_experts=8, n_shared_experts=1,
                  num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                  first_k_dense_replace=1, rope_theta=1e6, max_position_embeddings=512, num_nextn_predict_layers=0)
        return cls(**{**kw, **overrides})

    @classmethod
    def glm4_5(cls, **overrides: Any) -> Glm4MoeConfig:
        """zai-org/GLM-4.5 (355B-A32B): 92 layers (3 dense), D 5120, F 12288, 96/8 heads of 128,
        160 experts of 1536 + 1 shared, top-8, scaling 2.5, QK-norm, MTP layer 92 (built: 0 until
        `for_checkpoint` or an override). eos/pad: memory of the Hub config.json [unverified]."""
        kw = dict(vocab_size=151552, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536,
                  num_hidden_layers=92, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                  partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, n_routed_experts=160,
                  n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, norm_topk_prob=True,
                  routed_scaling_factor=2.5, first_k_dense_replace=3, rms_norm_eps=1e-5, rope_theta=1e6,
                  max_position_embeddings=131072, num_nextn_predict_layers=1,
                  eos_token_id=(151329, 151336, 151338), pad_token_id=151329)
        return cls(**{**kw, **overrides})

    @classmethod
    def glm4_5_air(cls, **overrides: Any) -> Glm4MoeConfig:
        """zai-org/GLM-4.5-Air (106B-A12B): 46 layers (1 dense), D 4096, F 10944, 96/8 heads of 128,
        128 experts of 1408 + 1 shared, top-8, scaling 1.0, no QK-norm, MTP layer 46. eos/pad as GLM-4.5
        [unverified]."""
        kw = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                  num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                  partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False, n_routed_experts=128,
                  n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, norm_topk_prob=True,
                  routed_scaling_factor=1.0, first_k_dense_replace=1, rms_norm_eps=1e-5, rope_theta=1e6,
                  max_position_embeddings=131072, num_nextn_predict_layers=1,
                  eos_token_id=(151329, 151336, 151338), pad_token_id=151329)
        return cls(**{**kw, **overrides})

    # -- HF config.json --------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> Glm4MoeConfig:
        """Build from a config.json dict in the transformers-5 or the legacy spelling.
        `num_mtp_layers` stays 0: from_pretrained sizes it with `for_checkpoint`."""
        archs = d.get("architectures") or [ARCHITECTURE if d.get("model_type") == MODEL_TYPE else ""]
        if archs[0] != ARCHITECTURE:
            raise ValueError(f"config.json: architecture {archs[0]!r} is not {ARCHITECTURE}")
        if not d.get("head_dim"):
            raise ValueError("config.json: GLM-4.5 (glm4_moe) needs head_dim (hidden_size // num_attention_heads "
                             "is wrong for the published models)")
        if d.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"config.json: hidden_act {d['hidden_act']!r} (only silu)")
        theta, partial, scaling = rope_config_from_hf(d, default_theta=DEFAULT_THETA)
        partial = DEFAULT_PARTIAL_ROTARY if partial is None else partial
        nextn = d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 1))
        return cls(
            vocab_size=d.get("vocab_size", 151552),
            hidden_size=d.get("hidden_size", 4096),
            intermediate_size=d.get("intermediate_size", 10944),
            moe_intermediate_size=d.get("moe_intermediate_size", 1408),
            num_hidden_layers=d.get("num_hidden_layers", 46),
            num_attention_heads=d.get("num_attention_heads", 96),
            num_key_value_heads=d.get("num_key_value_heads") or 8,
            head_dim=d["head_dim"],
            partial_rotary_factor=partial,
            attention_bias=bool(d.get("attention_bias", False)),
            use_qk_norm=bool(d.get("use_qk_norm", False)),
            n_routed_experts=d.get("n_routed_experts", d.get("num_local_experts", 128)),
            n_shared_experts=d.get("n_shared_experts", 1),
            num_experts_per_tok=d.get("num_experts_per_tok", 8),
            n_group=d.get("n_group") or 1,
            topk_group=d.get("topk_group") or 1,
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            first_k_dense_replace=d.get("first_k_dense_replace", 1),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=d.get("max_position_embeddings", 131072),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            num_nextn_predict_layers=int(nextn or 0),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
        )

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """A config.json dict (transformers-5 spelling) that AutoModelForCausalLM loads to this model.
        `num_nextn_predict_layers` is written as the MTP layers this model holds (and writes)."""
        rope = {"rope_type": "default"}
        if self.rope_scaling is not None:
            rope = dict(self.rope_scaling)
        rope.update(rope_theta=self.rope_theta, partial_rotary_factor=self.partial_rotary_factor)
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
            "attention_bias": self.attention_bias,
            "use_qk_norm": self.use_qk_norm,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "first_k_dense_replace": self.first_k_dense_replace,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_dropout": 0.0,
            "tie_word_embeddings": self.tie_word_embeddings,
            "num_nextn_predict_layers": self.num_mtp_layers,
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


class Glm4Moe(DecoderLM):
    """embed -> L × (biased GQA attention with partial RoPE + dense SwiGLU or sigmoid MoE with a
    shared expert) -> RMSNorm -> LM head; `layers[L:]` are the MTP layers (see DecoderLM.mtp_logits)."""

    def __init__(self, config: Glm4MoeConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32,
                 param_dtype: Any = jnp.float32):
        c = config

        def build_layers(kw: dict[str, Any]) -> list[nnx.Module]:
            main = [DecoderLayer(self._attention(kw), self._ffn(c.is_moe_layer(i), kw), hidden_size=c.hidden_size,
                                 rms_norm_eps=c.rms_norm_eps, param_dtype=param_dtype)
                    for i in range(c.num_hidden_layers)]
            return main + [MTPLayer(self._attention(kw), self._ffn(True, kw), hidden_size=c.hidden_size,
                                    rms_norm_eps=c.rms_norm_eps, **kw) for _ in range(c.num_mtp_layers)]

        super().__init__(config, build_layers, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def _attention(self, kw: dict[str, Any]) -> GQAttention:
        c = self.config
        return GQAttention(hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
                           num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                           qkv_bias=c.attention_bias, o_bias=False, qk_norm=c.use_qk_norm, **kw)

    def _ffn(self, moe: bool, kw: dict[str, Any]) -> nnx.Module:
        c = self.config
        if not moe:
            return MLP(c.hidden_size, c.intermediate_size, **kw)
        return sigmoid_moe(c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                           c.n_shared_experts, n_group=c.n_group, topk_group=c.topk_group,
                           norm_topk_prob=c.norm_topk_prob, routed_scaling_factor=c.routed_scaling_factor, **kw)

    def rope(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """cos, sin [B, T, d] over the rotary dim d only; GQAttention rotates the first d dims of each head."""
        c = self.config
        inv_freq, scaling = rope_frequencies(c.rotary_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
        return rope_cos_sin(positions, inv_freq, self.dtype, scaling)  # [B, T, d] each


# the registry record (models/families.py): HF architecture -> the config.json model_types it ships with
REGISTRY = {"Glm4MoeForCausalLM": ("glm4_moe",)}
FAMILY = (Glm4MoeConfig, Glm4Moe)
