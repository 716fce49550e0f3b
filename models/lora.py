"""LoRA adapters on models.layers.Linear, and export in the PEFT layout.

    apply_lora(model, rank=8, alpha=16, rngs=nnx.Rngs(0))        # adds lora_a/lora_b in place
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.LoRAParam)
    grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, batch)
    opt.update(model, grads)
    save_peft_adapter(model, "out/adapter", base_model_name_or_path="base")
    merge_lora(model)                                           # fold into kernels, remove factors

A Linear with LoRA computes y = x W + (alpha / r) · (x A) B with A = lora_a [in, r] (PEFT's
kaiming-uniform init, bound 1/sqrt(in)) and B = lora_b [r, out] (zeros), both `nnx.LoRAParam`.
PEFT stores A as `lora_A.weight [r, in]` and B as `lora_B.weight [out, r]` under
`base_model.model.<HF module name>` (https://github.com/huggingface/peft, `tuners/lora`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from models.hf import writable_dir
from models.layers import Linear, hf_name, param

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_linears(model: nnx.Module) -> list[tuple[tuple, Linear]]:
    return [(p, n) for p, n in nnx.iter_graph(model) if isinstance(n, Linear) and n.lora_a is not None]


def apply_lora(
    model: nnx.Module,
    rank: int,
    alpha: float,
    target_modules: Sequence[str] = DEFAULT_TARGETS,
    rngs: nnx.Rngs | None = None,
) -> nnx.Module:
    """Attach LoRA factors to every Linear whose attribute name is in `target_modules`; returns model."""
    rngs = rngs if rngs is not None else nnx.Rngs(0)
    targets = [(p, n) for p, n in nnx.iter_graph(model)
               if isinstance(n, Linear) and p and p[-1] in target_modules]
    if not targets:
        raise ValueError(f"no Linear named any of {tuple(target_modules)} in {type(model).__name__}")
    for _, lin in targets:
        if lin.lora_a is not None:
            raise ValueError("LoRA is already applied; merge_lora first")
        bound = 1.0 / np.sqrt(lin.in_features)
        dtype = lin.qweight[...].dtype if lin.kernel is None else lin.kernel[...].dtype
        dtype = jnp.float32 if dtype == jnp.int8 else dtype
        a = jax.random.uniform(rngs.params(), (lin.in_features, rank), dtype, -bound, bound)
        lin.lora_a = param(a, (lin.axes[0], None), nnx.LoRAParam)  # [in, r]
        lin.lora_b = param(jnp.zeros((rank, lin.out_features), dtype), (None, lin.axes[1]), nnx.LoRAParam)
        lin.lora_scale = float(alpha) / rank
        lin.lora_rank, lin.lora_alpha = rank, float(alpha)
    return model


def merge_lora(model: nnx.Module) -> nnx.Module:
    """Fold every adapter into its kernel (W += scale · A B) and remove the factors; returns model."""
    for _, lin in lora_linears(model):
        if lin.kernel is None:
            raise ValueError("cannot merge LoRA into an int8 Linear; merge before quantize_int8")
        lin.kernel[...] = lin.weight().astype(lin.kernel[...].dtype)
        lin.lora_a = lin.lora_b = None
        lin.lora_scale, lin.lora_rank, lin.lora_alpha = 0.0, 0, 0.0
    return model


def lora_state_to_peft(
    model: nnx.Module, base_model_name_or_path: str | None = None
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(adapter_config.json dict, adapter_model.safetensors tensors) in the PEFT LoRA layout."""
    linears = lora_linears(model)
    if not linears:
        raise ValueError("model has no LoRA factors; call apply_lora first")
    ranks = {lin.lora_rank for _, lin in linears}
    alphas = {lin.lora_alpha for _, lin in linears}
    if len(ranks) != 1 or len(alphas) != 1:
        raise ValueError(f"PEFT export needs one rank and alpha for all modules, got {ranks} / {alphas}")
    tensors: dict[str, np.ndarray] = {}
    for path, lin in linears:
        name = f"base_model.model.{hf_name(path)}"
        tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(np.asarray(lin.lora_a[...]).T)  # [r, in]
        tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(np.asarray(lin.lora_b[...]).T)  # [out, r]
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": ranks.pop(),
        "lora_alpha": alphas.pop(),
        "lora_dropout": 0.0,
        "target_modules": sorted({p[-1] for p, _ in linears}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    return config, tensors


def save_peft_adapter(
    model: nnx.Module, path_or_url: str, *, base_model_name_or_path: str | None = None
) -> None:
    """Write adapter_config.json + adapter_model.safetensors to a folder (local path or URL)."""
    config, tensors = lora_state_to_peft(model, base_model_name_or_path)
    with writable_dir(path_or_url) as path:
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=2)
        safetensors.numpy.save_file(tensors, os.path.join(path, "adapter_model.safetensors"),
                                    metadata={"format": "pt"})
