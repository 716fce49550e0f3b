"""Integer weight formats, registered (models/quant/formats/registry.py):

* `packed-int` — compressed-tensors `pack-quantized` int4 / int8 (weight-only and w4afp8; group or channel,
  symmetric or asymmetric): `weight_packed` int32 words (32/b codes a word, offset to unsigned, low bits
  first), `weight_scale` [out, G], `weight_shape` [2], and `weight_zero_point` [ceil(out·b/32), G] packed
  along the output axis; mirrors compressed-tensors 0.20 `compressors/pack_quantized/base.py` and
  `compressors/pack_quantized/helpers.py` (`pack_to_int32` / `unpack_from_int32`).
* `int8-channel` — `int-quantized` int8 per channel (int8-w8a8): `weight` int8 [out, in] and `weight_scale`
  [out, 1] (`compressors/naive_quantized/base.py` `IntQuantizationCompressor`), the layout vLLM's W8A8 int8
  kernels load.

Both round with models/quant/quantizers.py (RTN, GPTQ; AWQ's scaled weights by RTN) on the scheme's
`IntArgs`. https://github.com/vllm-project/compressed-tensors; docs/formats/compressed-tensors.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from models.quant import quantizers as Q
from models.quant.formats.registry import Getter, TensorSpec, WeightFormat, register_weight_format
from models.quant.schemes import Options, Scheme
from models.quant.state import QMatrix


def pack(q: np.ndarray, bits: int, axis: int = 1) -> np.ndarray:
    """Signed codes int8 [rows, cols] -> int32 words along `axis` (docs/formats/compressed-tensors.md):
    offset by 2^(b-1) to unsigned, 32/b per word, element p·j + i in bits b·i .. b·i + b - 1, the last
    word zero-padded."""
    if axis == 0:
        return np.ascontiguousarray(pack(q.T, bits).T)
    per = 32 // bits
    rows, n = q.shape
    u = (q.astype(np.int64) + (1 << (bits - 1))).astype(np.uint32)
    u = np.pad(u, ((0, 0), (0, -n % per))).reshape(rows, -1, per)  # [rows, words, per]
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    return np.ascontiguousarray(np.bitwise_or.reduce(u << shifts, axis=-1)).view(np.int32)


def unpack(packed: np.ndarray, bits: int, shape: tuple[int, int], axis: int = 1) -> np.ndarray:
    """Inverse of `pack`: int32 words -> signed int8 codes of `shape`."""
    if axis == 0:
        return np.ascontiguousarray(unpack(np.asarray(packed).T, bits, (shape[1], shape[0])).T)
    per, mask = 32 // bits, (1 << bits) - 1
    rows, n = shape
    u = np.asarray(packed).astype(np.int32).view(np.uint32)[:, :, None]
    shifts = (np.arange(per, dtype=np.uint32) * bits)[None, None, :]
    vals = ((u >> shifts) & mask).reshape(rows, -1)[:, :n]
    return (vals.astype(np.int32) - (1 << (bits - 1))).astype(np.int8)


class IntFormat(WeightFormat):
    """Integer codes int8 [out, in] (int4 one a byte) on the scheme's IntArgs grid: RTN, GPTQ (AWQ: RTN of
    the folded weights); scales [out, G], zero points [out, G] when asymmetric."""

    kind = "int"
    methods = ("rtn", "gptq", "awq")

    def quantize(self, w: np.ndarray, scheme: Scheme, H: np.ndarray | None, opts: Options,
                 global_scale: np.ndarray | None = None) -> tuple[QMatrix, str]:
        if H is not None:
            qt = Q.gptq(w, H, scheme.args, dampening_frac=opts.dampening_frac, actorder=scheme.actorder)
        else:
            qt = Q.rtn(w, scheme.args)
        return QMatrix(np.asarray(qt.q, np.int8), np.asarray(qt.scale, np.float32),
                       None if qt.zero is None else np.asarray(qt.zero, np.int8)), "rtn" if H is None else "gptq"

    def dequantize(self, qm: QMatrix, scheme: Scheme) -> np.ndarray:
        return np.asarray(Q.dequantize(Q.QTensor(qm.q, qm.scale, qm.zero), scheme.args))

    def weight_args(self, scheme: Scheme) -> dict[str, Any]:
        return {"num_bits": scheme.bits, "type": "int", "symmetric": scheme.symmetric,
                "strategy": "channel" if scheme.group_size is None else "group", "group_size": scheme.group_size,
                "block_structure": None, "dynamic": False, "actorder": "weight" if scheme.actorder else None,
                "observer": "minmax", "observer_kwargs": {}}

    def zeros(self, out: int, n_in: int, scheme: Scheme) -> QMatrix:
        G = scheme.groups(n_in)
        return QMatrix(np.zeros((out, n_in), np.int8), np.ones((out, G), np.float32),
                       None if scheme.symmetric else np.zeros((out, G), np.int8))


@register_weight_format
class PackedInt(IntFormat):
    """int4 / int8, group or channel, symmetric or not, written `pack-quantized`."""

    name = "packed-int"
    fixed_group = False
    read_note = "pack-quantized int4/int8 group or channel"

    def compressed_tensors_format(self, scheme: Scheme) -> str:
        return "pack-quantized"

    def specs(self, name: str, out: int, n_in: int, scheme: Scheme, scale_dtype: Any) -> list[TensorSpec]:
        per, G = 32 // scheme.bits, scheme.groups(n_in)
        specs = [(f"{name}.weight_packed", (out, -(-n_in // per)), np.dtype(np.int32)),
                 (f"{name}.weight_scale", (out, G), np.dtype(scale_dtype)),
                 (f"{name}.weight_shape", (2,), np.dtype(np.int32))]
        return specs + ([] if scheme.symmetric else [(f"{name}.weight_zero_point", (-(-out // per), G),
                                                      np.dtype(np.int32))])

    def pack(self, name: str, qm: QMatrix, scheme: Scheme, scale_dtype: Any) -> dict[str, np.ndarray]:
        out = {f"{name}.weight_packed": pack(qm.q, scheme.bits), f"{name}.weight_scale": qm.scale.astype(scale_dtype),
               f"{name}.weight_shape": np.asarray(qm.q.shape, np.int32)}
        if qm.zero is not None:
            out[f"{name}.weight_zero_point"] = pack(qm.zero, scheme.bits, axis=0)
        return out

    def unpack(self, get: Getter, name: str, out: int, n_in: int, scheme: Scheme) -> QMatrix | None:
        per = 32 // scheme.bits
        G = scheme.groups(n_in)
        packed = get(f"{name}.weight_packed", (out, -(-n_in // per)))
        shape = get(f"{name}.weight_shape", (2,))
        scale = get(f"{name}.weight_scale", (out, G))
        zero = None if scheme.symmetric else get(f"{name}.weight_zero_point", (-(-out // per), G))
        if packed is None or scale is None or (not scheme.symmetric and zero is None):
            return None
        if shape is not None and [int(v) for v in np.asarray(shape)] != [out, n_in]:
            raise ValueError(f"{name}.weight_shape = {np.asarray(shape).tolist()} (expected {[out, n_in]})")
        return QMatrix(unpack(np.asarray(packed), scheme.bits, (out, n_in)), np.asarray(scale, np.float32),
                       None if zero is None else unpack(np.asarray(zero), scheme.bits, (out, G), axis=0))

    def read(self, fmt: str | None, weights: Mapping[str, Any]) -> Scheme | None:
        w = weights
        if fmt == "pack-quantized" and w.get("type") == "int" and w.get("num_bits") in (4, 8) \
                and w.get("strategy") in ("group", "channel"):
            group = w.get("group_size") if w.get("strategy") == "group" else None
            return Scheme("loaded", self.name, int(w["num_bits"]), group, bool(w.get("symmetric", True)))
        return None


@register_weight_format
class Int8Channel(IntFormat):
    """int8 per output channel, symmetric, written `int-quantized` (unpacked int8 codes)."""

    name = "int8-channel"

    def compressed_tensors_format(self, scheme: Scheme) -> str:
        return "int-quantized"

    def specs(self, name: str, out: int, n_in: int, scheme: Scheme, scale_dtype: Any) -> list[TensorSpec]:
        return [(f"{name}.weight", (out, n_in), np.dtype(np.int8)),
                (f"{name}.weight_scale", (out, 1), np.dtype(scale_dtype))]

    def pack(self, name: str, qm: QMatrix, scheme: Scheme, scale_dtype: Any) -> dict[str, np.ndarray]:
        return {f"{name}.weight": np.asarray(qm.q, np.int8), f"{name}.weight_scale": qm.scale.astype(scale_dtype)}

    def unpack(self, get: Getter, name: str, out: int, n_in: int, scheme: Scheme) -> QMatrix | None:
        q = get(f"{name}.weight", (out, n_in))
        s = get(f"{name}.weight_scale", (out, 1))
        if q is None or s is None:
            return None
        return QMatrix(np.asarray(q).astype(np.int8), np.asarray(s, np.float32))
