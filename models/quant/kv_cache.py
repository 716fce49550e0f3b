"""FP8 KV cache with calibrated static scales, beside any weight scheme: one `k_scale` and one `v_scale` per
attention layer (strategy "tensor") or per KV head ("attn_head"), calibrated on the already-quantized model,
applied in our attention (models/decoder.py `GQAttention`, models/numerics.py `quantize_kv_fp8`) and written as
compressed-tensors writes them.

    report = quantize_model(model, scheme, batches)               # models/quant/driver.py, any scheme
    kv = calibrate_kv_cache(model, batches, "tensor")             # in place: the attention modules get scales
    save_pretrained(model, "out/")                                # + kv_cache_scheme and self_attn.k_scale / v_scale

Mirrors compressed-tensors 0.20.1 (and llm-compressor's calibration with it):

* what is observed: `modeling/kvcache.py::QuantizedKVCache.forward` quantizes the key and value states the
  attention hands to the cache update, in transformers after k_norm (Qwen3, GLM) and RoPE: the tensors the cache
  stores. `GQAttention` sows exactly those (`calib_k` / `calib_v`, [B, T, K, H]) when `kv_calibrating` is set;
* the statistic: a static min-max over every real calibration token (segment 0 = padding excluded), as
  llm-compressor's static min-max observer keeps it; per tensor, or per KV head over (batch, tokens, head dim);
* the scale: `quantization/utils/helpers.py::calculate_qparams` for symmetric FP8 E4M3, amax / 448 (0 is always
  in the range), a zero scale replaced by float32 eps; shapes `quantization/lifecycle/initialize.py::
  initialize_qparams`: [1] per tensor, [num_kv_heads, 1, 1] for `QuantizationStrategy.ATTN_HEAD`. Scales are
  kept in float32 in memory and on disk, whatever the weights' dtype (vLLM holds its k/v scales in float32);
* the config: `quantization_config.kv_cache_scheme` = QuantizationArgs(num_bits=8, type="float",
  symmetric=True, strategy=..., dynamic=False) as its serializer writes it (`quant_args.py`), next to the
  weight scheme's config group; no zero points (`_apply_kv_cache_scheme` initializes none for symmetric args).

Calibration is sequential, as llm-compressor's sequential pipeline: layer i's K / V come from the quantized
layers before it, whose own K / V are already FP8 (what an engine serving this checkpoint computes).

Engines: vLLM with `kv_cache_dtype="fp8"` (and `calculate_kv_scales` off) loads `model.layers.N.self_attn.k_scale`
/ `v_scale` from the checkpoint (`CompressedTensorsKVCacheMethod`; per-head scales on its Flash Attention
backend); SGLang (`--kv-cache-dtype fp8_e4m3`) reads the same names, per tensor only. MLA families (DeepSeek-V3,
Kimi K2) are refused (`check_kv_cache`), and so are GPT-OSS's MXFP4 experts, whose layout has no
`kv_cache_scheme`. See docs/quantization.md, "FP8 KV cache".

Shape legend: B batch, T tokens, K kv heads, H head dim, L layers.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.decoder import GQAttention
from models.layers import QuantScale, param
from models.moe import Experts
from models.numerics import F32_EPS, FP8_MAX
from models.quant.calibration import _layer_context, calibration_tokens, layer_inputs, next_inputs
from models.quant.targets import Unit

KV_CACHE_KINDS = ("fp8",)  # the `quantize.kv_cache` values besides null
KV_STRATEGIES = ("tensor", "attn_head")  # compressed-tensors' QuantizationStrategy values for a KV cache


def kv_cache_args(strategy: str) -> dict[str, Any]:
    """`kv_cache_scheme` as compressed-tensors 0.20.1 serializes QuantizationArgs(num_bits=8, type="float",
    symmetric=True, strategy=strategy, dynamic=False) (unset optional fields omitted)."""
    _check_strategy(strategy)
    return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": strategy,
            "dynamic": False}


def _check_strategy(strategy: str) -> None:
    if strategy not in KV_STRATEGIES:
        raise ValueError(f"kv_cache strategy {strategy!r} (known: {', '.join(KV_STRATEGIES)})")


def scale_shape(strategy: str, num_kv_heads: int) -> tuple[int, ...]:
    """compressed-tensors' k_scale / v_scale shape: [1] per tensor, [K, 1, 1] per KV head."""
    _check_strategy(strategy)
    return (1,) if strategy == "tensor" else (num_kv_heads, 1, 1)


