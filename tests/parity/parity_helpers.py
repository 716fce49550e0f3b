"""Shared builders for parity tests (used by conftest.py and the test modules): tiny random
transformers checkpoints saved to tmp_path.

Reference: /work/shared/reference/architectures.md §10 (tiny random configs, fp32, eager attention,
`jax_default_matmul_precision="highest"`).
"""

from __future__ import annotations

import jax
import numpy as np
import torch
import transformers

jax.config.update("jax_default_matmul_precision", "highest")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)

VARIANTS = {
    "llama": (transformers.LlamaConfig, dict(head_dim=16)),
    "llama_bias": (transformers.LlamaConfig, dict(head_dim=16, attention_bias=True, mlp_bias=True)),
    "llama3_rope": (transformers.LlamaConfig, dict(head_dim=16, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=24, rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 1e6})),
    "qwen3_tied": (transformers.Qwen3Config, dict(head_dim=24, tie_word_embeddings=True)),
}


def build_hf(variant: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A random fp32 transformers model; norms and biases are randomised so that they matter."""
    config_cls, extra = VARIANTS[variant]
    config = config_cls(**TINY, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                         dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
    return model


def hf_logits(model, ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    with torch.no_grad():
        kw = {} if attention_mask is None else {"attention_mask": torch.tensor(attention_mask)}
        return model(torch.tensor(np.asarray(ids), dtype=torch.long), **kw).logits.float().numpy()


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
