"""GLM-5 (GLM-MoE-DSA) in Flax NNX: DeepSeek-V3.2's graph (MLA + the DSA lightning indexer, sigmoid MoE with a
shared expert, dense first layers) with GLM's two changes, numerically matching transformers 5.25
`GlmMoeDsaForCausalLM` (`models/glm_moe_dsa/modeling_glm_moe_dsa.py`, `configuration_glm_moe_dsa.py`, generated
from `modular_glm_moe_dsa.py`).

Mirrors docs/models/glm-moe-dsa.md. Everything is models/deepseek_v32.py's except:

* the indexer rotates the first R = qk_rope_head_dim dims of its queries and keys in **interleaved** pairs (as MLA
  does), where DeepSeek-V3.2's indexer rotates NeoX halves;
* cross-layer top-k sharing (https://arxiv.org/abs/2603.12201): `indexer_types[i]` is "full" (layer i runs its
  own indexer) or "shared" (layer i has no indexer and attends to the keys the last full layer before it
  selected). A full layer leaves its restricted mask [B, T, S] in `ctx.carry`, the per-forward state a layer
  passes to later layers; a shared layer reads it. config.json spells the pattern `indexer_types`, or
  `index_topk_pattern` ("FSSF..." or a list), or `index_topk_freq` / `index_skip_topk_offset` (layer i is full
  iff max(i - offset + 1, 0) % freq == 0), folded as transformers does; every layer is full by default.

HF tensors are DeepSeek-V3.2's; a shared layer has no `self_attn.indexer.*`. With a KV cache the layout is
V3.2's (`cache.v` = [rope key | indexer key] per token); a shared layer stores zeros for the indexer key.

Shape legend: B batch, T length, S key length, D model, R rope dim, DI indexer head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from models.decoder import Context
from models.deepseek_v3 import rope_interleaved
from models.deepseek_v32 import DeepseekV32, DeepseekV32Config, DSAttention, Indexer
from models.flops import LayerFlops

ARCHITECTURE = "GlmMoeDsaForCausalLM"
# the registry record (models/families.py): HF architecture -> the config.json model_types it ships with
REGISTRY = {"GlmMoeDsaForCausalLM": ("glm_moe_dsa",)}
MODEL_TYPES = REGISTRY[ARCHITECTURE]
INDEXER_TYPES = ("full", "shared")
PATTERN_LETTERS = {"F": "full", "S": "shared"}  # index_topk_pattern's spelling
SELECTION = "dsa_selection"  # the ctx.carry key of the last full layer's restricted mask


def indexer_types_from_hf(d: Mapping[str, Any], num_layers: int) -> tuple[str, ...] | None:
    """The per-layer indexer modes of a config.json dict, as transformers' `GlmMoeDsaConfig.__post_init__` folds
    them: `indexer_types`, else `index_topk_pattern`, else the `index_topk_freq` / `index_skip_topk_offset`
    schedule (freq 1, offset 2: every layer full)."""
    if d.get("indexer_types") is not None:
        return tuple(d["indexer_types"])
    pattern = d.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            if set(pattern) - set(PATTERN_LETTERS):
                raise ValueError(f"config.json: index_topk_pattern {pattern!r}: letters F (full) and S (shared) only")
            return tuple(PATTERN_LETTERS[ch] for ch in pattern)
        return tuple(pattern)
    freq, offset = d.get("index_topk_freq", 1), d.get("index_skip_topk_offset", 2)
    if not isinstance(freq, int) or not isinstance(offset, int):
        raise ValueError(f"config.json: index_topk_freq {freq!r} / index_skip_topk_offset {offset!r}: integers")
    freq = max(freq, 1)
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers))


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GlmMoeDsaConfig(DeepseekV32Config):
    """DeepseekV32Config with transformers 5.25 `GlmMoeDsaConfig`'s defaults (GLM-5's shapes: 78 layers of width
    6144, 64 heads, q_lora 2048, nope 192 / rope 64 / v 256, 256 experts in one group, a 32-head indexer) and
    `indexer_types` (None: every layer "full"; else one of "full" / "shared" per main-stack layer, the first
    full). MTP layers, which transformers does not build, run their own indexer."""

    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 64
    q_lora_rank: int | None = 2048
    qk_nope_head_dim: int = 192
    v_head_dim: int = 256
    n_group: int = 1
    topk_group: int = 1
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 202752
    model_type: str = "glm_moe_dsa"
    index_n_heads: int = 32
    indexer_types: tuple[str, ...] | None = None
    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
    architecture: ClassVar[str] = ARCHITECTURE

    def __post_init__(self) -> None:
        super().__post_init__()
        types, n = self.indexer_types, self.num_hidden_layers
        if isinstance(types, Sequence) and not isinstance(types, str):
            types = tuple(types)
            object.__setattr__(self, "indexer_types", types)
        if types is None:
            return
        if isinstance(types, str) or len(types) != n or set(types) - set(INDEXER_TYPES):
            raise ValueError(f"indexer_types {types!r}: one of {INDEXER_TYPES} per layer ({n})")
        if types[0] != "full":
            raise ValueError("indexer_types: layer 0 is 'shared' (a shared layer reuses an earlier full layer's top-k)")
        if all(t == "full" for t in types):
            object.__setattr__(self, "indexer_types", None)  # the default: one spelling

    def is_shared_indexer(self, i: int) -> bool:
        """Layer i reuses the last full layer's selection (main stack only; MTP layers run their own indexer)."""
        return self.indexer_types is not None and i < self.num_hidden_layers and self.indexer_types[i] == "shared"

    def layer_flops(self) -> list[LayerFlops]:
        """DeepSeek-V3.2's per-layer cost, without the indexer's projections on shared layers."""
        D, Q, H, DI = self.hidden_size, self.q_lora_rank, self.index_n_heads, self.index_head_dim
        indexer = Q * H * DI + D * DI + D * H
        return [dataclasses.replace(f, matmul_params=f.matmul_params - indexer) if self.is_shared_indexer(i) else f
                for i, f in enumerate(super().layer_flops())]

    # -- presets ---------------------------------------------------------------------------------

    @classmethod
    def tiny(cls, vocab_size: int = 256, **overrides: Any) -> GlmMoeDsaConfig:
        """DeepseekV32Config.tiny (3 layers, 1 dense + 2 MoE, an 8-head indexer keeping 8 keys) whose layer 1
        shares layer 0's selection: any sequence past 8 tokens runs the sparse and the shared paths."""
        kw = dict(model_type="glm_moe_dsa", indexer_types=("full", "shared", "full"))
        return super().tiny(vocab_size, **{**kw, **overrides})

    @classmethod
    def glm5(cls, **overrides: Any) -> GlmMoeDsaConfig:
        """zai-org/GLM-5's config.json (the planner preset models/presets/glm-5.json, sources there): transformers
        5.25's `GlmMoeDsaConfig` shapes (every layer full) with RoPE theta 1e6 (the class default is 1e4), GLM's
        eos / pad tokens and one MTP layer."""
        kw = dict(rope_theta=1e6, eos_token_id=(154820, 154827, 154829), pad_token_id=154820,
                  num_nextn_predict_layers=1)
        return cls(**{**kw, **overrides})

    # -- HF config.json --------------------------------------------------------------------------

    @classmethod
    def fields_from_hf(cls, d: Mapping[str, Any]) -> dict[str, Any]:
        """DeepSeek-V3's fields plus `indexer_types` in any of its spellings (see indexer_types_from_hf)."""
        fields = super().fields_from_hf(d)
        return {**fields, "indexer_types": indexer_types_from_hf(d, fields["num_hidden_layers"])}

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """DeepSeek-V3.2's config.json under this architecture, plus `indexer_types` (written out per layer)."""
        n = self.num_hidden_layers
        return {**super().to_hf(dtype),
                "indexer_types": ["shared" if self.is_shared_indexer(i) else "full" for i in range(n)]}


