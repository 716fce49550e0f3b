"""Low-precision number formats shared by the weight quantizers (models/quant/quantizers.py) and the forward
(models/layers.py, models/moe.py): FP8 E4M3 and FP4 E2M1 rounding, E8M0 (power-of-two) scale codes, and the
quantize-dequantize of activations an engine applies to a quantized Linear's input.

Conventions are compressed-tensors 0.20's (`quantization/utils/helpers.py::calculate_qparams`,
`compute_dynamic_scales_and_zp`, `quantization/lifecycle/forward_helpers.py::_quantize` / `_dequantize`,
`quantization/utils/mxfp_utils.py`), so values agree bit for bit with its fake quantization:

* per-token dynamic (FP8_DYNAMIC, W4AFP8, W8A8 presets): one scale per row, `s = amax(|x|) / 448` (FP8 E4M3)
  or `amax / 127.5` (int8, symmetric); `x ≈ q · s` with `q = e4m3(clamp(x / s, ±448))` or
  `q = round(clamp(x / s, -128, 127))` (half to even); a zero scale becomes float32 eps.
* NVFP4 (W4A4): a static global scale g = 448·6 / amax over the calibration inputs; per 16 values
  `s = e4m3(g · amax / 6)` (0 -> 0.125), `q = e2m1(clamp(x / (s / g), ±6))`, `x ≈ q · (s / g)`.
* MXFP4: per 32 values the power of two `2^(E(amax) - 2)` (E8M0, `e8m0_code`), `q = e2m1(clamp(x / s, ±6))`.
* FP8 KV cache (`quantize_kv_fp8`): the cached K and V with their static calibrated scale (per tensor, or one per
  KV head: compressed-tensors' `attn_head` strategy), `x ≈ e4m3(clamp(x / s, ±448)) · s` (`_quantize_dequantize`
  as `QuantizedKVCache` applies it; vLLM's cache-write kernels: `fp8::scaled_convert`, x / s in float32, then a
  saturating conversion).

These are the QDQ serving engines compute (vLLM's `scaled_fp8_quant` / `scaled_int8_quant` with per-token
scales, its NVFP4 and MXFP4 activation quantization): the quantized GEMM then equals `QDQ(x) @ W_dq` up to
float summation order. XLA flushes float32 subnormals to zero; an all-zero activation group then gets the
MXFP4 code 1 instead of 0, which changes nothing (its values are 0 either way).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FP8_MAX = 448.0  # largest float8_e4m3fn value
FP4_MAX = 6.0  # largest E2M1 value
FP8_EPS = 0.125  # compressed-tensors' replacement for a zero FP8 scale (`_get_dtype_eps`)
F32_EPS = float(np.finfo(np.float32).eps)  # ... and for a zero float32 scale
INT8_HALF_RANGE = 127.5  # (127 - (-128)) / 2: a symmetric int8 scale is amax / 127.5

# E2M1 values: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}. Rounding is round-half-to-even on the value grid
# (compressed-tensors `cast_to_fp4`).
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# (boundary, inclusive): |x| passes it when |x| > b, or |x| >= b where the tie rounds up (to the even code)
_E2M1_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))

ACT_KINDS = ("fp8", "int8", "nvfp4", "mxfp4")  # activation quantization a scheme may ask for
ACT_GROUP = {"nvfp4": 16, "mxfp4": 32}  # values per scale of the grouped activation formats


def div(a: jax.Array, b) -> jax.Array:
    """a / b as a true IEEE division. XLA rewrites `x / broadcast(y)` into `x * broadcast(1 / y)`, which is
    off by an ulp and would break bit-exact agreement with compressed-tensors; the barrier stops that."""
    b = jnp.broadcast_to(jnp.asarray(b, a.dtype), jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b)))
    return a / lax.optimization_barrier(b)


def e2m1_index(x, xp=np):
    """|x| (x within ±6) -> the index 0..7 of its nearest E2M1 magnitude, ties to the even code. `xp`: numpy
    (host) or jax.numpy (jitted code) - the same comparisons either way."""
    a = xp.abs(x)
    return sum(((a >= b) if inclusive else (a > b)).astype(xp.uint8) for b, inclusive in _E2M1_BOUNDS)


def round_e2m1(x, xp=np):
    """x -> the nearest E2M1 value (float32), clamped to ±6, ties to even; a negative x that rounds to zero
    gives -0 (its code carries the sign bit), -0 itself gives +0, as torch's `sign(x) · |r|` does."""
    x = xp.clip(xp.asarray(x, xp.float32), -FP4_MAX, FP4_MAX)
    r = xp.asarray(E2M1_VALUES)[e2m1_index(x, xp)]
    return xp.where(x < 0, -r, r)


