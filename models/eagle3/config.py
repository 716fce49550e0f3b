"""The EAGLE-3 draft's configuration and its two external config.json formats.

`Eagle3Config` is the draft layer's own geometry (Llama-style GQA, SwiGLU) plus the vocabularies and
the target features it reads; `Eagle3Config.for_target` derives it from any family config in models/.
It reads and writes:

* the SGLang / EAGLE-official config.json (`LlamaForCausalLMEagle3`: a transformers LlamaConfig plus
  `draft_vocab_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`), SpecForge's
  `llama3-8B-eagle3.json` fields and SGLang's `LlamaForCausalLMEagle3`;
* the vLLM speculators config.json (`Eagle3Speculator`: `transformer_layer_config`, hidden-state
  boundary ids, `speculators_config`), field names from vllm-project/speculators 0.9.0
  `models/eagle3/config.py`, `config.py` and `proposals/greedy.py`.

Layer ids: `aux_layer_ids` are output-of-layer indices (DecoderLM `return_hidden`; default 1, N//2-1, N-4).
The SGLang layout stores them as they are (`eagle_config`, SpecForge's convention; SGLang adds 1
internally); the speculators layout stores hidden-state boundary ids, one higher (vLLM and
speculators read id i as the residual stream entering layer i: default [2, N//2, N-3]).

See docs/formats/eagle3.md (both layouts, their config keys) and docs/speculative-decoding.md
(the architecture and the aux layers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from models.draft_base import speculators_envelope, speculators_layer_ids, validate_geometry
from models.layers import INIT_STD, rope_config_from_hf

SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
DRAFT_ROPE_TYPES = ("default", "llama3")  # target RoPE the draft copies; anything else -> plain theta 10000
DEFAULT_DRAFT_THETA = 10000.0


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low/mid/high target features: the outputs of layers 1, N//2-1 and N-4 (0-indexed),
    i.e. the residual stream entering layers 2, N//2 and N-3 (docs/speculative-decoding.md). For shallow
    targets (N < 7) that formula repeats or reorders layers (N=4 gives 1, 1, 0), which the serving
    loaders refuse (speculators rejects duplicates) and which wastes the draft's input; there
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


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """The draft layer's own geometry (Llama-style GQA, SwiGLU) plus the vocabularies and the target
    features it reads. Defaults are the Llama-3.1-8B draft's (docs/formats/eagle3.md)."""

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
        validate_geometry(self)

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
          GLM without dense layers) F = top_k × expert width, NeMo Automodel's sizing
          (docs/speculative-decoding.md), i.e. the FFN width a token actually passes through.
        - RoPE: the target's theta and scaling when it is plain or llama3 RoPE; otherwise (YaRN,
          linear) plain RoPE with theta 10000 -- the draft only sees a few positions' differences
          and engines build a plain Llama rotary for it. Partial rotary (GLM) is not copied: the
          draft rotates whole heads.
        - aux_layer_ids default to `default_aux_layer_ids(num_hidden_layers)`.
        """
        t = target_config
        kw = dict(
            **draft_geometry(t, int(overrides.get("hidden_size", t.hidden_size))),
            draft_vocab_size=int(draft_vocab_size), target_hidden_size=int(t.hidden_size),
            aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids is not None
            else default_aux_layer_ids(int(t.num_hidden_layers)),
        )
        return cls(**{**kw, **overrides})

    # -- config.json ------------------------------------------------------------------------------

    def _rope_legacy(self) -> dict[str, Any]:
        scaling = None if self.rope_scaling is None else dict(self.rope_scaling)
        return {"rope_theta": self.rope_theta, "rope_scaling": scaling}

    def to_hf(self, dtype: str = "bfloat16", *, target_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The SGLang / EAGLE-official `config.json` (docs/formats/eagle3.md, SpecForge's `llama3-8B-eagle3.json`
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
        draft layer whose `vocab_size` is the verifier's (docs/formats/eagle3.md, speculators PR #188). RoPE in both
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


def draft_geometry(t: Any, D: int) -> dict[str, Any]:
    """The Llama-style layer geometry a feature-level draft of width D takes from a target config (the
    rules of `Eagle3Config.for_target`; DFlash's too): heads, kv heads, head_dim, FFN width, norm eps, RoPE,
    max positions and the target vocabulary."""
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
    return dict(hidden_size=D, intermediate_size=_draft_ffn_width(t), num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=float(t.rms_norm_eps), rope_theta=theta,
                rope_scaling=scaling, max_position_embeddings=int(t.max_position_embeddings),
                vocab_size=int(t.vocab_size))


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
# The speculators config.json
# ------------------------------------------------------------------------------------------------


def speculators_config(config: Eagle3Config, *, target_config: Mapping[str, Any], verifier_name_or_path: str,
                       num_speculative_tokens: int, dtype: str = "bfloat16") -> dict[str, Any]:
    """The speculators `Eagle3SpeculatorConfig` config.json (docs/formats/eagle3.md; field names from speculators 0.9.0
    `models/eagle3/config.py`, `config.py` and `proposals/greedy.py`)."""
    if num_speculative_tokens < 1:
        raise ValueError("num_speculative_tokens must be >= 1")
    return {
        **speculators_envelope(architecture=SPECULATORS_ARCHITECTURE, model_type="eagle3",
                               layer_config=config.transformer_layer_config(dtype, target_config),
                               draft_vocab_size=config.draft_vocab_size, speculative_tokens=num_speculative_tokens,
                               target_config=target_config, verifier_name_or_path=verifier_name_or_path, dtype=dtype),
        "eagle_aux_hidden_state_layer_ids": speculators_layer_ids(config.aux_layer_ids),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "target_hidden_size": None if config.target_hidden_size == config.hidden_size else config.target_hidden_size,
    }
