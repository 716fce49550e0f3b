"""Shared building blocks for the decoder families: Linear (LoRA- and int8-capable), Embed, RMSNorm,
rotary embeddings and the one attention kernel used for training, prefill, decode and verify.

Mirrors docs/models/decoder.md (RMSNorm cast order, NeoX RoPE, GQA attention, default / llama3 / YaRN
RoPE frequencies).

Shape legend: B batch, T query length, S key length (cache length when decoding), D model width,
N query heads, K kv heads, G = N / K query heads per kv head, H head dim, V vocab.

Every parameter carries logical sharding axis names in its `out_sharding` metadata (see
models/sharding.py for the rule table that maps them onto mesh axes).
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.numerics import quantize_activation

Axes = tuple[str | None, ...]
INIT_STD = 0.02  # transformers' initializer_range


def param(value: jax.Array, axes: Axes, cls: type[nnx.Variable] = nnx.Param) -> nnx.Variable:
    """A variable with logical axis names as metadata only (no eager placement on a mesh)."""
    return cls(value, out_sharding=axes, eager_sharding=False)


def hf_name(path: tuple) -> str:
    """HF module name of an nnx path: ("layers", 0, "mlp") -> "model.layers.0.mlp"; the LM head is top-level
    (`lm_head`, DeepSeek-V4's `head`)."""
    return ("" if path[:1] in (("lm_head",), ("head",)) else "model.") + ".".join(str(p) for p in path)


class QuantWeight(nnx.Variable):
    """Quantized weight codes, [in, out] (int8 holding int4/int8 codes, float8_e4m3fn, or float8_e4m3fn
    holding FP4 E2M1 values, which it represents exactly). Not a Param: optimizers never touch it."""


class QuantScale(nnx.Variable):
    """Dequantisation scales: [G, out] per input group (G = 1 per channel), or [in/128, out/128] blocks; an
    NVFP4 weight's global scale [1] (the group scales are divided by it)."""


class QuantZero(nnx.Variable):
    """Zero points of an asymmetric int scheme, int8 [G, out] (signed, in the codes' range)."""


def dequantize(q: jax.Array, scale: jax.Array, zero: jax.Array | None, block: int | None,
               dtype: Any = jnp.float32, global_scale: jax.Array | None = None) -> jax.Array:
    """Quantized codes -> float weight, for any leading (expert) axes.

    int codes q [..., in, out] with scale / zero [..., G, out]: w = (q - zero[g]) · scale[g] with g = i // (in / G).
    float8 codes (`block` set) with scale [..., ceil(in/block), ceil(out/block)]: w = q · scale of its tile.
    FP4 codes (E2M1 values held as float8) with scale [..., G, out]: w = q · scale[g], and with an NVFP4
    `global_scale` [..., 1]: w = q · (scale[g] / global_scale), in float32 (compressed-tensors' order).
    """
    if global_scale is not None:
        scale = scale.astype(jnp.float32) / global_scale.astype(jnp.float32)[..., None]  # [..., G, out]
    *lead, n_in, n_out = q.shape
    if block is not None:
        s = jnp.repeat(jnp.repeat(scale.astype(dtype), block, axis=-2), block, axis=-1)[..., :n_in, :n_out]
        return q.astype(dtype) * s
    G = scale.shape[-2]
    qg = q.astype(dtype).reshape(*lead, G, n_in // G, n_out)  # [..., G, in/G, out]
    if zero is not None:
        qg = qg - zero.astype(dtype)[..., :, None, :]
    return (qg * scale.astype(dtype)[..., :, None, :]).reshape(*lead, n_in, n_out)


class Buffer(nnx.Variable):
    """A loaded, saved but never trained tensor (DeepSeek's e_score_correction_bias, kept fp32)."""


# ------------------------------------------------------------------------------------------------
# Linear: kernel [in, out] (+ bias), optionally LoRA factors or an int8 weight instead of the kernel
# ------------------------------------------------------------------------------------------------


class Linear(nnx.Module):
    """y = x @ kernel (+ bias) (+ scale · (dropout(x) @ lora_a) @ lora_b).

    States (see models/lora.py and models/quant/ for the transitions):
      float:     kernel Param [in, out]
      LoRA:      kernel Param + lora_a LoRAParam [in, r] + lora_b LoRAParam [r, out], lora_scale = alpha/r,
                 and with a dropout rate > 0 an nnx.Dropout on the LoRA branch's input only (PEFT's
                 lora_dropout; its own 'dropout' RngStream, off after `model.eval()`)
      quantized: qweight QuantWeight [in, out] (int8 codes of an int4/int8 scheme, or float8_e4m3fn),
                 scale QuantScale [G, out] (G input groups; 1 = per channel) or [in/128, out/128] (FP8
                 blocks, `qblock` = 128), zero QuantZero int8 [G, out] for asymmetric schemes; kernel is None.
                 The forward dequantizes on the fly (models/quant/ makes and writes these). With `act` set
                 the input is quantized-dequantized first as the engine does (models/numerics.py; NVFP4's
                 calibrated global input scale in input_global QuantScale [1]).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        axes: tuple[str | None, str | None],
        use_bias: bool = False,
        rngs: nnx.Rngs,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
    ):
        self.in_features, self.out_features = in_features, out_features
        self.axes = axes
        self.dtype = dtype
        init = nnx.initializers.normal(INIT_STD)
        self.kernel = nnx.data(param(init(rngs.params(), (in_features, out_features), param_dtype), axes))
        self.bias = nnx.data(param(jnp.zeros((out_features,), param_dtype), (axes[1],)) if use_bias else None)
        self.lora_a = nnx.data(None)
        self.lora_b = nnx.data(None)
        self.lora_dropout = nnx.data(None)
        self.lora_scale = 0.0  # alpha / r
        self.lora_rank, self.lora_alpha = 0, 0.0
        self.qweight = nnx.data(None)
        self.scale = nnx.data(None)
        self.zero = nnx.data(None)
        self.qglobal = nnx.data(None)  # NVFP4: the global scale [1]
        self.qblock: int | None = None  # FP8 block edge (scale per qblock x qblock tile); None for int schemes
        self.qbits = 0  # bits per code of an int scheme (4 or 8; int4 codes are held one per int8)
        self.input_quant: str | None = None  # quantized inputs (models/numerics.py): fp8 | int8 | nvfp4 | mxfp4
        self.input_global = nnx.data(None)  # NVFP4 activations: the calibrated global input scale [1]
        self.calibrating = False  # models/quant/: sow this layer's inputs for calibration statistics

    def add_lora(self, rank: int, alpha: float, *, key: jax.Array, dropout: float = 0.0,
                 dropout_rngs: nnx.RngStream | None = None) -> None:
        """lora_a [in, r] ~ U(±1/sqrt(in)) (PEFT's kaiming-uniform, a=sqrt(5)), lora_b [r, out] = 0."""
        if self.lora_a is not None:
            raise ValueError("LoRA is already applied; merge_lora first")
        dtype = jnp.float32 if self.kernel is None else self.kernel[...].dtype
        bound = 1.0 / np.sqrt(self.in_features)
        a = jax.random.uniform(key, (self.in_features, rank), dtype, -bound, bound)
        self.lora_a = param(a, (self.axes[0], None), nnx.LoRAParam)  # [in, r]
        self.lora_b = param(jnp.zeros((rank, self.out_features), dtype), (None, self.axes[1]), nnx.LoRAParam)
        self.lora_dropout = nnx.Dropout(dropout, rngs=dropout_rngs) if dropout > 0 else None
        self.lora_scale, self.lora_rank, self.lora_alpha = float(alpha) / rank, rank, float(alpha)

    def merge_lora(self) -> None:
        """Fold the adapter into the kernel (W += scale · A B) and drop the factors."""
        if self.kernel is None:
            raise ValueError("cannot merge LoRA into a quantized Linear; merge before quantizing")
        self.kernel[...] = self.weight().astype(self.kernel[...].dtype)
        self.lora_a = self.lora_b = self.lora_dropout = None
        self.lora_scale, self.lora_rank, self.lora_alpha = 0.0, 0, 0.0

    def weight(self) -> jax.Array:
        """The effective float kernel [in, out]: dequantized and with LoRA folded in."""
        if self.qweight is not None:
            w = dequantize(self.qweight[...], self.scale[...], None if self.zero is None else self.zero[...],
                           self.qblock, global_scale=None if self.qglobal is None else self.qglobal[...])
        else:
            w = self.kernel[...]
        if self.lora_a is not None:
            delta = jnp.einsum("ir,ro->io", self.lora_a[...], self.lora_b[...]) * self.lora_scale
            w = w + delta.astype(w.dtype)
        return w

    def __call__(self, x: jax.Array) -> jax.Array:
        # Flatten to one 2-D GEMM: XLA:CPU runs the backward of a [B, T, in] x [in, out] dot_general
        # (two contracting dims for the kernel gradient) much slower than the plain [B*T, in] form.
        lead = x.shape[:-1]
        x = x.astype(self.dtype).reshape(-1, self.in_features)  # [B*T, in]
        if self.calibrating:
            self.sow(nnx.Intermediate, "calib", x)
        if self.input_quant is not None:  # the engine quantizes the GEMM's input too (W8A8, W4A4 schemes)
            g = None if self.input_global is None else self.input_global[...]
            x = quantize_activation(x, self.input_quant, g)
        if self.qweight is not None and self.zero is None and self.qblock is None and self.qglobal is None \
                and self.scale.shape[0] == 1:
            # per-channel symmetric: the scale is applied to the [.., out] result
            y = x @ self.qweight[...].astype(self.dtype) * self.scale[...][0].astype(self.dtype)
        elif self.qweight is not None:
            # dequantize on the fly, one group / tile of scales at a time
            w = dequantize(self.qweight[...], self.scale[...], None if self.zero is None else self.zero[...],
                           self.qblock, self.dtype, None if self.qglobal is None else self.qglobal[...])
            y = x @ w
        else:
            y = x @ self.kernel[...].astype(self.dtype)
        if self.lora_a is not None:
            h = x if self.lora_dropout is None else self.lora_dropout(x)  # dropout on the LoRA branch only
            a = h @ self.lora_a[...].astype(self.dtype)  # [B*T, r]
            y = y + (a @ self.lora_b[...].astype(self.dtype)) * self.lora_scale
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y.reshape(*lead, self.out_features)


class Embed(nnx.Module):
    """Token embedding table weight [V, D] (HF layout, no transpose); `attend` is the tied LM head."""

    def __init__(self, num: int, features: int, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        self.dtype = dtype
        init = nnx.initializers.normal(INIT_STD)
        self.weight = param(init(rngs.params(), (num, features), param_dtype), ("vocab", "embed"))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.weight[...], ids, axis=0).astype(self.dtype)  # [B, T, D]

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied LM head: x [B, T, D] -> logits [B, T, V] (one 2-D GEMM, see Linear)."""
        flat = x.astype(self.dtype).reshape(-1, x.shape[-1])  # [B*T, D]
        return (flat @ self.weight[...].astype(self.dtype).T).reshape(*x.shape[:-1], -1)


class RMSNorm(nnx.Module):
    """w · x / sqrt(mean(x²) + eps): statistics in fp32, cast back to the input dtype, then × w.

    `weight_in_fp32` (GPT-OSS, docs/models/gpt-oss.md): multiply by w in fp32 first, then cast.
    """

    def __init__(self, features: int, *, eps: float, axis_name: str = "norm", param_dtype: Any = jnp.float32,
                 weight_in_fp32: bool = False):
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32
        self.weight = param(jnp.ones((features,), param_dtype), (axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.weight_in_fp32:
            return (self.weight[...].astype(jnp.float32) * y).astype(x.dtype)
        return self.weight[...].astype(x.dtype) * y.astype(x.dtype)


# ------------------------------------------------------------------------------------------------
# The SwiGLU MLP (dense layers, shared experts, the EAGLE-3 draft layer)
# ------------------------------------------------------------------------------------------------


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate/up [D, F], down [F, D]."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, use_bias: bool = False, rngs: nnx.Rngs,
                 dtype: Any, param_dtype: Any):
        D, F = hidden_size, intermediate_size
        kw = dict(use_bias=use_bias, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate_proj = Linear(D, F, axes=("embed", "mlp"), **kw)
        self.up_proj = Linear(D, F, axes=("embed", "mlp"), **kw)
        self.down_proj = Linear(F, D, axes=("mlp", "embed"), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


# ------------------------------------------------------------------------------------------------
# Rotary embeddings (NeoX halves), computed once per forward call and shared by every layer
# ------------------------------------------------------------------------------------------------


def rope_frequencies(
    dim: int, theta: float, scaling: Mapping[str, Any] | None = None, max_position_embeddings: int | None = None
) -> tuple[np.ndarray, float]:
    """(inv_freq [dim/2] float32, attention_scaling) for `dim` rotary dims, as transformers'
    `modeling_rope_utils` computes them: default, linear, llama3 and YaRN (docs/models/decoder.md).

    attention_scaling multiplies cos and sin (1.0 except YaRN without mscale/mscale_all_dim).
    """
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = (np.float32(theta) ** exponent).astype(np.float32)  # [dim/2]
    inv_freq = (1.0 / pos_freqs).astype(np.float32)
    scaling = dict(scaling or {})
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32), 1.0
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        orig = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = orig / low, orig / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(is_medium, smoothed, scaled).astype(np.float32), 1.0
    if rope_type == "yarn":
        return _yarn(dim, float(theta), scaling, pos_freqs, max_position_embeddings)
    raise NotImplementedError(f"rope_type {rope_type!r} (supported: default, linear, llama3, yarn)")


def _yarn(dim: int, base: float, p: Mapping[str, Any], pos_freqs: np.ndarray,
          max_position_embeddings: int | None) -> tuple[np.ndarray, float]:
    """YaRN (transformers `_compute_yarn_parameters`, docs/models/decoder.md)."""
    orig = p.get("original_max_position_embeddings") or max_position_embeddings
    factor = p.get("factor")
    if factor is None:  # DeepSeek-style: the ratio of the extended to the pretraining length
        factor = max_position_embeddings / orig
    factor = float(factor)

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    inv_extrap = (1.0 / pos_freqs).astype(np.float32)
    inv_interp = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
    inv_freq = inv_interp * (1 - extrapolation) + inv_extrap * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_config_from_hf(
    d: Mapping[str, Any], *, default_theta: float = 10000.0, default: Mapping[str, Any] | None = None,
    source: str = "config.json",
) -> tuple[float, float | None, dict[str, Any] | None]:
    """(rope_theta, partial_rotary_factor or None, scaling dict or None) from a config.json dict, as
    transformers 5 standardises it (docs/formats/hf-checkpoint.md): a legacy `rope_scaling` dict wins over
    `rope_parameters` (`default` when neither is present), `rope_theta` and `partial_rotary_factor`
    fall back to the top-level fields, `type` is the legacy spelling of `rope_type`. The scaling dict
    is None for plain RoPE, else {"rope_type": ..., <its parameters>}."""
    rope = dict(d.get("rope_scaling") or d.get("rope_parameters") or default or {})
    theta = float(rope.pop("rope_theta", None) or d.get("rope_theta") or default_theta)
    partial = rope.pop("partial_rotary_factor", None)
    partial = d.get("partial_rotary_factor") if partial is None else partial
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)  # transformers 5 keeps a stray legacy "type" next to rope_type
    if rope_type not in ROPE_TYPES:
        raise NotImplementedError(f"{source}: rope_type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
    return theta, None if partial is None else float(partial), \
        None if rope_type == "default" else {"rope_type": rope_type, **rope}


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None = None) -> np.ndarray:
    """inv_freq [H/2] in float32 (see rope_frequencies; attention scaling dropped)."""
    return rope_frequencies(head_dim, theta, scaling)[0]


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, dtype: Any,
                 attention_scaling: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, d] for integer positions [B, T] (angles in fp32, × attention_scaling, then cast)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]  # [B, T, d/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, T, d]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_scaling != 1.0:
        cos, sin = cos * attention_scaling, sin * attention_scaling
    return cos.astype(dtype), sin.astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, H] rotated as x·cos + rotate_half(x)·sin with rotate_half([x1, x2]) = [-x2, x1].

    Partial rotary (cos/sin [B, T, d] with d < H, GLM-4.5): only the first d dims of each head
    rotate (halves of d/2 inside them); the remaining H - d pass through.
    """
    d = cos.shape[-1]
    if d < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :d], cos, sin), x[..., d:]], axis=-1)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


