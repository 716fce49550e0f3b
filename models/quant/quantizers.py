"""Post-training weight quantization math: min-max int params, RTN, GPTQ, AWQ scale search, FP8 block.

Pure array code (no model / nnx), JAX float32. Weights are in the torch / HF orientation `w [out, in]`
(rows = output channels, columns = input features); `H [in, in]` is the calibration Hessian proxy
`sum_tokens x xᵀ` (any positive multiple works). Inputs may be numpy or jax arrays; results are numpy.

Conventions mirrored:

* compressed-tensors 0.20 (`quantization/utils/helpers.py::calculate_qparams`,
  `quantization/lifecycle/forward.py::quantize/dequantize`): signed integer codes in
  `[-2**(b-1), 2**(b-1)-1]`, symmetric `scale = amax / (bit_range / 2)`, asymmetric
  `scale = (max - min) / bit_range`, `zero = round(clamp(qmin - min / scale))` (int8, signed), min/max
  widened to include 0, zero scales replaced by float32 eps; `q = round(clamp(w / scale + zero))`,
  `w = (q - zero) * scale`. See docs/formats/compressed-tensors.md.
* GPTQ (Frantar et al. 2022, arXiv:2210.17323) as in llm-compressor
  `modifiers/quantization/gptq/gptq_quantize.py`: dead columns, `dampening_frac * mean(diag H)` damping,
  upper Cholesky of H⁻¹, lazy-batch blocks; group params either dynamic (computed when the loop reaches a
  group's first column, standard GPTQ) or static with `actorder="weight"` (params from the original
  weights, columns processed by descending diag(H)).
* AWQ (Lin et al. 2023, arXiv:2306.00978) `auto_scale` as in AutoAWQ / llm-compressor
  `modifiers/awq/base.py`: grid search over `s = x_absmean**r`, loss = output MSE over the calibration
  tokens, here `Σ tr(ΔW H ΔWᵀ)`.
* FP8 block (DeepSeek-V3 / compressed-tensors FP8_BLOCK; docs/formats/deepseek-fp8.md): per 128x128 tile
  `scale = amax / 448`, `q = e4m3(w / scale)`, dequantization multiplies.

See docs/quantization.md (RTN, GPTQ, AWQ).
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from models.numerics import (  # noqa: F401 - the number formats this math rounds to, re-exported
    E2M1_VALUES,
    F32_EPS,
    FP4_MAX,
    FP8_EPS,
    FP8_MAX,
    e2m1_index,
    e8m0_code,
    mx_scale_jax,
    nvfp4_global_scale,
    nvfp4_group_scale,
    round_e2m1,
)
from models.numerics import div as _div
from models.quant.schemes import FP4_GROUP, IntArgs  # noqa: F401 - the settings this math takes, re-exported

_EPS = F32_EPS  # compressed-tensors' zero-scale replacement for float32 scales
_HI = lax.Precision.HIGHEST  # full-fp32 matmuls also on GPUs that default to TF32


class QTensor(NamedTuple):
    q: np.ndarray  # int8 [out, in], signed codes in qrange
    scale: np.ndarray  # float32 [out, G]
    zero: np.ndarray | None  # int8 [out, G] (asymmetric only), signed, in qrange; None when symmetric


def _f32(x) -> jnp.ndarray:
    return jnp.asarray(x, dtype=jnp.float32)


def _check_w(w, args: IntArgs) -> jnp.ndarray:
    w = _f32(w)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {w.shape}")
    args.groups(w.shape[1])  # raises for a non-dividing group size
    return w


# ----------------------------------------------------------------------------- min-max / RTN


def _params(mn: jnp.ndarray, mx: jnp.ndarray, qmin: int, qmax: int, symmetric: bool):
    """calculate_qparams on per-group min / max (any shape); returns float32 scale and float zero (rounded)."""
    mn = jnp.minimum(mn, 0.0)
    mx = jnp.maximum(mx, 0.0)
    bit_range = jnp.float32(qmax - qmin)
    if symmetric:
        scale = _div(jnp.maximum(jnp.abs(mn), jnp.abs(mx)), bit_range / 2)
        zero = jnp.zeros_like(scale)
    else:
        scale = _div(mx - mn, bit_range)
        safe = jnp.where(scale == 0, jnp.float32(_EPS), scale)
        zero = jnp.round(jnp.clip(jnp.float32(qmin) - _div(mn, safe), qmin, qmax))
    scale = jnp.where(scale == 0, jnp.float32(_EPS), scale)
    return scale, zero


def _quant(w, scale, zero, qmin: int, qmax: int):
    """Codes (as float) for w with broadcastable scale / zero: round(clamp(w / scale + zero))."""
    return jnp.round(jnp.clip(_div(w, scale) + zero, qmin, qmax))


@partial(jax.jit, static_argnames=("width", "qmin", "qmax", "symmetric"))
def _minmax_jit(w, *, width: int, qmin: int, qmax: int, symmetric: bool):
    out, n = w.shape
    g = w.reshape(out, n // width, width)  # [out, G, width]
    return _params(g.min(-1), g.max(-1), qmin, qmax, symmetric)  # [out, G] each


def _expand(p: jnp.ndarray, width: int) -> jnp.ndarray:
    """[out, G] -> [out, G * width], each group's value repeated over its columns."""
    return jnp.repeat(p, width, axis=1)