# ------------------------------------------------------------------------------------------------
# Which attention modules; the families that cannot have an FP8 KV cache here
# ------------------------------------------------------------------------------------------------


def check_kv_cache(model: nnx.Module, strategy: str = "tensor", units: Sequence[Unit] = ()) -> list[GQAttention]:
    """The main stack's attention modules (`model.layers[i].self_attn`, i < num_hidden_layers) that get scales
    (works on an `nnx.eval_shape` model). Refused, with the reason:

    * MLA (DeepSeek-V3, Kimi K2): engines cache the compressed latent and the RoPE key (one kv_lora_rank +
      qk_rope_head_dim entry per token, quantized with one scale by vLLM's `concat_and_cache_mla`), while
      compressed-tensors / llm-compressor observe the per-head keys and values transformers' MLA hands its cache;
      a scale from either distribution is wrong for the other, so no checkpoint written here would mean the
      same to transformers and to vLLM;
    * GPT-OSS with MXFP4 experts (`units` holding its fused experts): that layout's config (`quant_method:
      mxfp4`) has no `kv_cache_scheme`.
    """
    _check_strategy(strategy)
    L = model.config.num_hidden_layers
    attns = [model.layers[i].self_attn for i in range(L)]
    if any(not isinstance(a, GQAttention) for a in attns):
        raise ValueError(
            f"kv_cache fp8: {type(model).__name__} uses multi-head latent attention (MLA, DeepSeek-V3 / Kimi K2): "
            "engines cache its compressed latent and RoPE key (one scale for the latent cache in vLLM) while "
            "compressed-tensors calibrates k_scale / v_scale on the per-head keys and values transformers caches, "
            "so no scale would mean the same to both; FP8 KV cache is supported for GQA families only")
    if any(isinstance(u.module, Experts) and u.module.hf_layout == "gpt_oss" for u in units):
        raise ValueError("kv_cache fp8: GPT-OSS's MXFP4 experts are written in GPT-OSS's own layout (quant_method "
                         "mxfp4), which has no kv_cache_scheme; ignore the experts (re:.*mlp\\.experts) to write "
                         "compressed-tensors, or leave kv_cache null")
    return attns


# ------------------------------------------------------------------------------------------------
# Scales on the attention modules
# ------------------------------------------------------------------------------------------------


def kv_scale(amax: np.ndarray) -> np.ndarray:
    """amax (float32, any shape) -> the FP8 E4M3 scale amax / 448 (IEEE float32 division, as torch's), a zero
    scale -> float32 eps (compressed-tensors `calculate_qparams`, symmetric, scale dtype float32)."""
    s = np.asarray(amax, np.float32) / np.float32(FP8_MAX)
    return np.where(s == 0, np.float32(F32_EPS), s).astype(np.float32)


def set_kv_scales(attn: GQAttention, k_scale: np.ndarray, v_scale: np.ndarray, strategy: str) -> None:
    """Give an attention module its static scales (float32, reshaped to `scale_shape`), saved and loaded under
    its HF name (`hf_raw`: `model.layers.N.self_attn.k_scale` / `v_scale`)."""
    shape = scale_shape(strategy, attn.num_kv_heads)
    axes = (None,) * len(shape)
    attn.k_scale = param(jnp.asarray(np.asarray(k_scale, np.float32).reshape(shape)), axes, QuantScale)
    attn.v_scale = param(jnp.asarray(np.asarray(v_scale, np.float32).reshape(shape)), axes, QuantScale)
    attn.hf_raw = tuple(dict.fromkeys((*attn.hf_raw, "k_scale", "v_scale")))


def clear_kv_scales(attn: GQAttention) -> None:
    attn.k_scale = attn.v_scale = None
    attn.hf_raw = tuple(a for a in attn.hf_raw if a not in ("k_scale", "v_scale"))


