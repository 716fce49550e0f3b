"""FP8 (E4M3) weight formats, registered (models/quant/formats/registry.py), both written compressed-tensors
`float-quantized` (`compressors/naive_quantized/base.py` `FloatQuantizationCompressor`): `weight`
float8_e4m3fn [out, in] and `weight_scale` float32:

* `fp8-block` — one scale per 128x128 tile, [ceil(out/128), ceil(in/128)] (DeepSeek-V3's format,
  compressed-tensors' FP8_BLOCK preset; also written in DeepSeek's own layout, models/quant/formats/deepseek_fp8.py).
* `fp8-channel` — one scale per output channel, [out, 1] (the FP8_DYNAMIC preset's weights).

The rounding is models/quant/quantizers.py `fp8_block` (a per-channel scale is a [1, in] tile); no
calibration. https://github.com/vllm-project/compressed-tensors; docs/formats/compressed-tensors.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from models.quant import quantizers as Q
from models.quant.formats.registry import Getter, TensorSpec, WeightFormat, register_weight_format
from models.quant.schemes import FP8_BLOCK, Options, Scheme, parse_scheme
from models.quant.state import QMatrix

FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


class FP8Format(WeightFormat):
    """FP8 codes [out, in] with float32 scales over `tile(w)`-shaped tiles; the scheme's method is RTN."""

    codes = "float8_e4m3fn"
    methods = ("rtn",)

    def tile(self, n_in: int) -> tuple[int, int]:
        raise NotImplementedError

    def scale_shape(self, out: int, n_in: int) -> tuple[int, int]:
        r, c = self.tile(n_in)
        return math.ceil(out / r), math.ceil(n_in / c)

    def quantize(self, w: np.ndarray, scheme: Scheme, H: np.ndarray | None, opts: Options,
                 global_scale: np.ndarray | None = None) -> tuple[QMatrix, str]:
        q, s = Q.fp8_block(w, self.tile(w.shape[1]))
        return QMatrix(np.asarray(q), np.asarray(s, np.float32)), self.kind

    def compressed_tensors_format(self, scheme: Scheme) -> str:
        return "float-quantized"

    def weight_args(self, scheme: Scheme) -> dict[str, Any]:
        block = self.block is not None
        return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block" if block else "channel",
                "group_size": None, "block_structure": [self.block, self.block] if block else None, "dynamic": False,
                "actorder": None, "observer": "minmax", "observer_kwargs": {}}

    def specs(self, name: str, out: int, n_in: int, scheme: Scheme, scale_dtype: Any) -> list[TensorSpec]:
        return [(f"{name}.weight", (out, n_in), FP8),
                (f"{name}.weight_scale", self.scale_shape(out, n_in), np.dtype(scale_dtype))]

    def pack(self, name: str, qm: QMatrix, scheme: Scheme, scale_dtype: Any) -> dict[str, np.ndarray]:
        return {f"{name}.weight": np.asarray(qm.q).astype(ml_dtypes.float8_e4m3fn),
                f"{name}.weight_scale": qm.scale.astype(scale_dtype)}

    def unpack(self, get: Getter, name: str, out: int, n_in: int, scheme: Scheme) -> QMatrix | None:
        q = get(f"{name}.weight", (out, n_in))
        s = get(f"{name}.weight_scale", self.scale_shape(out, n_in))
        if q is None or s is None:
            return None
        return QMatrix(np.asarray(q).astype(ml_dtypes.float8_e4m3fn), np.asarray(s, np.float32))

    def zeros(self, out: int, n_in: int, scheme: Scheme) -> QMatrix:
        return QMatrix(np.zeros((out, n_in), ml_dtypes.float8_e4m3fn), np.ones(self.scale_shape(out, n_in), np.float32))


@register_weight_format
class FP8Block(FP8Format):
    """FP8 with one scale per FP8_BLOCK x FP8_BLOCK tile."""

    name = kind = "fp8-block"
    block = FP8_BLOCK
    layouts = {"deepseek": "deepseek-fp8"}  # also written in DeepSeek-V3's own layout, under <scheme>/deepseek/
    read_note = "float-quantized FP8 128x128 blocks"

    def tile(self, n_in: int) -> tuple[int, int]:
        return FP8_BLOCK, FP8_BLOCK

    def groups(self, scheme: Scheme, in_features: int) -> int:
        return math.ceil(in_features / FP8_BLOCK)

    def dequantize(self, qm: QMatrix, scheme: Scheme) -> np.ndarray:
        return np.asarray(Q.dequantize_fp8_block(qm.q, qm.scale, (FP8_BLOCK, FP8_BLOCK)))

    def read(self, fmt: str | None, weights: Mapping[str, Any]) -> Scheme | None:
        w = weights
        if fmt == "float-quantized" and w.get("type") == "float" and w.get("strategy") == "block" \
                and list(w.get("block_structure") or []) == [FP8_BLOCK, FP8_BLOCK]:
            return parse_scheme("fp8-block")
        return None


@register_weight_format
class FP8Channel(FP8Format):
    """FP8 with one scale per output channel (a [1, in] tile)."""

    name = "fp8-channel"
    kind = "fp8"

    def tile(self, n_in: int) -> tuple[int, int]:
        return 1, n_in

    def dequantize(self, qm: QMatrix, scheme: Scheme) -> np.ndarray:
        return np.asarray(qm.q).astype(np.float32) * np.asarray(qm.scale, np.float32)  # scale [out, 1]
