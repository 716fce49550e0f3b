"""Qwen3 dense: the Llama graph with per-head QK-norm before RoPE, an explicit head_dim that may
differ from D/N, and (for the small sizes) tied embeddings.

Mirrors docs/models/llama-qwen3.md (Qwen3 rows) and transformers
`models/qwen3/modeling_qwen3.py`. The modules are models/llama.py's (`LlamaConfig(qk_norm=True,
architecture="Qwen3ForCausalLM")`); this file is the family's entry in the registry and its presets.

    from models.qwen3 import Qwen3, qwen3_config
    model = Qwen3(qwen3_config("tiny"), rngs=nnx.Rngs(0))
"""

from __future__ import annotations

from typing import Any

from models.llama import Llama, LlamaConfig

Qwen3 = Llama


def qwen3_config(preset: str = "tiny", **overrides: Any) -> LlamaConfig:
    """Presets: "tiny" (tests), "0.6b" and "8b" (published shapes, docs/models/llama-qwen3.md)."""
    if preset == "tiny":
        return LlamaConfig.qwen3_tiny(**overrides)
    shapes = {
        "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                     num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                     max_position_embeddings=40960),
        "8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                   max_position_embeddings=40960),
    }
    if preset not in shapes:
        raise ValueError(f"qwen3 preset {preset!r} (known: tiny, {', '.join(shapes)})")
    kw = dict(rms_norm_eps=1e-6, rope_theta=1e6, qk_norm=True, architecture="Qwen3ForCausalLM",
              bos_token_id=None, eos_token_id=151645)
    return LlamaConfig(**{**kw, **shapes[preset], **overrides})


# the registry record (models/families.py): HF architecture -> the config.json model_types it ships with
REGISTRY = {"Qwen3ForCausalLM": ("qwen3",)}
FAMILY = (LlamaConfig, Qwen3)
