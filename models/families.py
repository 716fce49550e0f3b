"""Architecture registry: the HF `architectures` field of config.json -> (config class, model class).

A family is one module listed in `MODULES`, holding its one registration record next to its classes:

    REGISTRY = {"LlamaForCausalLM": ("llama",)}   # HF architectures entry -> the config.json model_types it ships with
    FAMILY = (LlamaConfig, Llama)                 # config class (`from_hf(dict)` / `to_hf()`), model class

`REGISTRY` must be a literal: it is read from the module's source (`ast.literal_eval`), not by importing
the module, so resolving a Llama never imports the MoE families and `from models import ARCHITECTURES`
never imports JAX. A module is imported only when a config.json names one of its architectures; model
classes take `(config, *, rngs, dtype, param_dtype)`. docs/adding-a-family.md walks through adding one;
transformers' `AutoConfig` / `AutoModelForCausalLM` mappings are the public counterpart
(https://huggingface.co/docs/transformers/model_doc/auto).

`ARCHITECTURES` (architecture -> module, in `MODULES` order) and `MODEL_TYPES` (model_type -> architecture,
used when config.json has no `architectures`, e.g. `kimi_k2` -> `DeepseekV3ForCausalLM`) are derived from
the records whenever they are read, so they follow `MODULES`.
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
from collections.abc import Mapping
from typing import Any

MODULES: tuple[str, ...] = (  # in this order in ARCHITECTURES and in the "supported:" list of errors
    "models.llama",
    "models.qwen3",
    "models.qwen3_moe",
    "models.deepseek_v3",  # DeepSeek-V3, R1, V3.1 and Kimi K2
    "models.gpt_oss",
    "models.glm4_moe",
    "models.deepseek_v32",  # DeepSeek-V3.2 (DSA)
    "models.glm_moe_dsa",  # GLM-5 (DSA with cross-layer top-k sharing)
    "models.deepseek_v4",  # DeepSeek-V4 (CSA / HCA compressed attention, mHC, hash routing)
)
RECORD = "REGISTRY"  # the name of a family module's registration record


def read_record(module: str) -> dict[str, tuple[str, ...]]:
    """The `REGISTRY` literal of family module `module` ("models.llama"), read from its source without
    importing it. Raises ValueError naming the module when it is missing or malformed."""
    spec = importlib.util.find_spec(module)
    source = None if spec is None or spec.loader is None else spec.loader.get_source(module)  # type: ignore[attr-defined]
    if source is None:
        raise ValueError(f"family module {module}: not found (MODULES in models/families.py)")
    values = [node.value for node in ast.parse(source).body
              if any(isinstance(t, ast.Name) and t.id == RECORD
                     for t in (node.targets if isinstance(node, ast.Assign) else
                               [node.target] if isinstance(node, ast.AnnAssign) else []))]
    if len(values) != 1 or values[0] is None:
        raise ValueError(f"family module {module}: no top-level {RECORD} = {{architecture: (model_type, ...)}}")
    try:
        record = ast.literal_eval(values[0])
    except ValueError:
        raise ValueError(f"family module {module}: {RECORD} must be a literal (it is read without importing "
                         "the module)") from None
    ok = isinstance(record, dict) and record and all(
        isinstance(a, str) and a and isinstance(t, (tuple, list)) and all(isinstance(x, str) and x for x in t)
        for a, t in record.items())
    if not ok:
        raise ValueError(f"family module {module}: {RECORD} {record!r}: must map architecture names to tuples of "
                         "model_type names")
    return {arch: tuple(types) for arch, types in record.items()}


@functools.cache
def _registry(modules: tuple[str, ...]) -> tuple[dict[str, str], dict[str, str]]:
    """(architecture -> module, model_type -> architecture) of the records of `modules`; a name claimed twice
    is an error naming both modules."""
    archs: dict[str, str] = {}
    types: dict[str, str] = {}
    for module in modules:
        for arch, model_types in read_record(module).items():
            if arch in archs:
                raise ValueError(f"family module {module}: architecture {arch!r} is registered by {archs[arch]} too")
            archs[arch] = module
            for model_type in model_types:
                if model_type in types:
                    raise ValueError(f"family module {module}: model_type {model_type!r} is registered for "
                                     f"{types[model_type]} too")
                types[model_type] = arch
    return archs, types


def __getattr__(name: str) -> dict[str, str]:
    """ARCHITECTURES and MODEL_TYPES, derived from the records of the modules in `MODULES` now (fresh dicts)."""
    if name == "ARCHITECTURES":
        return dict(_registry(tuple(MODULES))[0])
    if name == "MODEL_TYPES":
        return dict(_registry(tuple(MODULES))[1])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def family(architecture: str) -> tuple[type, type]:
    """(config_cls, model_cls) of a registered architecture name: its module's `FAMILY`."""
    module = _registry(tuple(MODULES))[0][architecture]
    classes = getattr(importlib.import_module(module), "FAMILY", None)
    if classes is None:
        raise ValueError(f"family module {module}: no FAMILY = (config class, model class)")
    return classes


def resolve(config: Mapping[str, Any], source: str = "config.json") -> tuple[type, type]:
    """(config_cls, model_cls) for a config.json dict; falls back on model_type without architectures."""
    architectures, model_types = _registry(tuple(MODULES))
    archs = config.get("architectures") or [model_types.get(config.get("model_type", ""), "")]
    for arch in archs:
        if arch in architectures:
            return family(arch)
    raise ValueError(f"{source}: architectures {archs} is not supported (supported: {', '.join(architectures)})")
