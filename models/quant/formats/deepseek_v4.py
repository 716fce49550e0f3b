"""DeepSeek-V4's published checkpoint layout (deepseek-ai/DeepSeek-V4-Flash, deepseek-ai/DeepSeek-V4-Pro), read on
load: the reference's tensor names (its `inference/model.py`) and two quantized formats side by side.

    <linear>.weight  float8_e4m3fn [M, N]  + <linear>.scale  float8_e8m0fnu [ceil(M/128), ceil(N/128)]
        (attention projections, the indexer's wq_b, the shared expert: DeepSeek's 128x128 block FP8, the scale a
        power of two that multiplies)
    <expert>.weight  int8 [out, in/2]      + <expert>.scale  float8_e8m0fnu [out, in/32]
        (routed experts w1 / w3 / w2: two E2M1 (FP4) codes a byte, the low nibble the even element, one E8M0
        scale per 32 values of a row: MXFP4's element and scale encodings, OCP MX v1.0)

config.json: `quantization_config` {quant_method fp8, fmt e4m3, scale_fmt ue8m0, weight_block_size [128, 128]} and a
top-level `expert_dtype: fp4`. Names: `embed.weight`, `layers.{i}.…`, `norm.weight`, `hc_head_{fn, base, scale}`,
`head.weight`, and the MTP layer under `mtp.{k}.…`, which transformers ignores. Mirrors transformers 5.25
`conversion_mapping.py` ("deepseek_v4"), `quantizers/quantizer_finegrained_fp8.py` (`.scale` read as
`weight_scale_inv`) and `integrations/finegrained_fp8.py` (`FP8Experts` with `expert_dtype="fp4"`, `Fp8Dequantize`:
`_unpack_fp4`, the scale grid giving the block). See docs/formats/deepseek-fp8.md (DeepSeek-V4).

    RenamedCheckpoint(base, DeepseekV4.hf_published_name)   the reference's names as transformers' save writes them
    dequant_fp4_rows(weight, scale)                         float32 [out, in], whole
    FP4RowsView(weight, scale)                              the same, read by slice (a sharded load)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from models import views
from models.quant.formats.mxfp4 import MX_BLOCK, dequant_mxfp4

SCALE_SUFFIX = ".scale"  # "<module>.scale" next to "<module>.weight"
FP4_PACKED_DTYPES = (np.dtype(np.int8), np.dtype(np.uint8))  # two E2M1 codes a byte (transformers: int8)


def dequant_fp4_rows(weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """weight int8 [out, in/2] (E2M1 pairs, low nibble first), scale E8M0 [out, in/32] -> float32 [out, in]."""
    w, s = np.asarray(weight).view(np.uint8), np.asarray(scale).view(np.uint8)
    rows, half = w.shape
    if (2 * half) % MX_BLOCK or s.shape != (rows, 2 * half // MX_BLOCK):
        raise ValueError(f"FP4 weight {[rows, half]} (packed) needs a scale of shape {[rows, 2 * half // MX_BLOCK]} "
                         f"(one per {MX_BLOCK} values), got {list(s.shape)}")
    return dequant_mxfp4(w.reshape(rows, 2 * half // MX_BLOCK, MX_BLOCK // 2), s)  # [out, in]


class FP4RowsView(views.View):
    """An FP4 expert weight as float32 [out, in], read by slice: only the 32-value groups the slice's columns
    overlap (16 bytes and one scale each), decoded, then cut to the slice (`dequant_fp4_rows`' math)."""

    def __init__(self, weight: views.View, scale: views.View):
        rows, half = weight.shape
        if (2 * half) % MX_BLOCK or tuple(scale.shape) != (rows, 2 * half // MX_BLOCK):
            raise ValueError(f"scale has shape {list(scale.shape)}, expected {[rows, 2 * half // MX_BLOCK]} for a "
                             f"packed FP4 weight {[rows, half]}")
        self.weight, self.scale = weight, scale
        self.shape, self.dtype = (rows, 2 * half), np.dtype(np.float32)

    def read(self, index: views.Index) -> np.ndarray:
        (r0, r1), (c0, c1) = index
        g0, g1 = c0 // MX_BLOCK, -(-c1 // MX_BLOCK)  # the groups the columns overlap
        half = MX_BLOCK // 2
        w = self.weight.read(((r0, r1), (g0 * half, g1 * half)))  # [r, 16 (g1 - g0)]
        s = self.scale.read(((r0, r1), (g0, g1)))  # [r, g1 - g0]
        return dequant_fp4_rows(w, s)[:, c0 - g0 * MX_BLOCK: c1 - g0 * MX_BLOCK]  # [r1 - r0, c1 - c0]


def tensor_dtype(base: Mapping[str, Any], name: str) -> np.dtype:
    """A tensor's dtype without reading it where the mapping has views (a checkpoint); else the array's."""
    view = getattr(base, "view", None)
    return np.dtype(view(name).dtype) if view is not None else np.asarray(base[name]).dtype


class RenamedCheckpoint(Mapping):
    """A {name: array} view of a checkpoint under other names: `rename(stored name) -> name` (one to one). `view`,
    `shape`, `path_of` and `source_names` pass through, so sliced reads and error messages stay those of the files."""

    def __init__(self, base: Mapping[str, Any], rename: Callable[[str], str]):
        self.base = base
        self.stored = {rename(name): name for name in base}
        if len(self.stored) != len(base):
            raise ValueError("checkpoint holds the same tensor under two spellings (the reference's and "
                             "transformers')")

    def __getitem__(self, name: str) -> Any:
        return self.base[self.stored[name]]

    def __contains__(self, name: object) -> bool:
        return name in self.stored

    def __iter__(self) -> Iterator[str]:
        return iter(self.stored)

    def __len__(self) -> int:
        return len(self.stored)

    def view(self, name: str) -> views.View:
        base_view = getattr(self.base, "view", None)
        if base_view is None:
            return views.Array(self[name])
        return base_view(self.stored[name])

    def shape(self, name: str) -> tuple[int, ...]:
        shape = getattr(self.base, "shape", None)
        return tuple(shape(self.stored[name])) if shape is not None else tuple(np.shape(self[name]))

    def path_of(self, name: str) -> str:
        path_of = getattr(self.base, "path_of", None)
        return path_of(self.stored.get(name, name)) if path_of is not None else "<tensors>"

    def clear_cache(self) -> None:
        getattr(self.base, "clear_cache", lambda: None)()