def _scaled(model: nnx.Module) -> list[GQAttention]:
    return [a for _, a in nnx.iter_graph(model) if isinstance(a, GQAttention) and a.k_scale is not None]


def kv_cache_strategy(model: nnx.Module) -> str | None:
    """"tensor" or "attn_head" when the model's main stack has an FP8 KV cache, None without one; an error when
    only some layers have scales, or of mixed shapes."""
    scaled = _scaled(model)
    if not scaled:
        return None
    attns = [model.layers[i].self_attn for i in range(model.config.num_hidden_layers)]
    ndims = {a.k_scale[...].ndim if a.k_scale is not None else None for a in attns}
    if len(ndims) != 1 or None in ndims:
        raise ValueError("FP8 KV cache: some attention layers have k_scale / v_scale and others do not (or of "
                         "different strategies); calibrate them all with calibrate_kv_cache")
    return "tensor" if ndims == {1} else "attn_head"


def kv_cache_scheme(model: nnx.Module) -> dict[str, Any] | None:
    """`quantization_config.kv_cache_scheme` for the model: compressed-tensors' args, or None."""
    strategy = kv_cache_strategy(model)
    return None if strategy is None else kv_cache_args(strategy)


@contextlib.contextmanager
def without_kv_scales(model: nnx.Module) -> Iterator[None]:
    """The model without its KV scales inside the block (a layout with no place for them), restored after."""
    kept = [(a, a.k_scale, a.v_scale, a.hf_raw) for a in _scaled(model)]
    for a, *_ in kept:
        clear_kv_scales(a)
    try:
        yield
    finally:
        for a, k, v, raw in kept:
            a.k_scale, a.v_scale, a.hf_raw = k, v, raw


# ------------------------------------------------------------------------------------------------
# Reading a checkpoint's kv_cache_scheme
# ------------------------------------------------------------------------------------------------


def read_kv_cache_scheme(qc: dict[str, Any], source: str) -> str | None:
    """The strategy of a compressed-tensors `quantization_config.kv_cache_scheme` (None: no KV quantization); a
    clear error for anything but static symmetric FP8 E4M3 per tensor or per KV head."""
    kv = qc.get("kv_cache_scheme")
    if kv is None:
        return None
    strategy = kv.get("strategy") or ("tensor" if kv.get("group_size") is None else None)
    if not (kv.get("num_bits") == 8 and str(kv.get("type", "int")).lower() == "float"
            and kv.get("symmetric", True) is True and kv.get("dynamic", False) is False
            and kv.get("group_size") is None and strategy in KV_STRATEGIES):
        raise ValueError(f"{source}: unsupported quantization_config.kv_cache_scheme {dict(kv)} (read: static "
                         "symmetric FP8 E4M3, strategy 'tensor' or 'attn_head')")
    return strategy


def prepare_kv_scales(model: nnx.Module, strategy: str | None) -> None:
    """Placeholder scales (ones) of the strategy's shape on every attention module, for hf_to_state to fill from
    the checkpoint's `self_attn.k_scale` / `v_scale` (works on an `nnx.eval_shape` model); nothing for None."""
    if strategy is None:
        return
    for a in check_kv_cache(model, strategy):
        ones = np.ones(scale_shape(strategy, a.num_kv_heads), np.float32)
        set_kv_scales(a, ones, ones, strategy)


# ------------------------------------------------------------------------------------------------
# Calibration
# ------------------------------------------------------------------------------------------------


@nnx.jit(static_argnames=("i", "per_head"))
def _kv_amax(model: nnx.Module, x: jax.Array, seg: jax.Array, i: int, per_head: bool,
             carry: dict[str, jax.Array] | None = None) -> tuple[jax.Array, jax.Array]:
    """Decoder layer i on x [B, T, D] (given what earlier layers carried) with its attention sowing the K / V it
    caches -> (max |K|, max |V|) over the real tokens (seg != 0): [] per tensor, [K] per KV head."""
    layer = model.layers[i]
    ctx = _layer_context(model, seg, i, carry)
    _, sown = nnx.capture(lambda lyr: lyr(x, ctx, None, i), nnx.Intermediate)(layer)
    flat = {tuple(str(p) for p in path): (v.get_value() if hasattr(v, "get_value") else v)[0]
            for path, v in nnx.to_flat_state(sown)}
    valid = (seg != 0)[:, :, None, None]  # [B, T, 1, 1]
    axes = (0, 1, 3) if per_head else None

    def amax(t: jax.Array) -> jax.Array:  # t [B, T, K, H]
        return jnp.max(jnp.where(valid, jnp.abs(t.astype(jnp.float32)), 0.0), axis=axes)

    return amax(flat[("self_attn", "calib_k")]), amax(flat[("self_attn", "calib_v")])