@partial(jax.jit, static_argnames=("width", "qmin", "qmax", "symmetric"))
def _fake_quant(w, *, width: int, qmin: int, qmax: int, symmetric: bool):
    """RTN quantize-dequantize of w [out, in] with per-group min-max params."""
    out, n = w.shape
    g = w.reshape(out, n // width, width)  # [out, G, width]
    scale, zero = _params(g.min(-1), g.max(-1), qmin, qmax, symmetric)
    q = _quant(g, scale[..., None], zero[..., None], qmin, qmax)
    return ((q - zero[..., None]) * scale[..., None]).reshape(out, n)


def _static(args: IntArgs, n: int) -> dict:
    qmin, qmax = args.qrange()
    return {"width": args.width(n), "qmin": qmin, "qmax": qmax, "symmetric": args.symmetric}


def minmax_params(w, args: IntArgs) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-group (or per-channel) scale float32 [out, G] and zero int8 [out, G] (None when symmetric)."""
    w = _check_w(w, args)
    scale, zero = _minmax_jit(w, **_static(args, w.shape[1]))
    return np.asarray(scale), None if args.symmetric else np.asarray(zero).astype(np.int8)


def quantize_with(w, scale, zero, args: IntArgs) -> np.ndarray:
    """q = clamp(round(w / scale_g) + zero_g, qmin, qmax) as int8 [out, in]."""
    w = _check_w(w, args)
    width = args.width(w.shape[1])
    qmin, qmax = args.qrange()
    s = _expand(_f32(scale), width)  # [out, in]
    z = jnp.zeros_like(s) if zero is None else _expand(_f32(zero), width)
    return np.asarray(_quant(w, s, z, qmin, qmax)).astype(np.int8)


def dequantize(qt: QTensor, args: IntArgs) -> np.ndarray:
    """(q - zero_g) * scale_g as float32 [out, in]."""
    q = _f32(qt.q)
    width = args.width(q.shape[1])
    s = _expand(_f32(qt.scale), width)  # [out, in]
    z = jnp.zeros_like(s) if qt.zero is None else _expand(_f32(qt.zero), width)
    return np.asarray((q - z) * s)


def rtn(w, args: IntArgs) -> QTensor:
    """Round-to-nearest with min-max params per group."""
    scale, zero = minmax_params(w, args)
    return QTensor(quantize_with(w, scale, zero, args), scale, zero)


# ----------------------------------------------------------------------------- GPTQ


def _gptq_block(w1, hinv1, col_scale, col_zero, gscale=None, *, dynamic: bool, width: int, qmin: int, qmax: int,
                symmetric: bool, fp4: str | None = None):
    """One lazy batch of GPTQ columns.

    w1 [out, B] current weights of the block; hinv1 [B, B] its slice of the upper Cholesky factor of H⁻¹;
    col_scale / col_zero [out, B] per-column params (static mode; ignored when dynamic). In dynamic mode B is a
    multiple of `width` and each group's params are min-max of the current block weights at its first column.
    `fp4` ("nvfp4" | "mxfp4", dynamic only): the group's FP4 scale instead (`_fp4_group_scale`, NVFP4 with
    the global scale `gscale`) and E2M1 rounding; the params returned are then (stored scale, unused).
    Returns codes [out, B] (float), scaled errors [out, B], and the dynamic params [out, B // width] each.
    """
    out, b = w1.shape
    ng = b // width if dynamic else 1

    def body(i, carry):
        w1, q1, err1, s_cur, z_cur, g_s, g_z = carry
        if dynamic:

            def fresh():
                blk = lax.dynamic_slice(w1, (0, i), (out, width))  # [out, width]
                if fp4 is not None:  # (effective scale, stored scale) in the (s, z) slots
                    return _fp4_group_scale(jnp.max(jnp.abs(blk), axis=1), fp4, gscale)
                return _params(blk.min(1), blk.max(1), qmin, qmax, symmetric)

            s_cur, z_cur = lax.cond(i % width == 0, fresh, lambda: (s_cur, z_cur))
            g_s = g_s.at[:, i // width].set(z_cur if fp4 is not None else s_cur)
            g_z = g_z.at[:, i // width].set(z_cur)
            s, z = s_cur, (0.0 if fp4 is not None else z_cur)
        else:
            s, z = col_scale[:, i], col_zero[:, i]
        w = w1[:, i]  # [out]
        d = hinv1[i, i]
        q = round_e2m1(_div(w, s), jnp) if fp4 is not None else _quant(w, s, z, qmin, qmax)
        e = _div(w - (q - z) * s, d)  # [out]
        # hinv1 is upper triangular: row i is zero left of i, so already-quantized columns are untouched
        w1 = w1 - e[:, None] * hinv1[i][None, :]
        return w1, q1.at[:, i].set(q), err1.at[:, i].set(e), s_cur, z_cur, g_s, g_z

    zeros_out = jnp.zeros((out,), jnp.float32)
    params = (zeros_out + 1, zeros_out, jnp.ones((out, ng), jnp.float32), jnp.zeros((out, ng), jnp.float32))
    init = (w1, jnp.zeros_like(w1), jnp.zeros_like(w1), *params)
    _, q1, err1, _, _, g_s, g_z = lax.fori_loop(0, b, body, init)
    return q1, err1, g_s, g_z


def _inverse_cholesky(h: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Upper Cholesky factor of H⁻¹ (torch: cholesky -> cholesky_inverse -> cholesky(upper=True)) and a flag
    saying whether both factorizations succeeded (JAX returns NaNs instead of raising)."""
    n = h.shape[0]
    low = jnp.linalg.cholesky(h)
    hinv = jax.scipy.linalg.cho_solve((low, True), jnp.eye(n, dtype=h.dtype))
    hinv = (hinv + hinv.T) / 2
    up = jnp.linalg.cholesky(hinv, upper=True)
    return up, jnp.all(jnp.isfinite(low)) & jnp.all(jnp.isfinite(up))


@partial(jax.jit, static_argnames=("actorder", "dynamic", "bs", "width", "qmin", "qmax", "symmetric", "fp4"))
def _gptq_core(w, h, col_scale, col_zero, damp_frac, gscale=None, *, actorder: bool, dynamic: bool, bs: int,
               width: int, qmin: int, qmax: int, symmetric: bool, fp4: str | None = None):
    """Whole GPTQ pass on w [out, n], h [n, n]; col_scale / col_zero [out, n] static per-column params (unused
    when dynamic). Returns codes [out, n] (float, original order), dynamic params [out, n // width] and ok."""
    out, n = w.shape
    perm = jnp.argsort(-jnp.diag(h), stable=True) if actorder else None  # descending diag(H)
    if actorder:
        w, h = w[:, perm], h[perm][:, perm]
        col_scale, col_zero = col_scale[:, perm], col_zero[:, perm]

    dead = jnp.diag(h) == 0
    h = h + jnp.diag(jnp.where(dead, 1.0, 0.0))
    w = jnp.where(dead[None, :], 0.0, w)
    h = h + damp_frac * jnp.mean(jnp.diag(h)) * jnp.eye(n, dtype=jnp.float32)
    hinv, ok = _inverse_cholesky(h)  # [n, n] upper

    # pad to whole blocks: zero weights, identity Hinv (no error flows into or out of the padding)
    nb = -(-n // bs)
    pad = nb * bs - n
    w = jnp.pad(w, ((0, 0), (0, pad)))
    hinv = jnp.pad(hinv, ((0, pad), (0, pad))) + jnp.diag(jnp.concatenate([jnp.zeros(n), jnp.ones(pad)]))
    col_scale = jnp.pad(col_scale, ((0, 0), (0, pad)), constant_values=1.0)
    col_zero = jnp.pad(col_zero, ((0, 0), (0, pad)))

    def block(k, carry):
        w, q = carry
        i1 = k * bs
        w1 = lax.dynamic_slice(w, (0, i1), (out, bs))  # [out, bs]
        hinv1 = lax.dynamic_slice(hinv, (i1, i1), (bs, bs))  # [bs, bs]
        cs = lax.dynamic_slice(col_scale, (0, i1), (out, bs))
        cz = lax.dynamic_slice(col_zero, (0, i1), (out, bs))
        q1, err1, g_s, g_z = _gptq_block(w1, hinv1, cs, cz, gscale, dynamic=dynamic, width=width, qmin=qmin,
                                         qmax=qmax, symmetric=symmetric, fp4=fp4)
        # lazy-batch update W -= Err1 @ Hinv[i1:i2, :]; Hinv is upper triangular, so earlier columns get 0 and
        # this block's own (already quantized) columns are never read again
        w = w - jnp.matmul(err1, lax.dynamic_slice(hinv, (i1, 0), (bs, nb * bs)), precision=_HI)
        q = lax.dynamic_update_slice(q, q1, (0, i1))
        return w, q, g_s, g_z

    def step(k, carry):
        w, q, g_s_all, g_z_all = carry
        w, q, g_s, g_z = block(k, (w, q))
        if dynamic:
            g_s_all = lax.dynamic_update_slice(g_s_all, g_s, (0, k * (bs // width)))
            g_z_all = lax.dynamic_update_slice(g_z_all, g_z, (0, k * (bs // width)))
        return w, q, g_s_all, g_z_all

    ng = nb * bs // width if dynamic else 1
    init = (w, jnp.zeros_like(w), jnp.ones((out, ng), jnp.float32), jnp.zeros((out, ng), jnp.float32))
    _, q, g_s, g_z = lax.fori_loop(0, nb, step, init)
    q = q[:, :n]
    if actorder:
        q = q[:, jnp.argsort(perm)]
    if dynamic:
        g_s, g_z = g_s[:, : n // width], g_z[:, : n // width]
    return q, g_s, g_z, ok


def gptq(
    w, H, args: IntArgs, *, dampening_frac: float = 0.01, block_size: int = 128, actorder: bool = False
) -> QTensor:
    """GPTQ-quantize w [out, in] against H [in, in]; codes, scales and zeros in the original column order.

    actorder=False: group params are min-max of the already error-updated weights when the loop reaches the
    group's first column (standard GPTQ). actorder=True: llm-compressor's `actorder="weight"` — static group
    params from the original w, columns processed by descending diag(H), each with its original group's params
    (no g_idx). The channel strategy (group_size None) always uses static per-row params from the original w.
    Raises ValueError when the damped Hessian is not positive definite.
    """
    w = _check_w(w, args)
    out, n = w.shape
    h = _f32(H)
    if h.shape != (n, n):
        raise ValueError(f"H must be [in, in] = [{n}, {n}], got {tuple(h.shape)}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    st = _static(args, n)
    width = st["width"]
    dynamic = args.group_size is not None and not actorder

    if dynamic:  # dynamic groups must not straddle a block: round the block size to a multiple of the group
        bs = max(width, (block_size // width) * width)
        col_scale = col_zero = jnp.zeros((out, n), jnp.float32)  # unused
    else:  # static params from the original weights (llm-compressor's observer runs before the dead-column mask)
        bs = block_size
        s_static, z_static = _minmax_jit(w, **st)  # [out, G]
        col_scale, col_zero = _expand(s_static, width), _expand(z_static, width)  # [out, in]
    bs = min(bs, max(n, width))
    q, g_s, g_z, ok = _gptq_core(w, h, col_scale, col_zero, jnp.float32(dampening_frac), actorder=actorder,
                                 dynamic=dynamic, bs=bs, **st)
    if not bool(ok):
        raise ValueError(
            "GPTQ: Cholesky of the damped Hessian failed (H is not positive definite); increase dampening_frac "
            "or use more / more varied calibration samples"
        )
    scale, zero = (g_s, g_z) if dynamic else (s_static, z_static)
    q = np.asarray(q).astype(np.int8)
    return QTensor(q, np.asarray(scale, np.float32), None if args.symmetric else np.asarray(zero).astype(np.int8))


# ----------------------------------------------------------------------------- error / AWQ


@jax.jit
def _hquad(dw, h):
    """tr(ΔW H ΔWᵀ) for dw [out, in], h [in, in]."""
    return jnp.sum(jnp.matmul(dw, h, precision=_HI) * dw)


def output_error(w, w_hat, H) -> float:
    """Relative output error tr(ΔW H ΔWᵀ) / tr(W H Wᵀ) with ΔW = w - w_hat."""
    w, h = _f32(w), _f32(H)
    return float(_hquad(w - _f32(w_hat), h) / _hquad(w, h))


@partial(jax.jit, static_argnames=("width", "qmin", "qmax", "symmetric"))
def _awq_loss(pairs, s, *, width: int, qmin: int, qmax: int, symmetric: bool):
    total = jnp.float32(0.0)
    for w, h in pairs:  # w [out_i, in], h [in, in]
        w_eff = _fake_quant(w * s[None, :], width=width, qmin=qmin, qmax=qmax, symmetric=symmetric) / s[None, :]
        total = total + _hquad(w - w_eff, h)
    return total


def _awq_pairs(pairs: list, args: IntArgs) -> tuple[tuple, int]:
    if not pairs:
        raise ValueError("awq_search needs at least one weight")
    pj = tuple((_check_w(w, args), _f32(h)) for w, h in pairs)
    n = pj[0][0].shape[1]
    for w, h in pj:
        if w.shape[1] != n or h.shape != (n, n):
            raise ValueError(f"all weights must share in_features {n} with H [{n}, {n}]: "
                             f"got {tuple(w.shape)} with H {tuple(h.shape)}")
    return pj, n


def awq_loss(pairs: list, s, args: IntArgs) -> float:
    """Σ_i tr(ΔW_i H_i ΔW_iᵀ) for the AWQ candidate dequantize(rtn(w_i · s)) / s."""
    pj, n = _awq_pairs(pairs, args)
    return float(_awq_loss(pj, _f32(s).reshape(-1), **_static(args, n)))


def awq_search(pairs: list, x_absmean, args: IntArgs, *, grid: int = 20) -> tuple[np.ndarray, float]:
    """AWQ per-input-channel scale search for linears sharing one input.

    `pairs` is [(w_i [out_i, in], H_i [in, in])]: each weight with the Hessian of the tokens it sees (the
    same H for q/k/v; per-expert H for an MoE's experts, which share the normed input but see different
    tokens). For r in {0, 1/grid, ..., (grid-1)/grid}: s = clamp(x_absmean**r, 1e-4), s /= sqrt(max(s) min(s));
    each w_i becomes dequantize(rtn(w_i · s)) / s and the loss is Σ_i tr(ΔW_i H_i ΔW_iᵀ). Returns the best
    s [in] and its loss; r = 0 is plain RTN (s = 1), so the result is never worse than RTN.
    """
    pj, n = _awq_pairs(pairs, args)
    xm = _f32(x_absmean).reshape(-1)
    if xm.shape != (n,):
        raise ValueError(f"x_absmean must be [{n}], got {tuple(xm.shape)}")
    st = _static(args, n)
    best_s, best = None, math.inf
    for k in range(grid):
        s = jnp.maximum(xm ** jnp.float32(k / grid), 1e-4)
        s = s / jnp.sqrt(jnp.max(s) * jnp.min(s))
        loss = float(_awq_loss(pj, s, **st))
        if loss < best or best_s is None:
            best_s, best = s, loss
    return np.asarray(best_s, np.float32), best


# ----------------------------------------------------------------------------- FP8 block


def _tiles(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


@partial(jax.jit, static_argnames=("block",))
def _fp8_block_jit(w, *, block: tuple[int, int]):
    out, n = w.shape
    (tr, tc), (br, bc) = _tiles(w.shape, block), block
    wp = jnp.pad(w, ((0, tr * br - out), (0, tc * bc - n)))  # zero padding leaves amax unchanged
    t = wp.reshape(tr, br, tc, bc)
    amax = jnp.max(jnp.abs(t), axis=(1, 3))  # [tr, tc]
    scale = _div(amax, FP8_MAX)
    scale = jnp.where(scale == 0, jnp.float32(_EPS), scale)
    q = jnp.clip(_div(t, scale[:, None, :, None]), -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
    return q.reshape(tr * br, tc * bc)[:out, :n], scale


def fp8_block(w, block: tuple[int, int] = (128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """Block FP8: q float8_e4m3fn [out, in] and scale float32 [ceil(out/b0), ceil(in/b1)], w ≈ q · scale."""
    w = _f32(w)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {w.shape}")
    q, scale = _fp8_block_jit(w, block=tuple(block))
    return np.asarray(q).astype(ml_dtypes.float8_e4m3fn), np.asarray(scale, np.float32)


def dequantize_fp8_block(q, scale, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """q [out, in] (e4m3) times its tile's scale -> float32 [out, in]."""
    qf = np.asarray(q).astype(np.float32)
    s = np.asarray(scale, np.float32)
    if s.shape != _tiles(qf.shape, tuple(block)):
        raise ValueError(f"scale shape {s.shape} does not match {qf.shape} in {tuple(block)} blocks")
    full = np.repeat(np.repeat(s, block[0], axis=0), block[1], axis=1)[: qf.shape[0], : qf.shape[1]]
    return qf * full


# ----------------------------------------------------------------------------- FP4 (NVFP4, MXFP4)
#
# E2M1 values: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}. compressed-tensors 0.20 conventions
# (`quantization/utils/helpers.py::calculate_qparams`, `generate_gparam`, `quantization/utils/mxfp_utils.py`,
# `quantization/lifecycle/forward_helpers.py::_quantize`), so scales and codes agree bit for bit:
# * NVFP4 (TENSOR_GROUP, 16 values a group): global g = 448 · 6 / amax(tensor) (float32; 1 when not finite);
#   scale_g = fp8_e4m3(g · (amax_g / 6)) (0 -> 0.125, the FP8 eps); codes = e2m1(clamp(w / (scale_g / g), ±6));
#   w ≈ codes · (scale_g / g).
# * MXFP4 (GROUP, 32 values a group): scale_g = 2^(e - 127) with the E8M0 code e = clamp(E(amax_g) - 2, 0, 255),
#   E(x) the biased exponent of x rounded to a power of two (mantissa >= 0.75 rounds up); 2 = floor(log2 6);
#   codes = e2m1(clamp(w / scale_g, ±6)).
# Rounding to E2M1 is round-half-to-even on the value grid (compressed-tensors `cast_to_fp4`).

class FP4Tensor(NamedTuple):
    q: np.ndarray  # float32 [out, in], E2M1 values (a negative w rounded to zero is -0: its code has the sign bit)
    scale: np.ndarray  # float32 [out, G]: FP8-E4M3 values (NVFP4) or powers of two (MXFP4)
    global_scale: np.ndarray | None  # float32 [1] (NVFP4), None (MXFP4)


# Host (numpy) code: XLA's CPU and GPU backends flush subnormal floats to zero, which an MXFP4 scale of
# 2^-127 (an all-zero group) and tiny weights need; numpy keeps IEEE semantics, so the codes match
# compressed-tensors' bit for bit on any machine. (E2M1 rounding, E8M0 codes: models/numerics.py.)


def _global(t: np.ndarray, global_scale) -> np.ndarray:
    """The NVFP4 global scale [1]: the one given (shared by fused projections), else the tensor's own."""
    if global_scale is None:
        return nvfp4_global_scale(np.abs(t).max(initial=0.0))
    return np.asarray(global_scale, np.float32).reshape(1)


def _groups(w, fmt: str) -> np.ndarray:
    """w [out, in] -> float32 [out, G, group]; errors for a non-dividing group size."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {w.shape}")
    if w.shape[1] % FP4_GROUP[fmt]:
        raise ValueError(f"{fmt}: group size {FP4_GROUP[fmt]} does not divide in_features {w.shape[1]}")
    return w.reshape(w.shape[0], -1, FP4_GROUP[fmt])


def nvfp4(w, global_scale=None) -> FP4Tensor:
    """NVFP4 round-to-nearest of w [out, in]. `global_scale` [1]: shared by fused projections (q/k/v,
    gate/up: engines fuse them and need one global scale); default: this tensor's own."""
    t = _groups(w, "nvfp4")  # [out, G, 16]
    g = _global(t, global_scale)
    s = g[0] * (np.abs(t).max(axis=-1) / np.float32(FP4_MAX))  # [out, G]
    s = np.clip(s, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s[s == 0] = FP8_EPS
    q = round_e2m1(t / (s / g[0])[..., None])
    return FP4Tensor(q.reshape(t.shape[0], -1), s, g)


def mx_scale(amax: np.ndarray) -> np.ndarray:
    """Per-group amax float32 -> its E8M0 code uint8 (`models.numerics.e8m0_code`)."""
    return e8m0_code(np.asarray(amax, np.float32).view(np.int32)).astype(np.uint8)


def mx_scale_value(code: np.ndarray) -> np.ndarray:
    """E8M0 codes uint8 -> 2^(code - 127) float32, exact (code 0 is the subnormal 2^-127)."""
    return np.ldexp(np.float32(1.0), np.asarray(code).astype(np.int32) - 127).astype(np.float32)


def mx_code(scale: np.ndarray) -> np.ndarray:
    """Inverse of `mx_scale_value`: a power-of-two scale float32 -> its E8M0 code uint8 (its biased exponent;
    the subnormal 2^-127 has exponent bits 0, its code)."""
    return (np.asarray(scale, np.float32).view(np.int32) >> 23).astype(np.uint8)


def mxfp4(w) -> FP4Tensor:
    """MXFP4 round-to-nearest of w [out, in]: E2M1 codes, one power-of-two scale per 32 values."""
    t = _groups(w, "mxfp4")  # [out, G, 32]
    s = mx_scale_value(mx_scale(np.abs(t).max(axis=-1)))  # [out, G]
    q = round_e2m1(t / s[..., None])
    return FP4Tensor(q.reshape(t.shape[0], -1), s, None)


def dequantize_fp4(q, scale, global_scale=None) -> np.ndarray:
    """codes [out, in] · (scale [out, G] / global_scale), float32, in compressed-tensors' order."""
    qf, s = np.asarray(q, np.float32), np.asarray(scale, np.float32)
    if global_scale is not None:
        s = s / np.asarray(global_scale, np.float32).reshape(())
    out, n = qf.shape
    return (qf.reshape(out, s.shape[1], -1) * s[:, :, None]).reshape(out, n)


# ----------------------------------------------------------------------------- GPTQ with FP4 groups


def _fp4_group_scale(amax: jnp.ndarray, fp4: str, gscale) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Per-row group amax [out] -> (effective scale [out], stored scale [out]): NVFP4 stores
    e4m3(g · amax / 6) and divides by g; MXFP4 stores and uses 2^(code − 127). In XLA subnormal floats flush
    to zero, so the MXFP4 code is at least 1 here (2^-126 instead of 2^-127 for an all-zero group, whose
    codes are 0 either way); `mxfp4` (numpy) keeps 0."""
    if fp4 == "nvfp4":
        return nvfp4_group_scale(amax, gscale)
    s = mx_scale_jax(amax)
    return s, s


def gptq_fp4(w, H, fmt: str, global_scale=None, *, dampening_frac: float = 0.01, block_size: int = 128
             ) -> FP4Tensor:
    """GPTQ with FP4 groups (`fmt` "nvfp4" | "mxfp4"): as `gptq` with dynamic groups, each group's scale
    computed from the error-updated weights when the loop reaches its first column, codes rounded to E2M1
    (llm-compressor's GPTQ with an NVFP4 / MXFP4 scheme does the same). `global_scale` [1] (NVFP4):
    shared by fused projections; default: from w. Raises ValueError when the damped Hessian is not
    positive definite."""
    t = _groups(w, fmt)  # validates the shape and the group size
    w = _f32(t.reshape(t.shape[0], -1))
    out, n = w.shape
    h = _f32(H)
    if h.shape != (n, n):
        raise ValueError(f"H must be [in, in] = [{n}, {n}], got {tuple(h.shape)}")
    width = FP4_GROUP[fmt]
    g = _global(t, global_scale) if fmt == "nvfp4" else None
    bs = min(max(width, (block_size // width) * width), max(n, width))
    zeros = jnp.zeros((out, n), jnp.float32)  # static per-column params: unused in dynamic mode
    q, g_s, _, ok = _gptq_core(w, h, zeros, zeros, jnp.float32(dampening_frac),
                               None if g is None else jnp.float32(g[0]), actorder=False, dynamic=True, bs=bs,
                               width=width, qmin=0, qmax=0, symmetric=True, fp4=fmt)
    if not bool(ok):
        raise ValueError("GPTQ: Cholesky of the damped Hessian failed (H is not positive definite); increase "
                         "dampening_frac or use more / more varied calibration samples")
    return FP4Tensor(np.asarray(q, np.float32), np.asarray(g_s, np.float32), g)
