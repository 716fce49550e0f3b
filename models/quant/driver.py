"""Quantize a model: `quantize_model` runs the whole post-training pass in place, the way llm-compressor's
`oneshot` (`entrypoints/oneshot.py`) runs its quantization modifiers over a model.

    scheme = parse_scheme("w4a16-gptq")                       # models/quant/schemes.py
    report = quantize_model(model, scheme, calibration)       # in place; calibration: [(ids, segment_ids)]
    save_pretrained(model, "out/")                            # compressed-tensors (models/quant/formats/)

With `Options.rotate` = "hadamard" the float model first gets QuaRot-style rotations folded into its weights
(models/quant/rotation.py). Per decoder layer: collect the calibration statistics
(models/quant/calibration.py), fold SmoothQuant (models/quant/smoothquant.py) or AWQ scales
(models/quant/awq.py), quantize every selected module (models/quant/targets.py) by FP8 blocks / channels,
GPTQ (arXiv:2210.17323) or RTN (models/quant/quantizers.py), set the activation quantization the scheme asks
for (NVFP4's input global scales from the calibration inputs), then feed the quantized layer's output on
(its activations quantized as the engine will). An expert stack is quantized `expert_chunk` experts at a
time: the chunk's Hessians are built
(`ExpertStats.chunks`), each expert GPTQ'd, and the chunk dropped, so no more than expert_chunk × in²
Hessian floats are held. An expert with fewer than `expert_min_tokens` routed tokens falls back to the
layer's statistics pooled over all its experts (the pooled H comes from the calibration forward, ready
before the first chunk; reported per expert); every selected module must come out quantized. The report
has one row per module: method, tokens, relative weight and output error. See docs/quantization.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from flax import nnx

from models.layers import Linear, hf_name
from models.moe import Experts
from models.quant import quantizers as Q
from models.quant.awq import awq_layer
from models.quant.calibration import ExpertStats, Stats, calibration_tokens, collect_stats, layer_inputs, next_inputs
from models.quant.formats import fp4_formats, fp8_formats, int_formats  # noqa: F401 - the formats it quantizes to
from models.quant.rotation import rotate_model
from models.quant.schemes import Options, Scheme, parse_scheme
from models.quant.smoothquant import smooth_layer
from models.quant.state import QMatrix, set_activations, set_experts, set_linear
from models.quant.targets import Unit, check_folds, check_supported, is_quantized, quant_units

# ------------------------------------------------------------------------------------------------
# Quantizing one matrix
# ------------------------------------------------------------------------------------------------


def quantize_matrix(w: np.ndarray, stats: Stats | None, scheme: Scheme, opts: Options,
                    global_scale: np.ndarray | None = None) -> tuple[QMatrix, str]:
    """w [out, in] float32 -> (QMatrix, the algorithm used: the format's own rounding, gptq or rtn), by the
    scheme's weight format (models/quant/formats/registry.py). GPTQ without calibration tokens falls back to
    RTN; AWQ's weights arrive already scaled and are rounded by RTN. `global_scale`: NVFP4's, shared with the
    fused siblings (`nvfp4_global_scales`); default: w's own."""
    fmt = scheme.format
    gptq = scheme.method == "gptq" and "gptq" in fmt.methods and stats is not None and stats.n > 0
    return fmt.quantize(w, scheme, stats.H.astype(np.float32) if gptq else None, opts, global_scale)


def dequantized(qm: QMatrix, scheme: Scheme) -> np.ndarray:
    return scheme.format.dequantize(qm, scheme)


def _row(name: str, w: np.ndarray, qm: QMatrix, stats: Stats | None, scheme: Scheme, how: str,
         fallback: str | None = None) -> dict[str, Any]:
    """One report row; `fallback` says why a module did not get the scheme's own algorithm."""
    w_hat = dequantized(qm, scheme)
    row = {"module": name, "method": how, "tokens": int(stats.n) if stats is not None else 0,
           "weight_error": float(np.linalg.norm(w - w_hat) / max(np.linalg.norm(w), 1e-30))}
    if fallback:
        row["fallback"] = fallback
    if stats is not None and stats.n > 0:
        row["output_error"] = float(Q.output_error(w, w_hat, stats.H.astype(np.float32)))
    return row


# ------------------------------------------------------------------------------------------------
# NVFP4 global scales: one per group of projections an engine fuses into one GEMM
# ------------------------------------------------------------------------------------------------

# vLLM / SGLang load q/k/v, MLA's q_a/kv_a and gate/up as one fused weight with ONE global scale, so each group's
# global scale comes from its largest |w| (llm-compressor `update_fused_layer_weight_global_scales` does the same)
FUSED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("q_a_proj", "kv_a_proj_with_mqa"), ("gate_proj", "up_proj"))


