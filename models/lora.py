"""LoRA adapters on models.layers.Linear and models.moe.Experts, and export in the PEFT layout.

    apply_lora(model, rank=8, alpha=16, targets=ALL_LINEAR, dropout=0.05, rngs=nnx.Rngs(0))  # in place
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.LoRAParam)
    grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, batch)
    save_peft_adapter(model, "out/adapter", base_model_name_or_path="base")
    merge_lora(model)                                           # fold into the weights, remove factors

Targets are matched against the HF module path of each candidate (`lora_candidates`): every Linear
("model.layers.0.self_attn.q_proj", MLA's "...q_a_proj" / "q_b_proj" / "kv_a_proj_with_mqa" /
"kv_b_proj", "...mlp.shared_experts.up_proj", "lm_head") and every stacked expert block
("model.layers.3.mlp.experts": both its gate_up and down projections). A target is a regex that must
`re.fullmatch` the path, except a plain dotted name (letters, digits, `_`, `.`), which matches the
path itself or any path ending in "." + name ("q_proj" is ".*\\.q_proj"; "mlp.experts" every expert
block), as PEFT's list form does. Embeddings and routers are not candidates: a router is never
LoRA-adapted (which experts run stays the base model's choice; a target that matches only routers
is an error saying so). The ALL_LINEAR preset leaves out the LM head; an explicit "lm_head" adds it.
MTP layers (after the main stack) are never candidates: the main forward does not run them.

A Linear with LoRA computes y = x W + (alpha / r) · (drop(x) A) B with A = lora_a [in, r] (PEFT's
kaiming-uniform init, bound 1/sqrt(in)), B = lora_b [r, out] (zeros), both `nnx.LoRAParam`; `drop`
is an `nnx.Dropout(p)` on the LoRA branch input only (PEFT's lora_dropout) with its own 'dropout'
RngStream (its key/count are `nnx.RngState`), active after `model.train()` (and on creation),
the identity after `model.eval()`; p = 0 adds no Dropout at all. Experts hold per-expert factors
(models/moe.py).

PEFT layout (https://github.com/huggingface/peft `tuners/lora`, checked against peft 0.21 on
transformers 5.24 in tests/parity/test_peft_lora_parity.py): Linear factors are
`base_model.model.<path>.lora_A.weight [r, in]` / `lora_B.weight [out, r]` listed in `target_modules`.
Expert blocks are transformers 5's fused `mlp.experts.gate_up_proj [E, 2I, D]` / `down_proj [E, D, I]`
parameters (GPT-OSS: [E, D, 2I] interleaved / [E, I, D]), which peft adapts with `lora.ParamWrapper`
via `target_parameters`: lora_A.weight [E·r, in] (expert-major rows: A_e = rows e·r..e·r+r) and
lora_B.weight [out, r·E] (rank-major columns: B_e = columns k·E + e), one wrapper per parameter,
nested in parameter order, so gate_up_proj's factors sit at `<experts>.base_layer.lora_*` and
down_proj's at `<experts>.lora_*`.

On an MoE base, peft 0.21 rewrites `target_modules` for transformers 5 (peft/utils/
transformers_weight_conversion.py `_convert_peft_config_moe`, the "qwen2_moe" pattern that
qwen3_moe, deepseek_v3 and glm4_moe use): every target named or ending in gate_proj / up_proj /
down_proj / gate is moved to `target_parameters` as the fused `gate_up_proj` / `down_proj`, a regex
string is first resolved to such leaf names, so a dense MLP (DeepSeek's first layers) or the shared
experts would silently lose their adapters. On such bases those Linears are therefore exported as
`target_parameters` "<name>.weight" (a 2-D ParamWrapper: the same lora_A/lora_B keys and math).
ParamWrapper refuses lora_dropout != 0, so with any `target_parameters` the config says 0.0 (dropout
only acts in training; the adapter's function is the same).

A family whose transformers module tree is not named as its checkpoint's tensors (DeepSeek-V4: `attn.wq_a` on
disk is the module `self_attn.q_a_proj`, transformers' conversion mapping renames it at load) gives the model
class `peft_module_name(hf_path) -> module path`, which the export writes (peft injects adapters by module
path). A model's `peft_weight_only` lists module names (after that renaming) whose transformers forward reads
the weight itself rather than running a Linear over its input (V4's grouped `o_a_proj`): they are exported as
`target_parameters` "<name>.weight" too, on any base.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import safetensors.numpy
from flax import nnx

from models.hf import writable_dir
from models.layers import Linear, hf_name
from models.lora_targets import ALL_LINEAR
from models.moe import Experts, Router

# Linear names peft 0.21 remaps onto fused experts on transformers-5 MoE bases (see the module docstring).
PEFT_V5_MOE_RENAMED = ("gate_proj", "up_proj", "down_proj", "gate")

Adapted = Linear | Experts


# ------------------------------------------------------------------------------------------------
# Candidates and target matching
# ------------------------------------------------------------------------------------------------


def _main_stack(model: nnx.Module, path: tuple) -> bool:
    """False for anything inside an MTP layer (layers.{i} with i >= num_hidden_layers)."""
    config = getattr(model, "config", None)
    n = getattr(config, "num_hidden_layers", None)
    return not (n is not None and len(path) > 1 and path[0] == "layers" and int(path[1]) >= n)


def lora_candidates(model: nnx.Module) -> dict[str, tuple[tuple, Adapted]]:
    """HF module path -> (nnx path, module) for every Linear and Experts LoRA can adapt, in graph order."""
    return {hf_name(p): (p, n) for p, n in nnx.iter_graph(model)
            if isinstance(n, (Linear, Experts)) and p and _main_stack(model, p)}


def _compile(target: str) -> re.Pattern:
    if re.fullmatch(r"[\w.]+", target):  # a plain (dotted) name: the path or a suffix after a dot
        return re.compile(r"(?:.*\.)?" + re.escape(target))
    try:
        return re.compile(target)
    except re.error as e:
        raise ValueError(f"LoRA target {target!r} is not a valid regex: {e}") from None


def match_targets(model: nnx.Module, targets: str | Sequence[str]) -> dict[str, tuple[tuple, Adapted]]:
    """The candidates (see `lora_candidates`) whose HF path fullmatches any of `targets`."""
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if not targets:
        raise ValueError("LoRA targets: empty; give a regex, a module name or ALL_LINEAR")
    patterns = [_compile(t) for t in targets]
    candidates = lora_candidates(model)
    chosen = {name: c for name, c in candidates.items() if any(p.fullmatch(name) for p in patterns)}
    if chosen:
        return chosen
    routers = [hf_name(p) for p, n in nnx.iter_graph(model) if isinstance(n, Router)]
    hit = [r for r in routers if any(p.fullmatch(r) for p in patterns)]
    if hit:
        raise ValueError(f"LoRA targets {list(targets)} match only routers ({hit[0]}, ...): routers are never "
                         "LoRA-adapted")
    names = list(candidates)
    sample = names if len(names) <= 12 else names[:8] + ["..."] + names[-3:]
    raise ValueError(f"LoRA targets {list(targets)} match no module of {type(model).__name__}; "
                     f"candidates ({len(names)}): {', '.join(sample)}")


def lora_modules(model: nnx.Module) -> list[tuple[tuple, Adapted]]:
    """(nnx path, module) for every Linear / Experts that currently holds LoRA factors."""
    return [(p, n) for p, n in nnx.iter_graph(model)
            if (isinstance(n, Linear) and n.lora_a is not None)
            or (isinstance(n, Experts) and n.gate_up_lora_a is not None)]


def lora_linears(model: nnx.Module) -> list[tuple[tuple, Linear]]:
    return [(p, n) for p, n in lora_modules(model) if isinstance(n, Linear)]


# ------------------------------------------------------------------------------------------------
# apply / merge
# ------------------------------------------------------------------------------------------------


def apply_lora(
    model: nnx.Module,
    rank: int,
    alpha: float,
    targets: str | Sequence[str] = ALL_LINEAR,
    dropout: float = 0.0,
    rngs: nnx.Rngs | None = None,
) -> nnx.Module:
    """Attach LoRA factors (nnx.LoRAParam) to every candidate matched by `targets`; returns model.

    `rngs.params` draws the A factors; the dropout masks come from `rngs.dropout` when `rngs` has
    that stream, else from a 'dropout' stream seeded by `rngs.params`."""
    if rank < 1 or alpha <= 0:
        raise ValueError(f"LoRA rank {rank} / alpha {alpha}: need rank >= 1 and alpha > 0")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout {dropout}: need 0 <= dropout < 1")
    rngs = rngs if rngs is not None else nnx.Rngs(0)
    chosen = match_targets(model, targets)
    already = [name for name, (_, m) in chosen.items() if m.lora_rank]
    if already:
        raise ValueError(f"LoRA is already applied ({already[0]}); merge_lora first")
    stream = None
    if dropout > 0:
        stream = rngs.dropout if "dropout" in rngs else nnx.Rngs(dropout=rngs.params()).dropout
    for _, module in chosen.values():
        module.add_lora(rank, alpha, key=rngs.params(), dropout=dropout, dropout_rngs=stream)
    return model


def merge_lora(model: nnx.Module) -> nnx.Module:
    """Fold every adapter into its weights (W += scale · A B) and remove the factors; returns model."""
    for _, module in lora_modules(model):
        module.merge_lora()
    return model


# ------------------------------------------------------------------------------------------------
# PEFT export
# ------------------------------------------------------------------------------------------------


def _expert_factors(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Our a [E, in, r], b [E, r, out] -> peft ParamWrapper lora_A.weight [E·r, in], lora_B.weight [out, r·E]."""
    E, n_in, r = a.shape
    lora_a = a.transpose(0, 2, 1).reshape(E * r, n_in)  # row e·r + k = A_e[k]
    lora_b = b.transpose(2, 1, 0).reshape(b.shape[2], r * E)  # column k·E + e = B_e[:, k]
    return np.ascontiguousarray(lora_a), np.ascontiguousarray(lora_b)