# ------------------------------------------------------------------------------------------------
# Attention: one kernel for every mode; the caller builds mask [B, T, S] (True = may attend)
# ------------------------------------------------------------------------------------------------

NEG_INF = float(jnp.finfo(jnp.float32).min)
CAUSAL_CHUNK = 128  # query block size when a call's keys are its own queries (training / eval)


@jax.custom_vjp
def attention_core(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, sinks: jax.Array | None
                   ) -> jax.Array:
    """softmax([q kᵀ + mask, sink]) v per kv head, sink column dropped after the softmax.

    q [B, K, T, G, H] (already scaled), k [B, K, S, H], v [B, K, S, Hv], mask [B, T, S],
    sinks [K, G] fp32 or None -> [B, K, T, G, Hv]. The G query heads sharing a kv head ride along
    the query axis, so both products are plain batched GEMMs. Softmax in fp32. A fully masked row
    (a padding query) gets a uniform distribution instead of NaN when there is no sink, and all of
    its mass on the sink (output 0) when there is one (GPT-OSS, docs/models/gpt-oss.md).
    """
    return _attention_fwd(q, k, v, mask, sinks)[0]


def _attention_fwd(q, k, v, mask, sinks):
    B, K, T, G, H = q.shape
    Hv = v.shape[-1]
    scores = jnp.einsum("bkqh,bksh->bkqs", q.reshape(B, K, T * G, H), k).astype(jnp.float32)
    scores = jnp.where(mask[:, None, :, None, :], scores.reshape(B, K, T, G, -1), NEG_INF)  # [B, K, T, G, S]
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None, :, None], (B, K, T, G, 1))
        m = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
        e = jnp.exp(scores - m)
        probs = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - m))  # rows sum to < 1
    out = jnp.einsum("bkqs,bksh->bkqh", probs.reshape(B, K, T * G, -1).astype(v.dtype), v)
    out = out.reshape(B, K, T, G, Hv)
    return out, (q, k, v, mask, sinks, probs, out)


