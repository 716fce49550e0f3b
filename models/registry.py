"""Architecture registry: the HF `architectures` field of config.json -> (config class, model class).

A family registers here once; models/hf.py builds whatever the checkpoint names. Config classes
provide `from_hf(dict)` / `to_hf()`, model classes take `(config, *, rngs, dtype, param_dtype)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from models.llama import MODEL_TYPE_TO_ARCH, Llama, LlamaConfig

ARCHITECTURES: dict[str, tuple[type, type]] = {
    "LlamaForCausalLM": (LlamaConfig, Llama),
    "Qwen3ForCausalLM": (LlamaConfig, Llama),
}


def resolve(config: Mapping[str, Any], source: str = "config.json") -> tuple[type, type]:
    """(config_cls, model_cls) for a config.json dict; falls back on model_type without architectures."""
    archs = config.get("architectures") or [MODEL_TYPE_TO_ARCH.get(config.get("model_type", ""), "")]
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(f"{source}: no supported architecture in {archs} (known: {sorted(ARCHITECTURES)})")