def _compact(chosen: set[str], groups: dict[str, set[str]]) -> list[str]:
    """Each group's short name when every candidate in it is chosen, else its chosen full names."""
    out: list[str] = []
    for short, members in sorted(groups.items()):
        picked = members & chosen
        if picked == members:
            out.append(short)
        else:
            out.extend(sorted(picked))
    return out


def lora_state_to_peft(
    model: nnx.Module, base_model_name_or_path: str | None = None, *, dropout: float | None = None
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(adapter_config.json dict, adapter_model.safetensors tensors) in the PEFT LoRA layout that peft
    0.21 loads onto the transformers 5 base (see the module docstring). `dropout` is written as
    lora_dropout (default: the rate the adapters were created with)."""
    modules = lora_modules(model)
    if not modules:
        raise ValueError("model has no LoRA factors; call apply_lora first")
    ranks = {m.lora_rank for _, m in modules}
    alphas = {m.lora_alpha for _, m in modules}
    if len(ranks) != 1 or len(alphas) != 1:
        raise ValueError(f"PEFT export needs one rank and alpha for all modules, got {ranks} / {alphas}")
    if dropout is None:
        rates = {m.lora_dropout.rate if m.lora_dropout is not None else 0.0 for _, m in modules}
        dropout = max(rates)
    candidates = lora_candidates(model)
    moe_base = any(isinstance(m, Experts) for _, m in candidates.values())
    peft_name = getattr(model, "peft_module_name", None) or (lambda name: name)
    weight_only = tuple(getattr(model, "peft_weight_only", ()))

    def as_param(name: str) -> bool:  # a Linear peft would remap onto fused experts, or must adapt by its weight
        leaf = name.rsplit(".", 1)[-1]
        return leaf in weight_only or (moe_base and leaf in PEFT_V5_MOE_RENAMED)

    from models.hf import to_host  # whole on this host (a gathered multi-host model: its local copy)

    tensors: dict[str, np.ndarray] = {}
    chosen_modules: set[str] = set()
    chosen_params: set[str] = set()
    for path, m in modules:
        name = peft_name(hf_name(path))
        key = f"base_model.model.{name}"
        if isinstance(m, Linear):
            tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(to_host(m.lora_a[...]).T)  # [r, in]
            tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(to_host(m.lora_b[...]).T)  # [out, r]
            if as_param(name):
                chosen_params.add(f"{name}.weight")
            else:
                chosen_modules.add(name)
            continue
        b_gu = to_host(m.gate_up_lora_b[...])  # [E, r, 2I]
        if m.hf_layout == "gpt_oss":  # gate / up interleaved on the output axis
            I = m.intermediate_size
            b_gu = np.stack([b_gu[..., :I], b_gu[..., I:]], axis=-1).reshape(b_gu.shape)
        # gate_up_proj's ParamWrapper is the inner one (base_layer), down_proj's the outer
        a, b = _expert_factors(to_host(m.gate_up_lora_a[...]), b_gu)
        tensors[f"{key}.base_layer.lora_A.weight"], tensors[f"{key}.base_layer.lora_B.weight"] = a, b
        a, b = _expert_factors(to_host(m.down_lora_a[...]), to_host(m.down_lora_b[...]))
        tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
        chosen_params.update({f"{name}.gate_up_proj", f"{name}.down_proj"})

    # short names (PEFT's suffix match) where they select exactly the chosen set, else full paths
    module_groups: dict[str, set[str]] = {}
    param_groups: dict[str, set[str]] = {}
    for hf_path, (_, m) in candidates.items():
        name = peft_name(hf_path)
        if isinstance(m, Experts):
            for p in ("gate_up_proj", "down_proj"):
                param_groups.setdefault(f"experts.{p}", set()).add(f"{name}.{p}")
        elif as_param(name):
            param_groups.setdefault(f"{name.rsplit('.', 1)[-1]}.weight", set()).add(f"{name}.weight")
        else:
            module_groups.setdefault(name.rsplit(".", 1)[-1], set()).add(name)
    target_modules = _compact(chosen_modules, module_groups)
    target_parameters = _compact(chosen_params, param_groups)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": ranks.pop(),
        "lora_alpha": alphas.pop(),
        "lora_dropout": 0.0 if target_parameters else float(dropout),
        "target_modules": target_modules or None,
        "target_parameters": target_parameters or None,
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