def _attention_bwd(res, d_out):
    """FlashAttention's backward: dS = P ∘ (dP − rowsum(dO ∘ O)); no reduction over a [T, S] product.
    The sink column has no value row, so d sink = −P_sink · rowsum(dO ∘ O), summed over B and T."""
    q, k, v, mask, sinks, probs, out = res
    B, K, T, G, H = q.shape
    Hv = v.shape[-1]
    d_out2 = d_out.reshape(B, K, T * G, Hv)
    dv = jnp.einsum("bkqs,bkqh->bksh", probs.reshape(B, K, T * G, -1).astype(v.dtype), d_out2)
    dp = jnp.einsum("bkqh,bksh->bkqs", d_out2, v).astype(jnp.float32).reshape(probs.shape)
    row = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)  # [B,K,T,G,1]
    ds = jnp.where(mask[:, None, :, None, :], probs * (dp - row), 0.0)
    d_sinks = None
    if sinks is not None:
        p_sink = 1.0 - jnp.sum(probs, axis=-1, keepdims=True)  # [B, K, T, G, 1]
        d_sinks = (-jnp.sum(p_sink * row, axis=(0, 2, 4))).astype(sinks.dtype)  # [K, G]
    ds = ds.astype(q.dtype).reshape(B, K, T * G, -1)
    dq = jnp.einsum("bkqs,bksh->bkqh", ds, k).reshape(q.shape)
    dk = jnp.einsum("bkqs,bkqh->bksh", ds, q.reshape(B, K, T * G, H))
    return dq, dk, dv, None, d_sinks


