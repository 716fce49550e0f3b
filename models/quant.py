"""Weight-only int8 (W8A16) quantization of decoder Linear layers and its compressed-tensors layout.

Reference: /work/shared/reference/speculative-and-quantization-formats.md §B2 (compressed-tensors
`pack-quantized`: config shape B2.1, the W8A16 preset B2.2, tensors and bit layout B2.3).

    model = quantize_int8(model)                     # in place: Linear.qweight int8 [in, out] + scale [out]
    qconfig, tensors = int8_to_compressed_tensors(model)   # what save_pretrained writes

Symmetric, per output channel: scale = amax / 127, q = round(w / scale) in [-127, 127]. Every
Linear except the top-level `lm_head` is quantized; embeddings and norms stay float. The forward
dequantizes on the fly (models/layers.py).

On disk, for a Linear `[out, in]`: `weight_packed` int32 [out, ceil(in/4)] holding q + 128 as
unsigned bytes, 4 per word, element 4j+i in bits 8i..8i+7; `weight_scale` [out, 1];
`weight_shape` int32 [2] = [out, in].
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.layers import Linear, QuantScale, QuantWeight, hf_name, param

NUM_BITS = 8
PACK = 32 // NUM_BITS  # values per int32 word
OFFSET = 1 << (NUM_BITS - 1)  # signed -> unsigned


def quantizable_linears(model: nnx.Module) -> Iterator[tuple[tuple, Linear]]:
    """(path, Linear) for every Linear except the LM head, in a stable order."""
    for path, node in nnx.iter_graph(model):
        if isinstance(node, Linear) and path[:1] != ("lm_head",):
            yield path, node


def set_int8(linear: Linear, qweight: Any, scale: Any) -> None:
    """Turn a Linear into its int8 form: qweight [in, out] int8, scale [out]; the kernel is dropped."""
    linear.qweight = param(jnp.asarray(qweight, jnp.int8), linear.axes, QuantWeight)
    linear.scale = param(jnp.asarray(scale, jnp.float32), (linear.axes[1],), QuantScale)
    linear.kernel = None


def quantize_int8(model: nnx.Module) -> nnx.Module:
    """Quantize every decoder Linear in place (LoRA factors, if any, are merged first); returns model."""
    for _, lin in quantizable_linears(model):
        if lin.qweight is not None:
            continue
        w = lin.weight().astype(jnp.float32)  # [in, out]
        amax = jnp.max(jnp.abs(w), axis=0)  # [out]
        scale = jnp.where(amax > 0, amax / 127.0, 1.0)
        q = jnp.clip(jnp.round(w / scale), -127, 127).astype(jnp.int8)
        lin.lora_a = lin.lora_b = None
        set_int8(lin, q, scale)
    return model


def is_quantized(model: nnx.Module) -> bool:
    return any(lin.qweight is not None for _, lin in quantizable_linears(model))


def weight_bytes(model: nnx.Module, *, linears_only: bool = False) -> int:
    """Bytes of the weights held: float params, int8 weights and their scales (LoRA factors excluded).

    `linears_only` counts only the quantizable (decoder) Linear layers, the denominator that the
    weight_bytes_ratio metric uses.
    """
    if linears_only:
        total = 0
        for _, lin in quantizable_linears(model):
            for v in (lin.kernel, lin.bias, lin.qweight, lin.scale):
                total += 0 if v is None else v[...].nbytes
        return total
    weights = nnx.state(model, nnx.Any(nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)), QuantWeight, QuantScale))
    return sum(x.nbytes for x in jax.tree.leaves(weights))


# ------------------------------------------------------------------------------------------------
# compressed-tensors pack-quantized (W8A16, channel, symmetric)
# ------------------------------------------------------------------------------------------------


def compressed_tensors_config() -> dict[str, Any]:
    """`quantization_config` for config.json (compressed-tensors W8A16 preset, pack-quantized)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": NUM_BITS, "type": "int", "symmetric": True, "strategy": "channel",
                    "group_size": None, "block_structure": None, "dynamic": False, "actorder": None,
                    "observer": "minmax", "observer_kwargs": {},
                },
                "input_activations": None,
                "output_activations": None,
                "format": "pack-quantized",
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "global_compression_ratio": None,
    }


def pack_int8(q: np.ndarray) -> np.ndarray:
    """int8 [out, in] -> int32 [out, ceil(in/4)]: offset to unsigned, 4 per word, low bits first."""
    out, n = q.shape
    u = (q.astype(np.int32) + OFFSET).astype(np.uint32)
    u = np.pad(u, ((0, 0), (0, -n % PACK)))
    u = u.reshape(out, -1, PACK)  # [out, words, 4]
    shifts = (np.arange(PACK, dtype=np.uint32) * NUM_BITS)[None, None, :]
    return np.bitwise_or.reduce(u << shifts, axis=-1).view(np.int32)


def unpack_int8(packed: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Inverse of pack_int8: int32 [out, words] -> int8 [out, in]."""
    out, n = shape
    u = packed.astype(np.int32).view(np.uint32)[:, :, None]
    shifts = (np.arange(PACK, dtype=np.uint32) * NUM_BITS)[None, None, :]
    vals = ((u >> shifts) & 0xFF).reshape(out, -1)[:, :n]
    return (vals.astype(np.int32) - OFFSET).astype(np.int8)


def int8_to_compressed_tensors(model: nnx.Module, *, scale_dtype: Any = np.float32
                               ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(quantization_config, tensors) for every quantized Linear, with HF names and [out, in] layout."""
    tensors: dict[str, np.ndarray] = {}
    for path, lin in quantizable_linears(model):
        if lin.qweight is None:
            raise ValueError(f"{hf_name(path)} is not quantized; run quantize_int8 first")
        name = hf_name(path)
        q = np.asarray(lin.qweight[...]).T  # [out, in]
        tensors[f"{name}.weight_packed"] = np.ascontiguousarray(pack_int8(q))
        tensors[f"{name}.weight_scale"] = np.asarray(lin.scale[...], np.float32).astype(scale_dtype)[:, None]
        tensors[f"{name}.weight_shape"] = np.asarray(q.shape, np.int32)
        if lin.bias is not None:
            tensors[f"{name}.bias"] = np.asarray(lin.bias[...]).astype(scale_dtype)
    return compressed_tensors_config(), tensors


def check_compressed_tensors_config(qc: dict[str, Any], source: str) -> None:
    """Raise unless `qc` is the one compressed-tensors scheme this module reads (W8A16 channel, packed)."""
    groups = list((qc.get("config_groups") or {}).values())
    w = groups[0].get("weights") or {} if len(groups) == 1 else {}
    ok = (qc.get("quant_method") == "compressed-tensors" and qc.get("format") == "pack-quantized"
          and w.get("num_bits") == 8 and w.get("type") == "int" and w.get("symmetric")
          and w.get("strategy") == "channel" and not groups[0].get("input_activations"))
    if not ok:
        raise ValueError(f"{source}: unsupported quantization_config (only compressed-tensors "
                         f"pack-quantized int8 symmetric per-channel weights are read)")
