"""DeepSeek-V4's configuration (models/deepseek_v4.py is the model): `DeepseekV4Config`, frozen, read from a
transformers `deepseek_v4` config.json (legacy keys folded as transformers folds them), with the layer kinds and the
cache geometry the model and the KV cache read. Split from the model file for length; `models.deepseek_v4`
re-exports every name here.

Mirrors transformers' `DeepseekV4Config` (models/deepseek_v4/configuration_deepseek_v4.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import flax.core
import jax
import jax.numpy as jnp

from models.flops import LayerFlops, routed_ffn, swiglu
from models.layers import rope_frequencies

ARCHITECTURE = "DeepseekV4ForCausalLM"
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # the legacy per-layer `compress_ratios`, as transformers folds them
MLP_LAYER_TYPES = ("hash_moe", "moe")
DEFAULT_HASH_LAYERS = 3
SCORING = ("sqrtsoftplus", "sigmoid")


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeepseekV4Config:
    """transformers' `DeepseekV4Config` fields and defaults (DeepSeek-V4-Flash's shapes). `layer_types` and
    `mlp_layer_types` are always resolved (transformers' defaults: two HCA layers then CSA / HCA alternating;
    three hash layers); `rope_scaling` is the compressed layers' RoPE scaling (None or YaRN), whose theta is
    `compress_rope_theta`; sliding layers use plain RoPE at `rope_theta`."""

    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    q_lora_rank: int = 1024
    qk_rope_head_dim: int = 64  # R = head_dim · partial_rotary_factor
    num_experts_per_tok: int = 6
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    max_position_embeddings: int = 1048576
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: Mapping[str, Any] | None = None
    layer_types: tuple[str, ...] | None = None
    compress_rate_csa: int = 4
    compress_rate_hca: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    mlp_layer_types: tuple[str, ...] | None = None
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    o_groups: int = 8
    o_lora_rank: int = 1024
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    num_nextn_predict_layers: int = 1  # in the published files; transformers (and this module) build none
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | tuple[int, ...] | None = 1
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)
        n = self.num_hidden_layers
        if self.layer_types is None:
            alternate = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
            set_("layer_types", [HCA] * min(n, 2) + alternate)
        if self.mlp_layer_types is None:
            k = DEFAULT_HASH_LAYERS
            set_("mlp_layer_types", ["hash_moe"] * min(n, k) + ["moe"] * max(0, n - k))
        for name, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
            types = tuple(getattr(self, name))
            if len(types) != n or set(types) - set(allowed):
                raise ValueError(f"{name} {list(types)}: one of {allowed} per layer ({n})")
            set_(name, types)
        if self.rope_scaling is not None:
            set_("rope_scaling", flax.core.FrozenDict(self.rope_scaling))
        if isinstance(self.eos_token_id, Sequence):
            set_("eos_token_id", tuple(int(e) for e in self.eos_token_id))
        if self.num_key_value_heads != 1:
            raise NotImplementedError(f"num_key_value_heads {self.num_key_value_heads} (V4 shares one K=V head)")
        if self.scoring_func not in SCORING:
            raise NotImplementedError(f"scoring_func {self.scoring_func!r} (supported: {', '.join(SCORING)})")
        if self.n_shared_experts != 1:
            raise NotImplementedError(f"n_shared_experts {self.n_shared_experts} (transformers builds exactly one)")
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= min(self.head_dim, self.index_head_dim):
            raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim}: even, at most head_dim and index_head_dim")
        if (self.num_attention_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"o_groups {self.o_groups} does not divide num_attention_heads × head_dim")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} > n_routed_experts")
        for name in ("compress_rate_csa", "compress_rate_hca", "hc_mult", "hc_sinkhorn_iters", "o_lora_rank",
                     "index_topk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} {getattr(self, name)}: must be a positive integer")

    @property
    def intermediate_size(self) -> int:  # transformers' attribute_map: the shared expert's width
        return self.moe_intermediate_size

    def is_moe_layer(self, i: int) -> bool:
        return True

    def layer_window(self, i: int) -> int:
        return self.sliding_window  # every layer's sliding branch (CSA / HCA add compressed entries)

    def compress_rate(self, i: int) -> int:
        """Layer i's compression rate m (0 for a sliding-only layer)."""
        return {SLIDING: 0, CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}[self.layer_types[i]]

    def raw_width(self, i: int) -> int:
        """Per-token compressor projections of layer i (what its open windows keep): kv and gate, 2·Hd each with
        CSA's overlap (+ the indexer's 2·DI each), Hd each for HCA."""
        kind, Hd, DI = self.layer_types[i], self.head_dim, self.index_head_dim
        return {SLIDING: 0, CSA: 4 * Hd + 4 * DI, HCA: 2 * Hd}[kind]

    def window_span(self, i: int) -> int:
        """Tokens one compressed entry of layer i pools: 2m with CSA's overlap, m for HCA (0: sliding)."""
        return (2 if self.layer_types[i] == CSA else 1) * self.compress_rate(i)

    def kv_cache_dims(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """k = the rotated K=V sliding key (1 × Hd); no v (K = V; the compressors' state is `cache_extra`)."""
        return (1, self.head_dim), (1, 0)

    def kv_cache_values_per_token(self) -> float:
        """Cache values one token adds per layer, averaged over the layers: its sliding key (Hd; every slot is kept)
        and 1/m of a compressed entry (Hd, with CSA's indexer entry DI). The open windows' ring is a constant per
        row, not per token."""
        Hd, DI = self.head_dim, self.index_head_dim
        entry = {SLIDING: 0, CSA: Hd + DI, HCA: Hd}
        per = [Hd + (entry[kind] / self.compress_rate(i) if kind != SLIDING else 0)
               for i, kind in enumerate(self.layer_types)]
        return sum(per) / len(per)

    def cache_extra(self, batch: int, max_len: int, dtype: Any, call_width: int = 1) -> dict[str, dict[str, jax.Array]]:
        """The compressed layers' cache state (`KVCache.extra`), per layer i (key str(i)):
        `entries` [B, S // m, Hd] (entry w, rotated, at row w), for CSA `index` [B, S // m, DI] (the indexer's
        entries), and `ring` [B, P, raw_width] the per-token projections of the last P slots (slot s at row s mod P),
        P = window_span + call_width − 1: the open window, the previous one's first halves (CSA), and the slots a
        rollback into a call of `call_width` tokens needs again."""
        out = {}
        for i, kind in enumerate(self.layer_types):
            if kind == SLIDING:
                continue
            W = max_len // self.compress_rate(i)
            state = {"ring": jnp.zeros((batch, self.window_span(i) + call_width - 1, self.raw_width(i)), dtype),
                     "entries": jnp.zeros((batch, W, self.head_dim), dtype)}
            if kind == CSA:
                state["index"] = jnp.zeros((batch, W, self.index_head_dim), dtype)
            out[str(i)] = state
        return out

    def rope_tables(self, positions: jax.Array, compressed: bool) -> tuple[jax.Array, jax.Array]:
        """cos, sin [..., R/2] fp32 at integer `positions` [...]: one angle per interleaved pair; the compressed
        layers' RoPE (compress_rope_theta, optional YaRN) or the sliding layers' (rope_theta)."""
        theta, scaling = (self.compress_rope_theta, self.rope_scaling) if compressed else (self.rope_theta, None)
        inv_freq, mscale = rope_frequencies(self.qk_rope_head_dim, theta, scaling, self.max_position_embeddings)
        angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [..., R/2]
        return jnp.cos(angles) * mscale, jnp.sin(angles) * mscale

    def layer_flops(self) -> list[LayerFlops]:
        """Per layer: the attention projections (+ compressor and indexer projections), router, top-k experts and
        the shared expert; each query attends to its window plus at most index_topk (CSA) or all T/m (HCA) entries
        (counted as the window of the accounting: the window plus index_topk, or no window for HCA)."""
        D, N, Hd, Q, G, O = (self.hidden_size, self.num_attention_heads, self.head_dim, self.q_lora_rank,
                             self.o_groups, self.o_lora_rank)
        H, DI = self.index_n_heads, self.index_head_dim
        attn = D * Q + Q * N * Hd + D * Hd + N * Hd * O + G * O * D
        ffn = routed_ffn(self, self.n_routed_experts, self.moe_intermediate_size, 0) + \
            swiglu(D, self.moe_intermediate_size)
        out = []
        for kind in self.layer_types:
            extra = {SLIDING: 0, HCA: 2 * D * Hd, CSA: 4 * D * Hd + 4 * D * DI + Q * H * DI + D * H}[kind]
            window = {SLIDING: self.sliding_window, CSA: self.sliding_window + self.index_topk, HCA: None}[kind]
            out.append(LayerFlops(attn + extra + ffn, N * Hd, N * Hd, window))
        return out

    # -- presets ---------------------------------------------------------------------------------

    @classmethod
    def tiny(cls, vocab_size: int = 256, **overrides: Any) -> DeepseekV4Config:
        """Width 64, 3 layers (sliding, CSA, HCA; the first hash-routed), 2 streams, window 8, CSA m=4 keeping the
        top 3 entries, HCA m=8: sequences past 16 tokens run every sparse and compressed path."""
        kw = dict(vocab_size=vocab_size, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
                  num_attention_heads=4, head_dim=32, q_lora_rank=32, qk_rope_head_dim=16, num_experts_per_tok=2,
                  n_routed_experts=8, max_position_embeddings=512, layer_types=(SLIDING, CSA, HCA),
                  compress_rate_csa=4, compress_rate_hca=8, hc_mult=2, mlp_layer_types=("hash_moe", "moe", "moe"),
                  sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3)
        return cls(**{**kw, **overrides})

    @classmethod
    def deepseek_v4_flash(cls, **overrides: Any) -> DeepseekV4Config:
        """deepseek-ai/DeepSeek-V4-Flash: transformers' defaults (the config class documents them as Flash's;
        not read from the Hub config.json here) with its compressed layers' YaRN ×16 from 65536 positions."""
        yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32,
                "beta_slow": 1, "attention_factor": 1.0}
        return cls(**{"rope_scaling": yarn, **overrides})

    # -- HF config.json --------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> DeepseekV4Config:
        """From config.json in transformers' spelling (`layer_types`, `mlp_layer_types`, `compress_rates`,
        `partial_rotary_factor`, nested `rope_parameters` {main, compress}) or the legacy one transformers folds
        in (`compress_ratios` per layer, `compress_rate_csa` / `compress_rate_hca`, `num_hash_layers`,
        `qk_rope_head_dim`, a flat `rope_scaling` / `rope_parameters` applying to the compressed layers)."""
        archs = d.get("architectures") or [ARCHITECTURE]
        if ARCHITECTURE not in archs:
            raise ValueError(f"config.json: architectures {archs} is not {ARCHITECTURE}")
        if d.get("model_type", "deepseek_v4") != "deepseek_v4":
            raise ValueError(f"config.json: model_type {d['model_type']!r} (supported: deepseek_v4)")
        if d.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"config.json: hidden_act {d['hidden_act']!r} (only silu)")
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key):
                raise NotImplementedError(f"config.json: {key} true (DeepSeek-V4 has no biases)")
        n, head_dim = d["num_hidden_layers"], d.get("head_dim", cls.head_dim)
        rates = dict(d.get("compress_rates") or {})
        csa = d.get("compress_rate_csa") or rates.get(CSA, cls.compress_rate_csa)
        hca = d.get("compress_rate_hca") or rates.get(HCA, cls.compress_rate_hca)
        types = d.get("layer_types")
        if types is None and d.get("compress_ratios") is not None:
            ratios = list(d["compress_ratios"])
            if set(ratios) - set(RATIO_TO_TYPE):
                raise ValueError(f"config.json: compress_ratios {ratios}: each one of {sorted(RATIO_TO_TYPE)}")
            types = [RATIO_TO_TYPE[r] for r in ratios]
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            k = d.get("num_hash_layers", DEFAULT_HASH_LAYERS)
            mlp_types = ["hash_moe"] * min(n, k) + ["moe"] * max(0, n - k)
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = d.get("rope_theta", cls.rope_theta)
        compress_theta = d.get("compress_rope_theta", cls.compress_rope_theta)
        if isinstance(rope.get("main"), Mapping) and isinstance(rope.get("compress"), Mapping):
            main, comp = dict(rope["main"]), dict(rope["compress"])
            if main.get("rope_type", "default") != "default":
                raise NotImplementedError(f"config.json: rope_parameters.main rope_type {main['rope_type']!r}")
            theta, compress_theta = main.get("rope_theta", theta), comp.get("rope_theta", compress_theta)
            partial = main.get("partial_rotary_factor", d.get("partial_rotary_factor"))
        else:
            comp = {k: v for k, v in rope.items() if k not in ("main", "compress")}
            theta = comp.pop("rope_theta", theta)  # a flat dict's theta is the main one (transformers folds it so)
            partial = d.get("partial_rotary_factor")
        for key in ("rope_theta", "partial_rotary_factor", "truncate"):
            comp.pop(key, None)  # transformers reads `truncate` from the top level of rope_parameters: always on
        rope_type = comp.pop("rope_type", None) or comp.pop("type", None) or "default"
        comp.pop("type", None)
        if rope_type not in ("default", "yarn"):
            raise NotImplementedError(f"config.json: compressed-layer rope_type {rope_type!r} (default or yarn)")
        scaling = None if rope_type == "default" else {"rope_type": "yarn", "attention_factor": 1.0, **comp}
        if partial is not None:
            rope_dim = int(head_dim * float(partial))
        else:
            rope_dim = d.get("qk_rope_head_dim") or head_dim // 8  # transformers' default factor 64 / 512
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        get = lambda k: d.get(k, defaults[k])  # noqa: E731
        names = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_attention_heads", "q_lora_rank",
                 "num_experts_per_tok", "n_routed_experts", "n_shared_experts", "scoring_func",
                 "routed_scaling_factor", "max_position_embeddings", "hc_mult", "hc_sinkhorn_iters", "hc_eps",
                 "swiglu_limit", "sliding_window", "o_groups", "o_lora_rank", "index_n_heads", "index_head_dim",
                 "index_topk", "num_nextn_predict_layers", "rms_norm_eps", "tie_word_embeddings", "bos_token_id",
                 "eos_token_id", "pad_token_id")
        return cls(**{k: get(k) for k in names}, num_hidden_layers=n, head_dim=head_dim,
                   num_key_value_heads=d.get("num_key_value_heads") or 1, qk_rope_head_dim=rope_dim,
                   rope_theta=float(theta), compress_rope_theta=float(compress_theta), rope_scaling=scaling,
                   layer_types=None if types is None else tuple(types)[:n], compress_rate_csa=csa,
                   compress_rate_hca=hca, mlp_layer_types=tuple(mlp_types)[:n])

    def to_hf(self, dtype: str = "float32") -> dict[str, Any]:
        """transformers' spelling: nested `rope_parameters` {main, compress}, `compress_rates`, per-layer types."""
        partial = self.qk_rope_head_dim / self.head_dim
        main = {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": partial}
        compress = {"rope_type": "default", **dict(self.rope_scaling or {}), "rope_theta": self.compress_rope_theta,
                    "partial_rotary_factor": partial}
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        skip = ("rope_scaling", "compress_rate_csa", "compress_rate_hca", "qk_rope_head_dim", "layer_types",
                "mlp_layer_types", "eos_token_id")
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        return {"architectures": [ARCHITECTURE], "model_type": "deepseek_v4", **out, "eos_token_id": eos,
                "layer_types": list(self.layer_types), "mlp_layer_types": list(self.mlp_layer_types),
                "compress_rates": {CSA: self.compress_rate_csa, HCA: self.compress_rate_hca},
                "partial_rotary_factor": partial, "rope_parameters": {"main": main, "compress": compress},
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "dtype": dtype}