# ------------------------------------------------------------------------------------------------
# The indexer and the attention with cross-layer top-k sharing
# ------------------------------------------------------------------------------------------------


class GlmIndexer(Indexer):
    """DeepSeek-V3.2's indexer rotating interleaved pairs (transformers `GlmMoeDsaIndexer`)."""

    def rotate(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """x [B, T, N, DI]: its first R dims rotated as adjacent pairs (de-interleaved, as q and k alike), the rest
        passed through."""
        R = cos.shape[-1]
        return jnp.concatenate([rope_interleaved(x[..., :R], cos, sin), x[..., R:]], axis=-1)


class GlmDSAttention(DSAttention):
    """DSA attention whose layer either runs its own indexer (full) or attends to the last full layer's selection
    (shared, no indexer; transformers `GlmMoeDsaAttention` with `prev_topk_indices`)."""

    indexer_cls = GlmIndexer

    def __init__(self, config: GlmMoeDsaConfig, *, shared: bool, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        super().__init__(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype, with_indexer=not shared)
        self.shared = shared

    def index(self, x: jax.Array, q_latent: jax.Array, ctx: Context) -> tuple[Any, jax.Array]:
        """A full layer's indexer queries and keys; a shared layer has none (zeros fill its cache slots)."""
        if not self.shared:
            return super().index(x, q_latent, ctx)
        B, T, _ = x.shape
        return None, jnp.zeros((B, T, self.index_dim), x.dtype)  # [B, T, DI]

    def restrict(self, query: Any, keys: jax.Array, mask: jax.Array, ctx: Context) -> jax.Array:
        """mask [B, T, S] & this layer's selection (full: its own top-k, left in ctx.carry for the shared layers
        after it; shared: the carried one)."""
        if self.shared:
            if SELECTION not in ctx.carry:
                raise NotImplementedError("GLM-5 shared DSA layer run without an earlier full layer in the same "
                                          "forward (its top-k selection is what the layer attends to)")
            return mask & ctx.carry[SELECTION]
        mask = super().restrict(query, keys, mask, ctx)
        ctx.carry[SELECTION] = mask
        return mask


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------


class GlmMoeDsa(DeepseekV32):
    """embed -> L × (MLA + a full or shared DSA selection, dense SwiGLU or MoE) -> RMSNorm -> LM head, then the
    MTP layers."""

    @classmethod
    def attention_block(cls, config: GlmMoeDsaConfig, layer: int, kw: dict[str, Any]) -> nnx.Module:
        return GlmDSAttention(config, shared=config.is_shared_indexer(layer), **kw)


FAMILY = (GlmMoeDsaConfig, GlmMoeDsa)  # registered by REGISTRY, at the top
