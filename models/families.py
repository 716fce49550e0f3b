"""Architecture registry: the HF `architectures` field of config.json -> (config class, model class).

One family per module (models/llama.py, qwen3.py, qwen3_moe.py, deepseek_v3.py, gpt_oss.py,
glm4_moe.py); each defines `FAMILY = (ConfigClass, ModelClass)`. Modules are imported on first
use, so loading a Llama never imports the MoE families. Config classes provide `from_hf(dict)` /
`to_hf()`, model classes take `(config, *, rngs, dtype, param_dtype)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

ARCHITECTURES: dict[str, str] = {  # HF architectures entry -> family module
    "LlamaForCausalLM": "models.llama",
    "Qwen3ForCausalLM": "models.qwen3",
    "Qwen3MoeForCausalLM": "models.qwen3_moe",
    "DeepseekV3ForCausalLM": "models.deepseek_v3",  # DeepSeek-V3, R1, V3.1 and Kimi K2
    "GptOssForCausalLM": "models.gpt_oss",
    "Glm4MoeForCausalLM": "models.glm4_moe",
}
MODEL_TYPES: dict[str, str] = {  # config.json model_type -> architecture, when `architectures` is absent
    "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
}


def family(architecture: str) -> tuple[type, type]:
    """(config_cls, model_cls) of a registered architecture name."""
    return importlib.import_module(ARCHITECTURES[architecture]).FAMILY


def resolve(config: Mapping[str, Any], source: str = "config.json") -> tuple[type, type]:
    """(config_cls, model_cls) for a config.json dict; falls back on model_type without architectures."""
    archs = config.get("architectures") or [MODEL_TYPES.get(config.get("model_type", ""), "")]
    for arch in archs:
        if arch in ARCHITECTURES:
            return family(arch)
    raise ValueError(f"{source}: architectures {archs} is not supported (supported: {', '.join(ARCHITECTURES)})")
