"""The quantized state of a model in memory. `QMatrix` is one weight's codes, scales and zero points in
the HF [out, in] orientation (the orientation of every file format); `Linear` (models/layers.py) and the
stacked `Experts` (models/moe.py) hold them transposed, [in, out]. The driver sets this state
(models/quant/driver.py), the file formats read and write it (models/quant/formats/).

Codes are signed int8 (int4 codes one per byte) or float8_e4m3fn (FP8 values, or FP4 E2M1 values, which
e4m3 holds exactly, sign of zero included); scales float32 [out, G] per input group (G = 1: per channel) or
[out/128, in/128] FP8 tiles; an NVFP4 global scale float32 [1]; zero points int8 [out, G] for asymmetric schemes:
compressed-tensors' `weight_scale` / `weight_zero_point` conventions (`quantization/lifecycle/
initialize.py`). See docs/quantization.md and docs/formats/compressed-tensors.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.layers import Linear, QuantScale, QuantWeight, QuantZero, param
from models.moe import Experts
from models.quant.schemes import FP4_GROUP, Scheme, parse_scheme
from models.quant.targets import expert_part, quant_units

# ------------------------------------------------------------------------------------------------
# Setting and reading the state: HF-oriented [out, in] codes, transposed to the kernels' [in, out]
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class QMatrix:
    """One quantized weight in the HF orientation: codes [out, in] (int8 or float8_e4m3fn), scale [out, G]
    (or FP8 tiles [out/128, in/128]), zero [out, G] or None, NVFP4's global scale [1] or None, and NVFP4
    activations' global input scale [1] or None."""

    q: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None = None
    global_scale: np.ndarray | None = None
    input_global: np.ndarray | None = None


def set_linear(lin: Linear, qm: QMatrix, scheme: Scheme) -> None:
    """Turn a Linear into its quantized form (the float kernel and LoRA factors are dropped); the codes'
    dtype and scale tiles are the scheme's weight format's."""
    a_in, a_out = lin.axes
    fmt = scheme.format
    lin.qweight = param(jnp.asarray(qm.q.T, jnp.dtype(fmt.codes)), (a_in, a_out), QuantWeight)  # [in, out]
    lin.scale = param(jnp.asarray(qm.scale.T, jnp.float32), (None, a_out), QuantScale)  # [G, out]
    lin.zero = None if qm.zero is None else param(jnp.asarray(qm.zero.T, jnp.int8), (None, a_out), QuantZero)
    lin.qglobal = None if qm.global_scale is None else param(jnp.asarray(qm.global_scale, jnp.float32).reshape(1),
                                                             (None,), QuantScale)
    lin.qblock = fmt.block
    lin.qbits = scheme.bits
    lin.kernel = None
    lin.lora_a = lin.lora_b = lin.lora_dropout = None


def set_experts(ex: Experts, gate: Sequence[QMatrix], up: Sequence[QMatrix], down: Sequence[QMatrix],
                scheme: Scheme) -> None:
    """Per-expert HF matrices (gate_proj, up_proj [I, D]; down_proj [D, I]) -> stacked codes: gate_up
    [E, D, 2I] (gate columns first), scales [E, G, 2I] (FP8: gate's tiles then up's, [E, D/128, 2·I/128]);
    NVFP4 global scales [E, 1] (gate's and up's must be equal: one scale for the fused projection)."""
    for e, (g, u) in enumerate(zip(gate, up, strict=True)):
        if g.global_scale is not None and not np.array_equal(g.global_scale, u.global_scale):
            raise ValueError(f"expert {e}: gate_proj and up_proj have different NVFP4 global scales "
                             f"({g.global_scale} vs {u.global_scale}); fused projections share one")
    fused = [QMatrix(np.concatenate([g.q, u.q], 0), np.concatenate([g.scale, u.scale], 0),
                     None if g.zero is None else np.concatenate([g.zero, u.zero], 0), g.global_scale)
             for g, u in zip(gate, up, strict=True)]
    for w, mats, axes in (("gate_up", fused, ("expert", "embed", "mlp")), ("down", down, ("expert", "mlp", "embed"))):
        setattr(ex, f"{w}_q", param(jnp.asarray(np.stack([m.q.T for m in mats]), jnp.dtype(scheme.format.codes)), axes,
                                    QuantWeight))  # [E, in, out]
        setattr(ex, f"{w}_scale", param(jnp.asarray(np.stack([m.scale.T for m in mats]), jnp.float32),
                                        (axes[0], None, axes[2]), QuantScale))  # [E, G, out]
        zero = None if mats[0].zero is None else param(jnp.asarray(np.stack([m.zero.T for m in mats]), jnp.int8),
                                                       (axes[0], None, axes[2]), QuantZero)
        setattr(ex, f"{w}_zero", zero)
        glob = None if mats[0].global_scale is None else param(
            jnp.asarray(np.stack([np.asarray(m.global_scale, np.float32).reshape(1) for m in mats])), (axes[0], None),
            QuantScale)  # [E, 1]
        setattr(ex, f"{w}_global", glob)
        setattr(ex, w, None)
    ex.gate_up_lora_a = ex.gate_up_lora_b = ex.down_lora_a = ex.down_lora_b = ex.lora_dropout = None
    ex.qblock = scheme.format.block
    ex.qbits = scheme.bits


