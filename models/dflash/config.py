"""The DFlash block drafter's configuration and its speculators config.json.

`DFlashConfig` is the draft's own geometry (Qwen3-style layers: GQA with q/k RMS norms, SwiGLU; one or
more of them), the vocabularies, the target features it reads (`aux_layer_ids`), the block it proposes
in one forward (`block_size`) and the mask token that fills the block's unknown slots.
`DFlashConfig.for_target` derives it from any family config in models/ (the same rules as
`Eagle3Config.for_target`).

It writes and reads the vLLM speculators config.json (`DFlashSpeculator`), field names from
vllm-project/speculators 0.9.0 `src/speculators/models/dflash/config.py` (`DFlashSpeculatorConfig`),
`src/speculators/config.py` (`SpeculatorModelConfig`, `SpeculatorsConfig`, `VerifierConfig`) and
`src/speculators/proposals/greedy.py`.

Layer ids: `aux_layer_ids` are output-of-layer indices (DecoderLM `return_hidden`), as in
`Eagle3Config`. speculators' `aux_hidden_state_layer_ids` are hidden-state boundary ids, one higher
(id i = the residual stream entering layer i, 0 = the embedding output, N = the last layer's output;
`src/speculators/models/utils.py` `resolve_target_layer_ids` defaults them to [2, N//2, N-3] and its
DFlash converter `src/speculators/convert/dflash/converter.py` maps z-lab's `target_layer_ids` with +1).

DFlash: Chen et al., "DFlash: Block Diffusion for Flash Speculative Decoding", arXiv 2602.06036.
See docs/formats/dflash.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from models.draft_base import speculators_envelope, speculators_layer_ids, validate_geometry
from models.eagle3.config import default_aux_layer_ids, draft_geometry
from models.layers import INIT_STD, rope_config_from_hf

SPECULATORS_ARCHITECTURE = "DFlashSpeculator"
SPECULATORS_MODEL_TYPE = "dflash"
LAYER_MODEL_TYPE = "qwen3"  # speculators builds every DFlash layer as Qwen3DFlashDecoderLayer


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """Draft geometry (Qwen3-style: q/k norms, GQA, SwiGLU), vocabularies, target features, block.

    The draft's width is the target's (`hidden_size == target_hidden_size`): the block's tokens are
    embedded with the target's own embedding table and `fc` maps num_aux·D_t -> D (speculators sizes
    `fc` from the layer's hidden size alone).
    """

    hidden_size: int = 4096  # D (= D_t)
    intermediate_size: int = 12288  # F
    num_attention_heads: int = 32  # N
    num_key_value_heads: int | None = 8  # K; None -> N
    head_dim: int | None = 128  # H; None -> D // N
    num_hidden_layers: int = 1  # draft layers (z-lab DFlash drafts: 5; speculators trains 1+)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: Mapping[str, Any] | None = None  # None (plain RoPE) or {"rope_type": "llama3", ...}
    max_position_embeddings: int = 40960
    vocab_size: int = 151936  # V: the TARGET's vocabulary (embedding rows, t2d length)
    draft_vocab_size: int = 151936  # Vd: lm_head rows, d2t length
    target_hidden_size: int | None = None  # D_t; None -> D (must equal D)
    aux_layer_ids: tuple[int, ...] = (1, 17, 32)  # target `return_hidden` indices, low -> high
    block_size: int = 8  # slots per block: the anchor + block_size - 1 proposed tokens
    mask_token_id: int = 151669  # the token id filling slots 1..block_size-1
    train_lm_head: bool = False  # ours: speculators / DFlash keep lm_head frozen (the target's rows)

    def __post_init__(self):
        validate_geometry(self)
        if self.target_hidden_size != self.hidden_size:
            raise ValueError(f"target_hidden_size {self.target_hidden_size} != hidden_size {self.hidden_size}: "
                             "a DFlash draft embeds its block with the target's embedding table")
        if self.num_hidden_layers < 1:
            raise ValueError("num_hidden_layers must be >= 1")
        if self.block_size < 2:
            raise ValueError("block_size must be >= 2 (the anchor plus at least one proposed token)")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @classmethod
    def tiny(cls, vocab_size: int = 256, draft_vocab_size: int = 64, **overrides: Any) -> DFlashConfig:
        """D 64, 4 heads / 2 kv heads of 16, F 128, 1 layer, block 4, aux layers of a 2-layer target,
        the last id as the mask token: for unit tests."""
        kw = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  num_hidden_layers=1, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512,
                  vocab_size=vocab_size, draft_vocab_size=draft_vocab_size, aux_layer_ids=default_aux_layer_ids(2),
                  block_size=4, mask_token_id=vocab_size - 1)
        return cls(**{**kw, **overrides})

    @classmethod
    def for_target(cls, target_config: Any, *, draft_vocab_size: int | None = None,
                   aux_layer_ids: Sequence[int] | None = None, num_layers: int = 1, block_size: int = 8,
                   mask_token_id: int, **overrides: Any) -> DFlashConfig:
        """Draft geometry derived from any family config in models/ (see `Eagle3Config.for_target`:
        D, heads, head_dim, FFN width and RoPE are chosen by the same rules); `overrides` win.

        draft_vocab_size defaults to the target's (no pruning); aux_layer_ids to
        `default_aux_layer_ids(N)` (speculators' default [2, N//2, N-3] in its own convention);
        `mask_token_id` must be a target id the target never emits in practice (z-lab's drafts use a
        reserved / added token).
        """
        t = target_config
        D, V = int(t.hidden_size), int(t.vocab_size)
        kw = dict(
            **draft_geometry(t, D), num_hidden_layers=int(num_layers),
            draft_vocab_size=V if draft_vocab_size is None else int(draft_vocab_size), target_hidden_size=D,
            aux_layer_ids=tuple(aux_layer_ids) if aux_layer_ids is not None
            else default_aux_layer_ids(int(t.num_hidden_layers)),
            block_size=int(block_size), mask_token_id=int(mask_token_id),
        )
        return cls(**{**kw, **overrides})

    # -- config.json ------------------------------------------------------------------------------

    def transformer_layer_config(self, dtype: str = "bfloat16",
                                 target_config: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The speculators `transformer_layer_config`: a transformers Qwen3Config dict of the draft
        layers (`num_hidden_layers` = draft layers, `vocab_size` = the target's, special token ids the
        target's). RoPE in both spellings (transformers 5 `rope_parameters`, legacy `rope_theta` /
        `rope_scaling`)."""
        t = dict(target_config or {})
        scaling = None if self.rope_scaling is None else dict(self.rope_scaling)
        rope = {"rope_type": "default", "rope_theta": self.rope_theta} if scaling is None \
            else {**scaling, "rope_theta": self.rope_theta}
        L = self.num_hidden_layers
        return {
            "model_type": LAYER_MODEL_TYPE,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": L,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_parameters": rope,
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": L,
            "layer_types": ["full_attention"] * L,
            "initializer_range": INIT_STD,
            "tie_word_embeddings": False,
            "use_cache": True,
            "bos_token_id": t.get("bos_token_id"),
            "eos_token_id": t.get("eos_token_id"),
            "pad_token_id": t.get("pad_token_id"),
            "dtype": dtype,
        }

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], source: str = "config.json") -> DFlashConfig:
        """Read a speculators `DFlashSpeculator` config.json (aux ids back to output-of-layer ids)."""
        if d.get("speculators_model_type") != SPECULATORS_MODEL_TYPE:
            raise ValueError(f"{source}: speculators_model_type {d.get('speculators_model_type')!r} is not "
                             f"{SPECULATORS_MODEL_TYPE!r}")
        layer = d["transformer_layer_config"]
        aux = d.get("aux_hidden_state_layer_ids")
        if aux is None:
            raise ValueError(f"{source}: no aux_hidden_state_layer_ids (the target layers the draft reads)")
        if min(aux) < 1:
            raise NotImplementedError(f"{source}: aux layer id 0 (the embedding output) is not supported")
        if d.get("mask_token_id") is None:
            raise ValueError(f"{source}: no mask_token_id")
        if d.get("sample_from_anchor"):
            raise NotImplementedError(f"{source}: sample_from_anchor=true (a DSpark-style draft) is not supported")
        if "sliding_attention" in (layer.get("layer_types") or []):
            raise NotImplementedError(f"{source}: sliding-window draft layers are not supported")
        if layer.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"{source}: hidden_act {layer['hidden_act']!r} (only silu)")
        if layer.get("attention_bias"):
            raise NotImplementedError(f"{source}: attention_bias (the DFlash layer has none)")
        theta, _, scaling = rope_config_from_hf(layer, source=source)
        heads = layer["num_attention_heads"]
        return cls(
            hidden_size=layer["hidden_size"],
            intermediate_size=layer["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=layer.get("num_key_value_heads") or heads,
            head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
            num_hidden_layers=layer.get("num_hidden_layers", 1),
            rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=layer.get("max_position_embeddings", 2048),
            vocab_size=layer["vocab_size"],
            draft_vocab_size=d.get("draft_vocab_size") or layer["vocab_size"],
            target_hidden_size=d.get("target_hidden_size"),
            aux_layer_ids=tuple(int(i) - 1 for i in aux),
            block_size=d.get("block_size", 8),
            mask_token_id=d["mask_token_id"],
        )


def speculators_config(config: DFlashConfig, *, target_config: Mapping[str, Any], verifier_name_or_path: str,
                       dtype: str = "bfloat16") -> dict[str, Any]:
    """The speculators `DFlashSpeculatorConfig` config.json (docs/formats/dflash.md): the greedy
    proposal proposes block_size - 1 tokens (`sample_from_anchor` false: slot 0 is the anchor)."""
    return {
        **speculators_envelope(architecture=SPECULATORS_ARCHITECTURE, model_type=SPECULATORS_MODEL_TYPE,
                               layer_config=config.transformer_layer_config(dtype, target_config),
                               draft_vocab_size=config.draft_vocab_size, speculative_tokens=config.block_size - 1,
                               target_config=target_config, verifier_name_or_path=verifier_name_or_path, dtype=dtype),
        "block_size": config.block_size,
        "target_hidden_size": None,  # = hidden_size (speculators' fc reads num_aux · hidden_size)
        "aux_hidden_state_layer_ids": speculators_layer_ids(config.aux_layer_ids),
        "mask_token_id": config.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": False,
        "tie_word_embeddings": False,
    }