def fused_groups(names: Sequence[str]) -> list[list[str]]:
    """Module names grouped as engines fuse them: one group per parent module and FUSED_PROJECTIONS entry
    (so each expert's gate/up pair too, `...experts.3.gate_proj` with `...experts.3.up_proj`); every other
    module alone."""
    group_of = {p: i for i, g in enumerate(FUSED_PROJECTIONS) for p in g}
    members: dict[tuple, list[str]] = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        members.setdefault((parent, group_of.get(leaf, leaf)), []).append(name)
    return list(members.values())


def nvfp4_global_scales(units: Sequence[Unit], scheme: Scheme) -> dict[str, np.ndarray]:
    """HF name -> the global scale [1] (NVFP4's: a format with `shared_global`) of every quantized Linear, shared
    within fused groups. (Experts: each expert's gate/up share one, set in `_quantize_unit`.)"""
    amax = {u.name: float(np.max(np.abs(np.asarray(u.module.weight(), np.float32)), initial=0.0))
            for u in units if isinstance(u.module, Linear)}
    return {n: scheme.format.global_scale(max(amax[m] for m in group)) for group in fused_groups(list(amax))
            for n in group}


# ------------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------------


def _quantize_unit(unit: Unit, stats: dict[str, Stats | ExpertStats], scheme: Scheme, opts: Options,
                   awq_folded: set[str] = frozenset(), globals_: dict[str, np.ndarray] | None = None
                   ) -> list[dict[str, Any]]:
    if isinstance(unit.module, Linear):
        w = np.asarray(unit.module.weight(), np.float32).T  # [out, in], LoRA folded in
        st = stats.get(unit.name)
        qm, how = quantize_matrix(w, st, scheme, opts, (globals_ or {}).get(unit.name))
        set_linear(unit.module, qm, scheme)
        return [_row(unit.name, w, qm, st, scheme, *_label(unit.name, how, st, scheme, awq_folded))]
    ex: Experts = unit.module
    gu, down = (np.asarray(a, np.float32) for a in ex.weights())  # [E, D, 2I], [E, I, D]
    I, E = ex.intermediate_size, ex.num_experts
    rows: list[dict[str, Any]] = []
    mats: dict[str, list[QMatrix]] = {"gate_proj": [], "up_proj": [], "down_proj": []}
    for key, parts in (("gate_up", (("gate_proj", gu[:, :, :I]), ("up_proj", gu[:, :, I:]))),
                       ("down_proj", (("down_proj", down),))):
        st_all: ExpertStats | None = stats.get(f"{unit.name}.{key}")
        pooled = st_all.pooled() if st_all is not None else None  # ready before any chunk: the fallback's H
        # experts' Hessians chunk by chunk (opts.expert_chunk of them at a time), dropped after their GPTQ
        chunks = st_all.chunks(opts.expert_chunk) if st_all is not None else [(0, E, None)]
        for c0, c1, H in chunks:  # H [c1 - c0, in, in] or None
            for e in range(c0, c1):
                st = None if H is None else st_all.expert(e, H[e - c0])
                fallback = st is not None and st.n < opts.expert_min_tokens and pooled is not None and pooled.n > 0
                g = scheme.format.global_scale(max(float(np.abs(stack[e]).max(initial=0.0)) for _, stack in parts)) \
                    if scheme.format.shared_global else None  # gate and up: one fused projection, one global scale
                for part, stack in parts:
                    w = stack[e].T  # [out, in]
                    qm, how = quantize_matrix(w, pooled if fallback else st, scheme, opts, g)
                    how, note = _label(unit.name, how, pooled if fallback else st, scheme, awq_folded)
                    if fallback and scheme.method == "gptq":
                        note = (f"{int(st.n)} routed tokens < expert_min_tokens {opts.expert_min_tokens}: "
                                "pooled experts' H")
                    mats[part].append(qm)
                    rows.append(_row(f"{unit.name}.{e}.{part}", w, qm, st, scheme, how, note))
            H = st = None  # the chunk's Hessians (st holds a view) go before the next chunk's are built
    set_experts(ex, mats["gate_proj"], mats["up_proj"], mats["down_proj"], scheme)
    return rows