def set_activations(m: Linear | Experts, act: str | None,
                    input_global: np.ndarray | dict[str, np.ndarray] | None = None) -> None:
    """Have a quantized module quantize its input activations (`act`: models/numerics.py kinds, None: off).
    `input_global`: NVFP4's calibrated global input scale, [1] for a Linear; for experts {"gate_up": [E, 1],
    "down": [E, 1]}."""
    m.input_quant = act
    if isinstance(m, Linear):
        m.input_global = None if input_global is None else param(
            jnp.asarray(input_global, jnp.float32).reshape(1), (None,), QuantScale)
        return
    for w in ("gate_up", "down"):
        g = None if input_global is None else param(
            jnp.asarray(input_global[w], jnp.float32).reshape(m.num_experts, 1), ("expert", None), QuantScale)
        setattr(m, f"{w}_input_global", g)


def linear_qmatrix(lin: Linear) -> QMatrix:
    return QMatrix(np.asarray(lin.qweight[...]).T, np.asarray(lin.scale[...], np.float32).T,
                   None if lin.zero is None else np.asarray(lin.zero[...]).T,
                   None if lin.qglobal is None else np.asarray(lin.qglobal[...], np.float32),
                   None if lin.input_global is None else np.asarray(lin.input_global[...], np.float32))


def expert_qmatrices(ex: Experts) -> Iterator[tuple[int, str, QMatrix]]:
    """(expert, "gate_proj" | "up_proj" | "down_proj", QMatrix in the HF orientation) of quantized experts."""
    I = ex.intermediate_size
    for w in ("gate_up", "down"):
        q, s, z, g, a = (getattr(ex, f"{w}_{p}") for p in ("q", "scale", "zero", "global", "input_global"))
        q, s = np.asarray(q[...]), np.asarray(s[...], np.float32)
        z = None if z is None else np.asarray(z[...])
        g = None if g is None else np.asarray(g[...], np.float32)  # [E, 1]
        a = None if a is None else np.asarray(a[...], np.float32)  # [E, 1]
        for e in range(q.shape[0]):
            m = QMatrix(q[e].T, s[e].T, None if z is None else z[e].T, None if g is None else g[e],
                        None if a is None else a[e])
            if w == "down":
                yield e, "down_proj", m
                continue
            st = s.shape[-1] // 2 if ex.qblock else I  # the split point of the scales' rows
            for part, rows, srows in (("gate_proj", slice(0, I), slice(0, st)),
                                      ("up_proj", slice(I, 2 * I), slice(st, None))):
                yield e, part, QMatrix(m.q[rows], m.scale[srows], None if m.zero is None else m.zero[rows],
                                       m.global_scale, m.input_global)


def iter_qmatrices(model: nnx.Module) -> Iterator[tuple[str, QMatrix, Any]]:
    """(HF module name, QMatrix, bias or None) for every quantized Linear and expert projection."""
    for u in quant_units(model, float_by_default=False):
        m = u.module
        if isinstance(m, Linear):
            if m.qweight is not None:
                yield u.name, linear_qmatrix(m), m.bias
            continue
        if not m.quantized:
            continue
        for e, part, qm in expert_qmatrices(m):
            yield f"{u.name}.{e}.{expert_part(m, part)}", qm, None


# ------------------------------------------------------------------------------------------------
# What a quantized model carries: its scheme, its weight bytes
# ------------------------------------------------------------------------------------------------


def scheme_of(model: nnx.Module) -> Scheme:
    """The scheme a quantized model carries: the one `quantize_model` or the loader recorded, else what the
    quantized state shows (codes dtype and width, scales, zero points)."""
    recorded = getattr(model, "quant_scheme", None)
    if recorded is not None:
        return recorded
    for u in quant_units(model, float_by_default=False):
        m = u.module
        if isinstance(m, Linear) and m.qweight is not None:
            s, z, n_in = m.scale, m.zero, m.in_features
        elif isinstance(m, Experts) and m.quantized:
            s, z, n_in = m.gate_up_scale, m.gate_up_zero, m.hidden_size
        else:
            continue
        if m.qblock is not None:
            return parse_scheme("fp8-block")
        if m.input_quant is not None:
            raise ValueError("a model with quantized activations carries its scheme (quant_scheme)")
        G = s[...].shape[-2]
        codes = m.qweight if isinstance(m, Linear) else m.gate_up_q
        if codes[...].dtype == jnp.float8_e4m3fn:  # FP4 values held as float8: the group size tells the format
            return parse_scheme("nvfp4a16" if n_in // G == FP4_GROUP["nvfp4"] else "mxfp4a16")
        return Scheme(f"w{m.qbits}a16", "packed-int", m.qbits, None if G == 1 else n_in // G, z is None)
    raise ValueError("the model is not quantized")


def weight_bytes(model: nnx.Module, *, linears_only: bool = False) -> int:
    """Bytes of the weights held in memory: float params, quantized codes (one byte each, int4 too) and
    their scales / zero points (LoRA factors excluded). `linears_only` counts only the quantizable
    modules (Linears but the LM head, and experts)."""
    if linears_only:
        total = 0
        for u in quant_units(model, float_by_default=False):
            total += sum(x.nbytes for x in jax.tree.leaves(nnx.state(u.module, nnx.Any(
                nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)), QuantWeight, QuantScale, QuantZero))))
        return total
    weights = nnx.state(model, nnx.Any(nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)), QuantWeight, QuantScale, QuantZero))
    return sum(x.nbytes for x in jax.tree.leaves(weights))