def calibrate_kv_cache(model: nnx.Module, batches: Sequence[tuple[np.ndarray, np.ndarray]],
                       strategy: str = "tensor") -> dict[str, Any]:
    """Calibrate FP8 KV-cache scales in place on `batches` of (input_ids [B, T], segment_ids [B, T]) (segment 0
    = padding), layer by layer on the model as it is (quantized or not): layer i's max |K| and |V| over every
    real token (per tensor or per KV head), scale = amax / 448, then layer i's output with its K / V quantized
    feeds layer i + 1. Returns the report: strategy, per layer the amax and scales, tokens, seconds."""
    t0 = time.perf_counter()
    attns = check_kv_cache(model, strategy)
    if _scaled(model):
        raise ValueError("the model already has FP8 KV cache scales")
    tokens = calibration_tokens(batches)
    if tokens == 0:
        raise ValueError("kv_cache fp8: the static KV scales need calibration data (no real calibration tokens)")
    xs, segs, carries = layer_inputs(model, batches)  # [B, T, D], [B, T], {} per batch
    rows: list[dict[str, Any]] = []
    for i, attn in enumerate(attns):
        attn.kv_calibrating = True
        try:
            k_amax = v_amax = None
            for x, seg, carry in zip(xs, segs, carries, strict=True):
                k, v = (np.asarray(a, np.float32)
                        for a in _kv_amax(model, x, seg, i, strategy == "attn_head", carry))
                k_amax = k if k_amax is None else np.maximum(k_amax, k)
                v_amax = v if v_amax is None else np.maximum(v_amax, v)
        finally:
            attn.kv_calibrating = False
        k_scale, v_scale = kv_scale(k_amax), kv_scale(v_amax)
        set_kv_scales(attn, k_scale, v_scale, strategy)
        rows.append({"module": f"model.layers.{i}.self_attn", "k_amax": np.atleast_1d(k_amax).tolist(),
                     "v_amax": np.atleast_1d(v_amax).tolist(), "k_scale": np.atleast_1d(k_scale).tolist(),
                     "v_scale": np.atleast_1d(v_scale).tolist()})
        xs, carries = next_inputs(model, xs, segs, carries, i)  # K / V now FP8
    return {"kv_cache": "fp8", "strategy": strategy, "layers": rows, "calibration_tokens": tokens,
            "seconds": time.perf_counter() - t0}


def kv_cache_bytes(model: nnx.Module, kv_cache: str | None) -> dict[str, Any]:
    """Bytes of one token's cache entry per layer (K and V of every KV head) at the given KV cache setting
    (None: bf16, what an engine serves in by default) and vs bf16; per-tensor or per-head scales add a few
    bytes per layer, not per token. A family whose cache keeps more than one entry per slot says how much per
    token (`config.kv_cache_values_per_token`, DeepSeek-V4: its compressed entries too, averaged over layers)."""
    c = model.config
    if (per_token := getattr(c, "kv_cache_values_per_token", None)) is not None:
        values = per_token()
    else:
        dims = getattr(c, "kv_cache_dims", None)  # MLA: its latent and RoPE key instead of K and V heads
        (kk, hk), (kv, hv) = dims() if dims else ((c.num_key_value_heads, c.head_dim),) * 2
        values = kk * hk + kv * hv
    per = 1 if kv_cache == "fp8" else 2
    return {"kv_bytes_per_token_per_layer": values * per, "bf16_kv_bytes_per_token_per_layer": values * 2,
            "kv_bytes_ratio_vs_bf16": per / 2}