def _set_unit_activations(unit: Unit, stats: dict[str, Stats | ExpertStats], scheme: Scheme) -> str | None:
    """Have a quantized unit quantize its input activations as the scheme says. NVFP4 activations get their
    static global input scale from the calibration inputs' max |x| (after any SmoothQuant / AWQ fold), as
    llm-compressor's static min-max observer does; an expert stack gets one value for all its experts (the
    largest input over all routed rows: an engine's fused-MoE kernel may reduce per-expert scales to one, and
    equal values make that exact). Returns a note when a unit had no calibration tokens (global scale 1)."""
    if scheme.act is None:
        return None
    if not scheme.static_act:
        set_activations(unit.module, scheme.act)
        return None

    def amax(st: Stats | ExpertStats | None) -> float | None:
        if st is None or st.abs_max is None or float(np.sum(st.n)) <= 0:
            return None
        return float(np.max(st.abs_max))

    if isinstance(unit.module, Linear):
        a = amax(stats.get(unit.name))
        g = Q.nvfp4_global_scale(a) if a is not None else np.ones(1, np.float32)
        set_activations(unit.module, scheme.act, g)
        return None if a is not None else "no calibration tokens: NVFP4 input global scale 1"
    E = unit.module.num_experts
    found = {w: amax(stats.get(f"{unit.name}.{key}")) for w, key in (("gate_up", "gate_up"), ("down", "down_proj"))}
    set_activations(unit.module, scheme.act, {
        w: np.broadcast_to(Q.nvfp4_global_scale(a) if a is not None else np.ones(1, np.float32), (E, 1))
        for w, a in found.items()})
    return None if all(a is not None for a in found.values()) else "no calibration tokens: NVFP4 input global scale 1"


def _label(name: str, how: str, st: Stats | None, scheme: Scheme, awq_folded: set[str]) -> tuple[str, str | None]:
    """(method, fallback reason or None) for the report."""
    if scheme.format.methods == ("rtn",) or scheme.method == "rtn":  # no calibrated algorithm to fall back from
        return how, None
    if st is None or st.n <= 0:
        return "rtn", "no calibration tokens reached it: RTN"
    if scheme.method == "awq" and name not in awq_folded:
        return "rtn", "no foldable op before it: RTN"
    return scheme.method, None


