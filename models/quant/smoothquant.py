"""SmoothQuant (Xiao et al. 2022, arXiv:2211.10438): move activation outliers into the weights before W8A8
quantization, without changing the float model's function.

For a group of Linears reading one RMSNorm's output, per input channel j

    s_j = max|X_j|^α / max_k |W_kj|^(1-α)

with max|X_j| over the calibration tokens (models/quant/calibration.py `Stats.abs_max`) and max|W_kj| over
every output row of every Linear of the group; then the norm's weight is divided by s and each Linear's
column j multiplied by s_j, so x·W is unchanged while the activation channels the GEMM quantizes per token
are flatter. α = 0.5 by default (`Options.smoothquant_alpha`). As llm-compressor's `SmoothQuantModifier`
(`modifiers/smoothquant/base.py`, `mappings.py`): input_layernorm -> q/k/v (MLA: its first projections, and
its q_a / kv_a norms -> q_b / kv_b), post_attention_layernorm -> the MLP's gate/up or, in an MoE block,
every expert's and the shared experts' gate/up, the router compensated (models/quant/awq.py
`fold_moe_input`). A channel with max|X| = 0 or max|W| = 0 keeps s = 1. See docs/quantization.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx

from models.moe import Experts
from models.quant.awq import _scale_in, _scale_norm, attention_folds, fold_moe_input
from models.quant.calibration import ExpertStats, Stats
from models.quant.targets import Unit, _module


def smoothing_scales(act_max: np.ndarray, w_max: np.ndarray, alpha: float) -> np.ndarray:
    """act_max [in], w_max [in] -> s [in] float32 = act_max^α / w_max^(1-α); 1 where either is 0."""
    a, w = np.asarray(act_max, np.float64), np.asarray(w_max, np.float64)
    ok = (a > 0) & (w > 0)
    s = np.where(ok, np.power(np.where(ok, a, 1.0), alpha) / np.power(np.where(ok, w, 1.0), 1.0 - alpha), 1.0)
    return s.astype(np.float32)


def _col_max(lin: nnx.Module) -> np.ndarray:
    return np.abs(np.asarray(lin.kernel[...], np.float32)).max(axis=1)  # kernel [in, out] -> [in]


def smooth_layer(layer: nnx.Module, i: int, stats: dict[str, Stats | ExpertStats], units: Sequence[Unit],
                 alpha: float) -> list[dict[str, Any]]:
    """Fold SmoothQuant scales into decoder layer i in place and rescale `stats` to the smoothed inputs.
    Returns one row per fold: where, which modules, and the largest activation-channel range over the
    median before and after (how much flatter the quantized input got)."""
    quantized = {u.name for u in units}
    pre = f"model.layers.{i}"
    rows: list[dict[str, Any]] = []

    def record(fold: str, modules: list[str], act_max: np.ndarray, s: np.ndarray) -> None:
        spread = lambda a: float(a.max() / max(np.median(a), 1e-30))  # noqa: E731
        rows.append({"fold": fold, "modules": modules, "act_spread": spread(act_max),
                     "smoothed_spread": spread(act_max / s)})

    for fold, norm, names in attention_folds(layer, pre):
        qnames = [n for n in names if n in quantized and n in stats]
        if not qnames or stats[qnames[0]].n <= 0:
            continue
        lins = [_module(layer, n[len(pre) + 1:]) for n in names]
        act_max = stats[qnames[0]].abs_max
        s = smoothing_scales(act_max, np.max([_col_max(m) for m in lins], axis=0), alpha)
        for m in lins:
            _scale_in(m, s)
        _scale_norm(norm, s)
        for n in qnames:
            stats[n] = stats[n].scaled(s)
        record(fold, qnames, act_max, s)

    mlp = layer.mlp
    post = f"{pre}.post_attention_layernorm"
    if hasattr(mlp, "gate_proj"):  # dense SwiGLU
        names = [f"{pre}.mlp.gate_proj", f"{pre}.mlp.up_proj"]
        qnames = [n for n in names if n in quantized and n in stats]
        if qnames and stats[qnames[0]].n > 0:
            act_max = stats[qnames[0]].abs_max
            s = smoothing_scales(act_max, np.maximum(_col_max(mlp.gate_proj), _col_max(mlp.up_proj)), alpha)
            _scale_in(mlp.gate_proj, s)
            _scale_in(mlp.up_proj, s)
            _scale_norm(layer.post_attention_layernorm, s)
            for n in qnames:
                stats[n] = stats[n].scaled(s)
            record(post, qnames, act_max, s)
    elif hasattr(mlp, "experts"):
        _smooth_moe(layer, mlp, f"{pre}.mlp", stats, quantized, alpha, record)
    return rows


def _smooth_moe(layer: nnx.Module, moe: nnx.Module, prefix: str, stats: dict[str, Stats | ExpertStats],
                quantized: set[str], alpha: float, record: Any) -> None:
    """One scale for everything reading the MoE block's normed input: every expert's gate/up and the shared
    experts' (their column maxima pooled), activation ranges over all routed tokens."""
    ex: Experts = moe.experts
    name = f"{prefix}.experts"
    key = f"{name}.gate_up"
    if name not in quantized or key not in stats:
        return
    pooled = stats[key].pooled()
    if pooled.n <= 0:
        return
    w_max = np.abs(np.asarray(ex.gate_up[...], np.float32)).max(axis=(0, 2))  # [E, D, 2I] -> [D]
    shared = getattr(moe, "shared_experts", None)
    sh = f"{prefix}.shared_experts"
    if shared is not None:
        w_max = np.maximum(w_max, np.maximum(_col_max(shared.gate_proj), _col_max(shared.up_proj)))
    s = smoothing_scales(pooled.abs_max, w_max, alpha)
    fold_moe_input(moe, s, lambda t: _scale_norm(layer.post_attention_layernorm, t))
    stats[key] = stats[key].scaled(s)
    shared_names = [n for n in (f"{sh}.gate_proj", f"{sh}.up_proj") if n in stats]
    for n in shared_names:
        stats[n] = stats[n].scaled(s)
    record(f"{prefix} post_attention_layernorm (+ router)", [name, *shared_names], pooled.abs_max, s)