attention_core.defvjp(_attention_fwd, _attention_bwd)


ATTENTION_IMPLS = ("auto", "core", "cudnn", "xla")


@functools.cache
def _cudnn_trains() -> bool:
    """Whether this GPU's cuDNN compiles a training step of the fused path as `attention` calls it (a dense
    [B, 1, T, S] mask, B > 1, GQA, bf16, forward and backward): some jax / cuDNN versions reject the mask's
    gradient (jax-ml/jax#23701). Compiled once per process on abstract arrays, never run, so it is safe to
    ask while tracing; "auto" keeps today's kernel where it fails."""
    B, T, N, K, H = 2, 256, 8, 2, 128
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.bfloat16)
    mask = jax.ShapeDtypeStruct((B, 1, T, T), jnp.bool_)

    def loss(q, k, v, m):
        out = jax.nn.dot_product_attention(q, k, v, mask=m, is_causal=True, implementation="cudnn")
        return out.astype(jnp.float32).sum()

    try:
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, mask).compile()
    except Exception:  # noqa: BLE001 - any refusal means: not this kernel
        return False
    return True


def attention_impl(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, sinks: jax.Array | None,
                   impl: str | None = None) -> str:
    """The kernel one `attention` call runs: "core" (today's `attention_core`, custom VJP, causal blocks)
    or "cudnn" / "xla" (`jax.nn.dot_product_attention` with that implementation).

    `impl` (default: the FORGELINE_ATTENTION environment variable, read at trace time, default "auto")
    is one of ATTENTION_IMPLS. "auto" is "cudnn" when `jax.default_backend() == "gpu"`, the call is
    supported and this GPU's cuDNN compiles the path's training step (`_cudnn_trains`), else "core" — so
    CPU runs exactly the path the fp32 parity tests check. "cudnn" / "xla" force that implementation
    where supported (cuDNN: on a GPU) and fall back to "core" elsewhere.
    Supported: a self-attention call (`causal`, keys = queries: training, eval, a no-cache forward) with
    GQA, causal / segment / padding / sliding-window masks (all folded into `mask`), no sinks (GPT-OSS)
    and equal key and value head dims (not MLA). Cached calls (decode, verify) keep "core": at a few
    query tokens a fused kernel gains nothing and would need the head-major cache transposed. cuDNN
    further needs bf16 / fp16, an even length and a head dim that is a multiple of 8, at most 128 (256
    from Hopper on).
    """
    impl = impl or os.environ.get("FORGELINE_ATTENTION", "auto")
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"FORGELINE_ATTENTION={impl!r} (known: {', '.join(ATTENTION_IMPLS)})")
    if impl == "auto":
        impl = "cudnn" if jax.default_backend() == "gpu" and _cudnn_trains() else "core"
    T, H, S, Hv = q.shape[1], q.shape[-1], k.shape[2], v.shape[-1]
    if impl == "core" or sinks is not None or Hv != H or not causal or S != T:
        return "core"
    if impl == "cudnn":
        if jax.default_backend() != "gpu":
            return "core"
        major = str(getattr(jax.devices()[0], "compute_capability", "0")).split(".")[0]  # "9.0": H100 / H200
        h_max = 256 if major.isdigit() and int(major) >= 9 else 128
        if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) or T % 2 or H % 8 \
                or H > h_max:
            return "core"
    return impl


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, causal: bool = False,
    scale: float | None = None, sinks: jax.Array | None = None, window: int | None = None,
    impl: str | None = None,
) -> jax.Array:
    """Grouped-query attention: q [B, T, N, H], k [B, K, S, H], v [B, K, S, Hv] (head-major, the
    KV-cache layout), mask [B, T, S] (True = may attend) -> [B, T, N, Hv].

    `scale` defaults to H^-0.5 (DeepSeek passes its YaRN-corrected scale). `sinks` [N] adds one
    learned logit per head to every softmax row (GPT-OSS). `causal=True` promises that key j is
    query j (S == T) and that `mask` is causal: queries are then processed in blocks of
    CAUSAL_CHUNK that only see the keys up to their block's end, which skips close to half of the
    score matrix (CPU attention is bound by its memory traffic). `window` (optional) promises that
    `mask` already keeps only the last `window` keys of each query; a fused kernel then skips the
    blocks outside it. `impl`: see `attention_impl` (default FORGELINE_ATTENTION, "auto").
    """
    B, T, N, H = q.shape
    K, S, Hv = k.shape[1], k.shape[2], v.shape[-1]
    scale = H**-0.5 if scale is None else scale
    kernel = attention_impl(q, k, v, causal=causal, sinks=sinks, impl=impl)
    if kernel != "core":  # jax.nn.dot_product_attention: [B, S, K, H] keys, the mask as [B, 1, T, S]
        return jax.nn.dot_product_attention(
            q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask=mask[:, None], scale=scale, is_causal=True,
            local_window_size=None if window is None else (window - 1, 0), implementation=kernel)
    q = (q * jnp.asarray(scale, q.dtype)).reshape(B, T, K, N // K, H)  # [B, T, K, G, H]
    sinks = None if sinks is None else sinks.astype(jnp.float32).reshape(K, N // K)  # [K, G]
    chunk = CAUSAL_CHUNK if causal and S == T and T > CAUSAL_CHUNK else T
    outs = []
    for t0 in range(0, T, chunk):
        t1 = min(t0 + chunk, T)
        s1 = t1 if chunk < T else S  # causal: later keys are masked for this block anyway
        q_blk = q[:, t0:t1].transpose(0, 2, 1, 3, 4)  # [B, K, C, G, H]
        out = attention_core(q_blk, k[:, :, :s1], v[:, :, :s1], mask[:, t0:t1, :s1], sinks)
        outs.append(out.transpose(0, 2, 1, 3, 4))  # [B, C, K, G, Hv]
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    return out.reshape(B, T, N, Hv)