def quantize_model(model: nnx.Module, scheme: Scheme, batches: Sequence[tuple[np.ndarray, np.ndarray]], *,
                   ignore: Sequence[str] = (), opts: Options | None = None) -> dict[str, Any]:
    """Quantize `model` in place with `scheme`, calibrating on `batches` of (input_ids [B, T], segment_ids
    [B, T]) (chat-templated, packed rows; segment 0 = padding). Returns the report: per-module rows
    (method, routed tokens, relative weight and output error), AWQ folds, seconds."""
    opts = opts or Options()
    t0 = time.perf_counter()
    if is_quantized(model):
        raise ValueError("the model is already quantized")
    for path, node in nnx.iter_graph(model):
        if getattr(node, "lora_a", None) is not None or getattr(node, "gate_up_lora_a", None) is not None:
            raise ValueError(f"{hf_name(path)} has a LoRA adapter: merge it (models.merge_lora) before quantizing")
    units = quant_units(model, ignore, scheme)  # mxfp4a16 on GPT-OSS: the experts only (targets.py)
    if not units:
        raise ValueError("nothing to quantize: every Linear is ignored")
    check_supported(units, scheme)
    check_folds(units, scheme, opts.rotate)
    rotation = None
    if opts.rotate is not None:  # block rotations: one Hadamard per activation scale group (32 without one)
        grouped_act = scheme.act_format is not None and scheme.act_format.group is not None
        block = (scheme.group_size if grouped_act else 32) if opts.rotate == "hadamard-block" else None
        rotation = rotate_model(model, seed=opts.rotate_seed, block=block)
    globals_ = nvfp4_global_scales(units, scheme) if scheme.format.shared_global else None
    if not batches:  # RTN and FP8 need no data (the report then has weight errors only); GPTQ / AWQ do
        if scheme.method != "rtn":
            raise ValueError(f"scheme {scheme.name}: {scheme.method.upper()} needs calibration data")
        if scheme.static_act or scheme.smooth:
            what = "SmoothQuant" if scheme.smooth else "its static activation scales"
            raise ValueError(f"scheme {scheme.name}: {what} need calibration data")
        rows = [r for u in units for r in _quantize_unit(u, {}, scheme, opts, globals_=globals_)]
        for u in units:
            _set_unit_activations(u, {}, scheme)
        model.quant_scheme, model.quant_ignore = scheme, tuple(ignore)
        return {"scheme": scheme.name, "modules": rows, "awq": [], "smoothquant": [], "rotation": rotation,
                "seconds": time.perf_counter() - t0, "calibration_tokens": 0}
    L = model.config.num_hidden_layers
    xs, segs, carries = layer_inputs(model, batches)  # [B, T, D], [B, T], {} per batch
    rows: list[dict[str, Any]] = []
    awq_rows: list[dict[str, Any]] = []
    smooth_rows: list[dict[str, Any]] = []
    for i in range(L):
        layer_units = [u for u in units if u.layer == i]
        stats = collect_stats(model, xs, segs, i, layer_units, expert_chunk=opts.expert_chunk,
                              carries=carries) if layer_units else {}
        if scheme.smooth:
            smooth_rows += smooth_layer(model.layers[i], i, stats, layer_units, opts.smoothquant_alpha)
        if scheme.method == "awq":
            awq_rows += awq_layer(model.layers[i], i, stats, layer_units, scheme, opts)
        folded = {m for r in awq_rows for m in r["modules"]}
        for u in layer_units:
            rows += _quantize_unit(u, stats, scheme, opts, folded, globals_)
            if note := _set_unit_activations(u, stats, scheme):
                rows[-1]["act_fallback"] = note
        xs, carries = next_inputs(model, xs, segs, carries, i)  # the quantized layer's output
    for u in units:  # modules the main stack never runs (e.g. DeepSeek/GLM MTP layers): no calibration
        if u.layer is None or u.layer >= L:
            rows += _quantize_unit(u, {}, scheme, opts, globals_=globals_)
            if note := _set_unit_activations(u, {}, scheme):
                rows[-1]["act_fallback"] = note
    model.quant_scheme, model.quant_ignore = scheme, tuple(ignore)
    missing = [u.name for u in units if not _unit_quantized(u)]
    if missing:  # coverage: every selected module must come out quantized (issue trackers; docs/quantization.md)
        raise AssertionError(f"not quantized: {missing}")
    return {"scheme": scheme.name, "modules": rows, "awq": awq_rows, "smoothquant": smooth_rows, "rotation": rotation,
            "seconds": time.perf_counter() - t0, "calibration_tokens": calibration_tokens(batches)}


def _unit_quantized(u: Unit) -> bool:
    return u.module.qweight is not None if isinstance(u.module, Linear) else u.module.quantized


def quantize_int8(model: nnx.Module) -> nnx.Module:
    """W8A16 round-to-nearest without calibration (int8 needs none); in place, returns the model."""
    quantize_model(model, parse_scheme("int8"), [])
    return model
