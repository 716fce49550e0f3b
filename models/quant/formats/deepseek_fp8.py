"""DeepSeek-V3's block FP8 layout: `<module>.weight` float8_e4m3fn [out, in] next to
`<module>.weight_scale_inv` float32 [ceil(out/128), ceil(in/128)], one scale per 128x128 tile (edge tiles
zero-padded), which multiplies despite its name: W = weight · scale_inv of its tile. config.json says
`quant_method: fp8`, `weight_block_size: [128, 128]`, and lists the float Linears in
`modules_to_not_convert`.

Read: published checkpoints are dequantized to float on load (`dequant_fp8_block`, through
models/quant/formats/dequantizing.py). Written: `to_deepseek_fp8` for an fp8-block model. Mirrors
transformers `integrations/finegrained_fp8.py` (`weight_scale_inv`, `weight_block_size`). See
docs/formats/deepseek-fp8.md.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
from flax import nnx

from models.layers import Linear, hf_name
from models.quant.schemes import FP8_BLOCK
from models.quant.state import iter_qmatrices

SCALE_INV_SUFFIX = "_scale_inv"  # "<module>.weight_scale_inv" next to "<module>.weight"


def dequant_fp8_block(weight: np.ndarray, scale_inv: np.ndarray,
                      block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)) -> np.ndarray:
    """weight [M, N] float8_e4m3fn, scale_inv [ceil(M/bm), ceil(N/bn)] -> float32 [M, N]."""
    M, N = weight.shape
    bm, bn = block
    expected = (-(-M // bm), -(-N // bn))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv has shape {list(scale_inv.shape)}, expected {list(expected)} "
                         f"for a {[M, N]} weight in {bm}x{bn} blocks")
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), bm, axis=0), bn, axis=1)[:M, :N]
    return weight.astype(np.float32) * scale


def to_deepseek_fp8(model: nnx.Module) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """DeepSeek-V3's native block-FP8 layout (docs/formats/deepseek-fp8.md): `weight` float8_e4m3fn +
    `weight_scale_inv` float32 [ceil(out/128), ceil(in/128)] (which multiplies, despite its name)."""
    tensors: dict[str, np.ndarray] = {}
    for name, qm, bias in iter_qmatrices(model):
        tensors[f"{name}.weight"] = np.ascontiguousarray(np.asarray(qm.q).astype(ml_dtypes.float8_e4m3fn))
        tensors[f"{name}.weight_scale_inv"] = np.ascontiguousarray(qm.scale.astype(np.float32))
        if bias is not None:
            tensors[f"{name}.bias"] = np.asarray(bias[...], np.float32)
    quantized = {name for name, _, _ in iter_qmatrices(model)}
    float_linears = sorted({hf_name(p) for p, node in nnx.iter_graph(model) if isinstance(node, Linear)} - quantized)
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
              # Linears left in float (lm_head, ignored ones): loaders would make every other Linear FP8
              "modules_to_not_convert": float_linears}
    return config, tensors
