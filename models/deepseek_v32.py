"""DeepSeek-V3.2 (V3.2-Exp) in Flax NNX: DeepSeek-V3 plus DeepSeek Sparse Attention (DSA), numerically matching
transformers 5.25 `DeepseekV32ForCausalLM` (`models/deepseek_v32/modeling_deepseek_v32.py`,
`configuration_deepseek_v32.py`, generated from `modular_deepseek_v32.py`).

Mirrors docs/models/deepseek-v32.md. Everything but the attention mask is models/deepseek_v3.py's (MLA,
interleaved RoPE, YaRN softmax scale, sigmoid group-limited MoE with shared experts, dense first layers,
MTP layout); each layer's MLA gets a "lightning indexer" (DeepSeek-V3.2-Exp, https://github.com/deepseek-ai/
DeepSeek-V3.2-Exp, `inference/model.py` `Indexer`) whose top-`index_topk` keys per query are the only keys the
MLA attention may attend to:

    q_I   = rope(wq_b(q_latent))                  -> H × DI   (q_latent = MLA's q_a_layernorm(q_a_proj(x)))
    k_I   = rope(k_norm(wk(x)))                   -> DI       (one key per token; k_norm is a LayerNorm)
    w     = weights_proj(x) · H^-0.5              -> H        (fp32)
    score = Σ_h w_h · relu(q_I,h · k_I · DI^-0.5) over the causal (and padding) mask, per query and key
    keep  = the top-index_topk keys of each query (all of them while fewer are visible)
    MLA attention over mask & keep

The indexer's RoPE rotates the first R = qk_rope_head_dim dims of its heads in NeoX halves (not interleaved, unlike
MLA), with MLA's cos/sin tables (YaRN included). HF tensors: `layers.{i}.self_attn.indexer.{wq_b, wk,
weights_proj}.weight`, `...indexer.k_norm.{weight, bias}`, the rest as DeepSeek-V3 (docs/models/deepseek-v3.md).

With a KV cache the MLA cache keeps the latent in `cache.k` and stores [rope key | indexer key] per token in
`cache.v` ([L, B, 1, S, R + DI]), so the indexer scores every cached token without recomputing its key, and
everything that moves cache slots (rollback, speculative tree compaction, repeated samples) moves both.

Training: the indexer reads its inputs detached and its top-k carries no gradient, so the task loss never reaches
it; with `indexer_kl` set (the trainer's `finetune.indexer.mode: kl`) each layer sows the indexer's KL objective
(`DSAttention.kl_objective`, DeepSeek-V3.2 https://arxiv.org/abs/2512.02556), which trains the indexer alone.

Shape legend: B batch, T length, S key length (cache length with a cache), D model, N heads, P nope dim,
R rope dim, Vd value dim, C kv latent, Q q latent, H indexer heads, DI indexer head dim, k index_topk.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from models.decoder import Context
from models.deepseek_v3 import DeepseekV3, DeepseekV3Config, MLAttention
from models.flops import LayerFlops
from models.generate import KVCache
from models.layers import NEG_INF, Linear, apply_rope, param

ARCHITECTURE = "DeepseekV32ForCausalLM"
# the registry record (models/families.py): HF architecture -> the config.json model_types it ships with
REGISTRY = {"DeepseekV32ForCausalLM": ("deepseek_v32",)}
MODEL_TYPES = REGISTRY[ARCHITECTURE]
INDEX_NORM_EPS = 1e-6  # the indexer's k_norm (nn.LayerNorm(eps=1e-6) in transformers and the reference)
MLP_LAYER_TYPES = ("dense", "sparse")
INDEXER_KL = "indexer_kl"  # the name a DSA layer sows its indexer's KL objective under (tasks/training/losses.py)


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeepseekV32Config(DeepseekV3Config):
    """DeepseekV3Config plus the indexer's sizes; defaults are transformers 5.25's `DeepseekV32Config` (the 671B
    shapes, max_position_embeddings 163840, no YaRN). A q LoRA is required (the indexer reads its latent), MLA's
    RoPE is always interleaved, and `mlp_layer_types` (None: `first_k_dense_replace` dense layers, then MoE)
    may name each main-stack layer "dense" or "sparse"."""

    max_position_embeddings: int = 163840
    num_nextn_predict_layers: int = 0  # transformers' V3.2 has no MTP (the Hub config.json says 1)
    model_type: str = "deepseek_v32"
    index_topk: int = 2048  # keys each query may attend to
    index_head_dim: int = 128  # DI
    index_n_heads: int = 64  # H
    mlp_layer_types: tuple[str, ...] | None = None
    model_types: ClassVar[tuple[str, ...]] = MODEL_TYPES
    architecture: ClassVar[str] = ARCHITECTURE  # the HF architecture from_hf / to_hf read and write (GLM-5: its own)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.mlp_layer_types, Sequence):
            object.__setattr__(self, "mlp_layer_types", tuple(self.mlp_layer_types))
        if self.q_lora_rank is None:
            raise ValueError("q_lora_rank: DeepSeek-V3.2's indexer reads the q LoRA latent (a rank is required)")
        if not self.rope_interleave:
            raise NotImplementedError("rope_interleave false: DeepSeek-V3.2's MLA rotates interleaved pairs")
        for name in ("index_topk", "index_head_dim", "index_n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)}: must be a positive integer")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"index_head_dim {self.index_head_dim} < qk_rope_head_dim {self.qk_rope_head_dim} "
                             "(the indexer rotates its first qk_rope_head_dim dims)")
        types, n = self.mlp_layer_types, self.num_hidden_layers
        if types == tuple("dense" if i < self.first_k_dense_replace else "sparse" for i in range(n)):
            object.__setattr__(self, "mlp_layer_types", None)  # what first_k_dense_replace says: one spelling
        elif types is not None and (len(types) != self.num_hidden_layers or set(types) - set(MLP_LAYER_TYPES)):
            raise ValueError(f"mlp_layer_types {list(types)}: one of {MLP_LAYER_TYPES} per layer "
                             f"({self.num_hidden_layers})")

    def is_moe_layer(self, i: int) -> bool:
        """Main-stack layer i is MoE per `mlp_layer_types` (else i >= first_k_dense_replace); MTP layers are."""
        if self.mlp_layer_types is None or i >= self.num_hidden_layers:
            return super().is_moe_layer(i)
        return self.mlp_layer_types[i] == "sparse"

    def kv_cache_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """k = the normalised latent (1 × C); v = the rotated rope key and the indexer key (1 × (R + DI))."""
        return (1, self.kv_lora_rank), (1, self.qk_rope_head_dim + self.index_head_dim)

    def layer_flops(self) -> list[LayerFlops]:
        """DeepSeek-V3's per-layer cost plus the indexer's projections (wq_b, wk, weights_proj); the MLA attends
        to at most `index_topk` keys per query (the `window` of the accounting). The indexer's own scores
        (H·DI per query and visible key) are not counted."""
        D, Q, H, DI = self.hidden_size, self.q_lora_rank, self.index_n_heads, self.index_head_dim
        indexer = Q * H * DI + D * DI + D * H
        return [dataclasses.replace(f, matmul_params=f.matmul_params + indexer, window=self.index_topk)
                for f in super().layer_flops()]

    # -- presets ---------------------------------------------------------------------------------

    @classmethod
    def tiny(cls, vocab_size: int = 256, **overrides: Any) -> DeepseekV32Config:
        """DeepseekV3Config.tiny (3 layers, 1 dense + 2 MoE, width 64) with an 8-head indexer of 16 dims keeping
        the top 8 keys: any sequence past 8 tokens runs the sparse path."""
        kw = dict(index_topk=8, index_head_dim=16, index_n_heads=8, model_type="deepseek_v32")
        return super().tiny(vocab_size, **{**kw, **overrides})

    @classmethod
    def deepseek_v32_exp(cls, **overrides: Any) -> DeepseekV32Config:
        """deepseek-ai/DeepSeek-V3.2-Exp and DeepSeek-V3.2: DeepSeek-V3's shapes, YaRN ×40 and MTP layer, with a
        64-head indexer of 128 dims keeping 2048 keys; equal to the published config.json (the planner preset
        models/presets/deepseek-v3.2.json, tests/unit/test_presets.py)."""
        kw = dict(index_topk=2048, index_head_dim=128, index_n_heads=64, num_nextn_predict_layers=1,
                  model_type="deepseek_v32")
        return cls.deepseek_v3(**{**kw, **overrides})

    deepseek_v32 = deepseek_v32_exp

    # -- HF config.json --------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> DeepseekV32Config:
        """From a config.json dict in the transformers-5 spelling (`rope_parameters`, `mlp_layer_types`, `dtype`)
        or the Hub's (`rope_theta` + `rope_scaling` {type: yarn}, `torch_dtype`, `topk_method` / `scoring_func`,
        `num_nextn_predict_layers`); `num_experts` / `num_local_experts` are read as `n_routed_experts`, as
        transformers does."""
        archs = d.get("architectures") or [cls.architecture]
        if cls.architecture not in archs:
            raise ValueError(f"config.json: architectures {archs} is not {cls.architecture}")
        model_type = d.get("model_type") or cls.model_types[0]
        if model_type not in cls.model_types:
            raise ValueError(f"config.json: model_type {model_type!r} (supported: {', '.join(cls.model_types)})")
        if d.get("rope_interleave") is False:
            raise NotImplementedError("config.json: rope_interleave false (DSA models interleave MLA's RoPE)")
        if d.get("q_lora_rank", cls.q_lora_rank) is None:
            raise ValueError("config.json: q_lora_rank null (the DSA indexer reads the q LoRA latent)")
        if d.get("num_experts") is not None and not d.get("n_routed_experts"):
            d = {**d, "n_routed_experts": d["num_experts"]}
        types = d.get("mlp_layer_types")
        return cls(**cls.fields_from_hf(d), model_type=model_type,
                   index_topk=d.get("index_topk", cls.index_topk),
                   index_head_dim=d.get("index_head_dim", cls.index_head_dim),
                   index_n_heads=d.get("index_n_heads", cls.index_n_heads),
                   mlp_layer_types=None if types is None else tuple(types))

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """DeepSeek-V3's config.json in transformers-5 spelling under this architecture, plus the indexer sizes
        and `mlp_layer_types` (transformers' V3.2 config has no `rope_interleave` / `pretraining_tp`)."""
        out = super().to_hf(dtype)
        for key in ("rope_interleave", "pretraining_tp"):
            out.pop(key)
        n = self.num_hidden_layers
        return {**out, "architectures": [self.architecture], "model_type": self.model_type,
                "index_topk": self.index_topk, "index_head_dim": self.index_head_dim,
                "index_n_heads": self.index_n_heads,
                "mlp_layer_types": ["sparse" if self.is_moe_layer(i) else "dense" for i in range(n)]}



# ------------------------------------------------------------------------------------------------
# The lightning indexer
# ------------------------------------------------------------------------------------------------


class LayerNorm(nnx.Module):
    """(x - mean) / sqrt(var + eps) · weight + bias, statistics in fp32 (torch `nn.LayerNorm`); HF tensors
    `<prefix>.weight` and `<prefix>.bias`."""

    def __init__(self, features: int, *, eps: float, axis_name: str, param_dtype: Any):
        self.eps = eps
        self.weight = param(jnp.ones((features,), param_dtype), (axis_name,))
        self.bias = param(jnp.zeros((features,), param_dtype), (axis_name,))
        self.hf_raw = ("weight", "bias")

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        return (y * self.weight[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


class Indexer(nnx.Module):
    """DSA's lightning indexer: which `index_topk` keys each query keeps (transformers `DeepseekV32Indexer`;
    the reference's Hadamard rotation of q and k and its FP8 scoring are precision devices that leave q·k as is,
    so they are not reproduced)."""

    def __init__(self, config: DeepseekV32Config, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        c = config
        D, Q, H, DI = c.hidden_size, c.q_lora_rank, c.index_n_heads, c.index_head_dim
        self.n_heads, self.head_dim, self.index_topk = H, DI, c.index_topk
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.wq_b = Linear(Q, H * DI, axes=("q_lora", "heads"), **kw)
        self.wk = Linear(D, DI, axes=("embed", "head_dim"), **kw)
        self.k_norm = LayerNorm(DI, eps=INDEX_NORM_EPS, axis_name="head_dim", param_dtype=param_dtype)
        self.weights_proj = Linear(D, H, axes=("embed", "heads"), **kw)

    def project(self, x: jax.Array, q_latent: jax.Array, ctx: Context) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, D], q_latent [B, T, Q] -> (queries [B, T, H, DI], head weights [B, T, H] fp32 (× H^-0.5),
        keys [B, T, DI]), queries and keys rotated on their first R dims."""
        B, T, _ = x.shape
        H, DI = self.n_heads, self.head_dim
        cos, sin = ctx.rope  # [B, T, R]
        q = self.rotate(self.wq_b(q_latent).reshape(B, T, H, DI), cos, sin)  # [B, T, H, DI]
        k = self.rotate(self.k_norm(self.wk(x))[:, :, None, :], cos, sin)[:, :, 0]  # [B, T, DI]
        w = self.weights_proj.weight().astype(jnp.float32)  # [D, H]: transformers keeps weights_proj in fp32
        weights = jnp.einsum("btd,dh->bth", x.astype(jnp.float32), w) * H**-0.5  # [B, T, H]
        return q, weights, k

    def rotate(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """x [B, T, N, DI] with its first R dims rotated in NeoX halves (V3.2; GLM-5 rotates interleaved pairs)."""
        return apply_rope(x, cos, sin)

    def scores(self, q: jax.Array, weights: jax.Array, k: jax.Array) -> jax.Array:
        """q [B, T, H, DI], weights [B, T, H], keys k [B, S, DI] -> the index scores I [B, T, S] =
        Σ_h w_h · relu(q_h · k · DI^-0.5), in fp32 (unmasked)."""
        scores = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), k.astype(jnp.float32))  # [B, T, H, S]
        scores = jax.nn.relu(scores * self.head_dim**-0.5)
        return jnp.einsum("bth,bths->bts", weights, scores)  # [B, T, S]

    def select(self, q: jax.Array, weights: jax.Array, k: jax.Array, mask: jax.Array) -> jax.Array:
        """q [B, T, H, DI], weights [B, T, H], keys k [B, S, DI], mask [B, T, S] (True = visible) -> mask [B, T, S]
        restricted to each query's `index_topk` highest-scoring visible keys (all of them while fewer are
        visible; the score is `scores`)."""
        B, T, S = mask.shape
        if self.index_topk >= S:  # transformers keeps min(index_topk, S) keys: here every visible one
            return mask
        index = jnp.where(mask, self.scores(q, weights, k), -jnp.inf)  # [B, T, S]
        _, top = jax.lax.top_k(index, self.index_topk)  # [B, T, k]
        rows, cols = jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None]
        keep = jnp.zeros((B, T, S), bool).at[rows, cols, top].set(True)  # [B, T, S]
        return mask & keep


class DSAttention(MLAttention):
    """DeepSeek-V3's MLA with the indexer's selection folded into its mask (transformers `DeepseekV32Attention`).
    With a cache, `cache.v` holds [rope key (R) | indexer key (DI)] per token. `index` and `restrict` are the
    selection's two steps (GLM-5's shared layers replace them)."""

    dsa: ClassVar[bool] = True  # a DSA block: models/quant/rotation.py refuses the folds that miss the indexer
    indexer_cls: ClassVar[type[Indexer]] = Indexer

    def __init__(self, config: DeepseekV32Config, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any,
                 with_indexer: bool = True):
        super().__init__(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.index_dim = config.index_head_dim
        # the trainer sets it (tasks/training/trainer.py): sow the indexer's KL objective, over the keys each
        # query attends to ("sparse") or over every causal key ("dense"); None: no objective
        self.indexer_kl: str | None = None
        if with_indexer:
            self.indexer = self.indexer_cls(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def index(self, x: jax.Array, q_latent: jax.Array, ctx: Context) -> tuple[Any, jax.Array]:
        """x [B, T, D], q_latent [B, T, Q] -> (the indexer's (queries, head weights)), its keys [B, T, DI]). The
        indexer reads its inputs detached: the top-k selection carries no gradient anyway, and its KL objective
        then trains the indexer alone (DeepSeek-V3.2, https://arxiv.org/abs/2512.02556, continued pre-training)."""
        x, q_latent = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent)
        q, w, k = self.indexer.project(x, q_latent, ctx)
        return (q, w), k

    def kl_objective(self, query: Any, keys: jax.Array, q: jax.Array, k: jax.Array, mask: jax.Array) -> jax.Array:
        """The indexer's training objective (DeepSeek-V3.2, https://arxiv.org/abs/2512.02556, continued
        pre-training): per query t, the main attention's probabilities summed over heads and L1-normalised over
        the keys of `mask` [B, T, S] (p_t, a constant) against the softmax of the index scores over the same
        keys: Σ_s p_ts (log p_ts - log softmax(I_t)_s), averaged over the queries that see a key (padding queries
        see none). `query` and `keys` are the indexer's (`index`), q and k [B, T, N, P+R] the attention's
        (`expand`); gradient only to the indexer (its inputs are detached in `index`, the target is a constant).
        The target recomputes the attention's [B, N, T, S] probabilities (no fused kernel). -> fp32 scalar."""
        q, k = jax.lax.stop_gradient((q, k))
        logits = jnp.einsum("btnd,bsnd->bnts", q, k).astype(jnp.float32) * self.scale  # [B, N, T, S]
        probs = jax.nn.softmax(jnp.where(mask[:, None], logits, NEG_INF), axis=-1)  # [B, N, T, S]
        p = jnp.where(mask, probs.sum(axis=1), 0.0)  # [B, T, S]: summed over heads
        p = jax.lax.stop_gradient(p / jnp.maximum(p.sum(axis=-1, keepdims=True), 1e-30))  # L1-normalised
        index = jnp.where(mask, self.indexer.scores(*query, keys), NEG_INF)  # [B, T, S]
        log_q = jax.nn.log_softmax(index, axis=-1)  # [B, T, S]
        kl = jnp.sum(jnp.where(mask & (p > 0), p * (jnp.log(jnp.where(p > 0, p, 1.0)) - log_q), 0.0), axis=-1)
        seen = mask.any(axis=-1)  # [B, T]
        return jnp.sum(jnp.where(seen, kl, 0.0)) / jnp.maximum(seen.sum(), 1)

    def restrict(self, query: Any, keys: jax.Array, mask: jax.Array, ctx: Context) -> jax.Array:
        """mask [B, T, S] restricted to each query's top-k keys among `keys` [B, S, DI] (see Indexer.select)."""
        return self.indexer.select(*query, keys, mask)

    def __call__(
        self, x: jax.Array, ctx: Context, cache: KVCache | None, layer: int, window: int | None = None
    ) -> tuple[jax.Array, KVCache | None]:
        B, T, _ = x.shape
        R = self.rope_dim
        q_latent, q_nope, q_rot, latent, k_rot = self.project(x, ctx)
        query, index_k = self.index(x, q_latent, ctx)  # index_k [B, T, DI]
        mask = ctx.mask(window)  # [B, T, S]
        if cache is None:
            causal = mask
            mask = self.restrict(query, index_k, mask, ctx)
            q, k, v = self.expand(q_nope, q_rot, latent, k_rot)  # [B, T, N, ·]
            out = self.expanded(q, k, v, mask, ctx.causal)
            if self.indexer_kl is not None and query is not None:  # a GLM-5 shared layer has no indexer to train
                over = causal if self.indexer_kl == "dense" else mask
                self.sow(nnx.Intermediate, INDEXER_KL, self.kl_objective(query, index_k, q, k, over))
        else:
            keys = jnp.concatenate([k_rot, index_k[:, :, None, :].astype(k_rot.dtype)], axis=-1)  # [B, T, 1, R+DI]
            cache = cache.write(layer, ctx.slots, latent[:, :, None, :], keys)
            cached = cache.v[layer]  # [B, 1, S, R+DI]
            mask = self.restrict(query, cached[:, 0, :, R:], mask, ctx)
            out = self.absorbed(q_nope, q_rot, cache.k[layer], cached[..., :R], mask)
        return self.o_proj(out.reshape(B, T, self.num_heads * self.v_dim)), cache


# ------------------------------------------------------------------------------------------------
# Model
# ------------------------------------------------------------------------------------------------


class DeepseekV32(DeepseekV3):
    """embed -> L × (MLA + DSA indexer, dense SwiGLU or MoE) -> RMSNorm -> LM head, then the MTP layers."""

    attention_cls = DSAttention


FAMILY = (DeepseekV32Config, DeepseekV32)  # registered by REGISTRY, at the top