def e8m0_code(bits, xp=np, lowest: int = 0):
    """The E8M0 code of amax's float32 bits (int32; `xp` numpy or jax.numpy): its biased exponent once amax is
    rounded to a power of two (a mantissa of 0.75 or more rounds up), minus floor(log2 6) = 2, clamped to
    lowest..255."""
    rounded = (bits + (1 << 21)) & (0xFF << 23)  # amax >= 0: keep the exponent
    return xp.clip((rounded >> 23) - 2, lowest, 255)


def mx_scale_jax(amax: jax.Array) -> jax.Array:
    """Per-group amax float32 -> its MXFP4 power-of-two scale (code at least 1: XLA has no 2^-127)."""
    code = e8m0_code(lax.bitcast_convert_type(amax, jnp.int32), jnp, lowest=1)
    return lax.bitcast_convert_type((code << 23).astype(jnp.int32), jnp.float32)


def nvfp4_group_scale(amax: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-group amax and the global scale g -> (effective scale s / g, stored FP8 scale s), float32."""
    s = jnp.clip(g * div(amax, jnp.float32(FP4_MAX)), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    s = s.astype(jnp.float32)
    s = jnp.where(s == 0, jnp.float32(FP8_EPS), s)
    return div(s, g), s


def nvfp4_global_scale(amax) -> np.ndarray:
    """The NVFP4 global scale float32 [1] for a tensor (or fused tensors, or a module's calibration inputs)
    whose largest |x| is `amax`: 448·6 / amax, 1 when that is not finite."""
    a = np.maximum(np.float32(amax), np.finfo(np.float32).tiny)
    with np.errstate(over="ignore", divide="ignore"):
        # torch's `scalar / tensor` is `tensor.reciprocal() * scalar`: two float32 roundings, kept for bit parity
        g = (np.float32(1.0) / a) * np.float32(FP8_MAX * FP4_MAX)
    return np.asarray([g if np.isfinite(g) else np.float32(1.0)], np.float32)


def quantize_activation(x: jax.Array, kind: str, global_scale: jax.Array | None = None) -> jax.Array:
    """Quantize-dequantize activations x [..., in] along the last axis as an engine does before a quantized
    GEMM (module docstring): `kind` "fp8" | "int8" (one dynamic scale per row) or "nvfp4" (with its static
    `global_scale`: [1], or [..., 1] against x's leading axes) | "mxfp4" (dynamic scales per group). Returns
    x's shape and dtype."""
    dtype, shape = x.dtype, x.shape
    x = x.astype(jnp.float32)
    if kind in ("fp8", "int8"):
        amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)  # [..., 1]
        s = div(amax, jnp.float32(FP8_MAX if kind == "fp8" else INT8_HALF_RANGE))
        s = jnp.where(s == 0, jnp.float32(F32_EPS), s)
        y = div(x, s)
        if kind == "fp8":
            q = jnp.clip(y, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32)
        else:
            q = jnp.round(jnp.clip(y, -128.0, 127.0))
        return (q * s).astype(dtype)
    if kind not in ACT_GROUP:
        raise ValueError(f"unknown activation quantization {kind!r} (known: {', '.join(ACT_KINDS)})")
    n = ACT_GROUP[kind]
    if shape[-1] % n:
        raise ValueError(f"{kind} activations: group size {n} does not divide the input width {shape[-1]}")
    t = x.reshape(*shape[:-1], shape[-1] // n, n)  # [..., G, n]
    amax = jnp.max(jnp.abs(t), axis=-1)  # [..., G]
    if kind == "nvfp4":
        if global_scale is None:
            raise ValueError("nvfp4 activations need their calibrated global scale")
        g = global_scale.astype(jnp.float32)  # [1], or [..., 1] per row (experts' own scales)
        eff, _ = nvfp4_group_scale(amax, g.reshape(()) if g.ndim == 1 else g)
    else:
        eff = mx_scale_jax(amax)
    q = round_e2m1(div(t, eff[..., None]), jnp)
    return (q * eff[..., None]).reshape(shape).astype(dtype)


def quantize_kv_fp8(x: jax.Array, scale: jax.Array) -> jax.Array:
    """Quantize-dequantize K or V x [B, T, K, H] with its static FP8 KV-cache scale (float32, [1] per tensor or
    [K, 1, 1] per KV head, compressed-tensors' shapes): what an engine writes to an FP8 cache and reads back.
    In float32, true divisions (`div`); returns x's shape and dtype."""
    s = scale.astype(jnp.float32).reshape(-1, 1)  # [1, 1] or [K, 1]: broadcasts over [B, T, K, H]
    q = jnp.clip(div(x.astype(jnp.float32), s), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return (q.astype(jnp.float32) * s).astype(x.dtype)
