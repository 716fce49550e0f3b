"""FP4 (E2M1) weight formats, registered (models/quant/formats/registry.py): compressed-tensors
`nvfp4-pack-quantized` / `mxfp4-pack-quantized`, `weight_packed` uint8 [out, in/2] (two E2M1 codes a byte,
the even element in the low nibble, code = sign bit 8 | magnitude index 0..7), and

* `nvfp4` — `weight_scale` float8_e4m3fn [out, in/16] and a float32 `weight_global_scale` [1], shared by the
  projections an engine fuses (q/k/v, gate/up); mirrors `compressors/nvfp4/` (`pack_fp4_to_uint8`).
* `mxfp4` — `weight_scale` uint8 E8M0 exponents [out, in/32] (value 2^(e - 127)); mirrors
  `compressors/mxfp4/base.py` with `compressors/mx_utils.py`.

In memory the codes are E2M1 values held as float8_e4m3fn (exact, sign of zero included), scales float32.
The rounding is models/quant/quantizers.py `nvfp4` / `mxfp4` (RTN) and `gptq_fp4`.
https://github.com/vllm-project/compressed-tensors; docs/formats/compressed-tensors.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from models.numerics import E2M1_VALUES, e2m1_index
from models.quant import quantizers as Q
from models.quant.formats.registry import Getter, TensorSpec, WeightFormat, register_weight_format
from models.quant.schemes import FP4_GROUP, Options, Scheme, parse_scheme
from models.quant.state import QMatrix


def pack_fp4(q: np.ndarray) -> np.ndarray:
    """E2M1 values [rows, cols] (cols even) -> uint8 [rows, cols/2]: code = 8·signbit | magnitude index, the
    even element in the low nibble (compressed-tensors `pack_fp4_to_uint8`)."""
    qf = np.asarray(q, np.float32)
    codes = e2m1_index(qf) | (np.signbit(qf).astype(np.uint8) << 3)
    return np.ascontiguousarray(codes[:, 0::2] | (codes[:, 1::2] << 4))


def unpack_fp4(packed: np.ndarray) -> np.ndarray:
    """Inverse of `pack_fp4`: uint8 [rows, cols/2] -> E2M1 values float32 [rows, cols] (-0 kept)."""
    b = np.asarray(packed).view(np.uint8)
    codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(b.shape[0], -1)  # [rows, cols]
    mag = E2M1_VALUES[codes & 0x07]
    return np.where(codes & 0x08, -mag, mag).astype(np.float32)


class FP4Format(WeightFormat):
    """E2M1 codes [out, in] in groups of FP4_GROUP[name] along the input, one scale a group; RTN or GPTQ."""

    kind = "fp4"
    codes = "float8_e4m3fn"
    methods = ("rtn", "gptq")

    def rtn(self, w: np.ndarray, global_scale: np.ndarray | None) -> Q.FP4Tensor:
        raise NotImplementedError

    def quantize(self, w: np.ndarray, scheme: Scheme, H: np.ndarray | None, opts: Options,
                 global_scale: np.ndarray | None = None) -> tuple[QMatrix, str]:
        if H is not None:
            t = Q.gptq_fp4(w, H, self.name, global_scale, dampening_frac=opts.dampening_frac)
        else:
            t = self.rtn(w, global_scale)
        return QMatrix(t.q.astype(ml_dtypes.float8_e4m3fn), t.scale, None, t.global_scale), \
            "rtn" if H is None else "gptq"

    def dequantize(self, qm: QMatrix, scheme: Scheme) -> np.ndarray:
        return Q.dequantize_fp4(qm.q, qm.scale, qm.global_scale)

    def compressed_tensors_format(self, scheme: Scheme) -> str:
        return f"{self.name}-pack-quantized"

    def weight_args(self, scheme: Scheme) -> dict[str, Any]:
        nv = self.shared_global
        return {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group" if nv else "group",
                "group_size": scheme.group_size, "block_structure": None, "dynamic": False, "actorder": None,
                "scale_dtype": "torch.float8_e4m3fn" if nv else "torch.uint8",
                "zp_dtype": "torch.float8_e4m3fn" if nv else "torch.uint8",
                "observer": "memoryless_minmax" if nv else "minmax", "observer_kwargs": {}}

    def scale_dtype(self) -> np.dtype:
        raise NotImplementedError

    def specs(self, name: str, out: int, n_in: int, scheme: Scheme, scale_dtype: Any) -> list[TensorSpec]:
        specs = [(f"{name}.weight_packed", (out, n_in // 2), np.dtype(np.uint8)),
                 (f"{name}.weight_scale", (out, scheme.groups(n_in)), self.scale_dtype())]
        return specs + ([(f"{name}.weight_global_scale", (1,), np.dtype(np.float32))] if self.shared_global else [])

    def unpack(self, get: Getter, name: str, out: int, n_in: int, scheme: Scheme) -> QMatrix | None:
        G = scheme.groups(n_in)
        packed = get(f"{name}.weight_packed", (out, n_in // 2))
        nv = self.shared_global
        scale = get(f"{name}.weight_scale", (out, G))
        glob = get(f"{name}.weight_global_scale", (1,)) if nv else None
        if packed is None or scale is None or (nv and glob is None):
            return None
        s = np.asarray(scale).astype(np.float32) if nv else Q.mx_scale_value(np.asarray(scale).view(np.uint8))
        return QMatrix(unpack_fp4(np.asarray(packed)).astype(ml_dtypes.float8_e4m3fn), s, None,
                       None if glob is None else np.asarray(glob, np.float32).reshape(1))

    def zeros(self, out: int, n_in: int, scheme: Scheme) -> QMatrix:
        return QMatrix(np.zeros((out, n_in), ml_dtypes.float8_e4m3fn), np.ones((out, scheme.groups(n_in)), np.float32),
                       None, np.ones((1,), np.float32) if self.shared_global else None)

    def read(self, fmt: str | None, weights: Mapping[str, Any]) -> Scheme | None:
        w = weights
        if fmt == self.compressed_tensors_format(None) and w.get("type") == "float" and w.get("num_bits") == 4 \
                and w.get("group_size") == FP4_GROUP[self.name] \
                and w.get("strategy") == ("tensor_group" if self.shared_global else "group"):
            return parse_scheme(f"{self.name}a16")
        return None


@register_weight_format
class NVFP4(FP4Format):
    """FP8-E4M3 scales per 16 values and a float32 global scale per tensor (fused projections share it)."""

    name = "nvfp4"
    shared_global = True
    read_note = "nvfp4-pack-quantized"

    def rtn(self, w: np.ndarray, global_scale: np.ndarray | None) -> Q.FP4Tensor:
        return Q.nvfp4(w, global_scale)

    def global_scale(self, amax: float) -> np.ndarray:
        return Q.nvfp4_global_scale(amax)

    def scale_dtype(self) -> np.dtype:
        return np.dtype(ml_dtypes.float8_e4m3fn)

    def pack(self, name: str, qm: QMatrix, scheme: Scheme, scale_dtype: Any) -> dict[str, np.ndarray]:
        return {f"{name}.weight_packed": pack_fp4(qm.q),
                f"{name}.weight_scale": qm.scale.astype(ml_dtypes.float8_e4m3fn),  # exact: FP8 values
                f"{name}.weight_global_scale": np.asarray(qm.global_scale, np.float32).reshape(1)}


@register_weight_format
class MXFP4(FP4Format):
    """Power-of-two (E8M0) scales per 32 values (OCP MX)."""

    name = "mxfp4"
    read_note = "mxfp4-pack-quantized"

    def rtn(self, w: np.ndarray, global_scale: np.ndarray | None) -> Q.FP4Tensor:
        return Q.mxfp4(w)

    def scale_dtype(self) -> np.dtype:
        return np.dtype(np.uint8)

    def pack(self, name: str, qm: QMatrix, scheme: Scheme, scale_dtype: Any) -> dict[str, np.ndarray]:
        return {f"{name}.weight_packed": pack_fp4(qm.q), f"{name}.weight_scale": Q.mx_code(qm.scale)}  # E8M0 codes
