"""Dequantisation on load of published checkpoints: a {name: array} view that presents DeepSeek FP8
block weights (models/quant/formats/deepseek_fp8.py) and GPT-OSS MXFP4 experts
(models/quant/formats/mxfp4.py) as the float tensors transformers would hold after loading them
(transformers `integrations/finegrained_fp8.py`, `integrations/mxfp4.py`), whole (`view[name]`) or, for a
sharded load, slice by slice (`view.view(name)`: only the bytes and the dequantisation a slice needs).

    view = DequantizingCheckpoint(SafetensorsCheckpoint(folder))
    view["model.layers.0.self_attn.q_a_proj.weight"]     # float32, scale_inv applied
    view["model.layers.0.mlp.experts.gate_up_proj"]      # float32 [E, D, 2I] from _blocks/_scales

See docs/formats/deepseek-fp8.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import ml_dtypes
import numpy as np

from models import views
from models.quant.formats.deepseek_fp8 import FP8_BLOCK, SCALE_INV_SUFFIX, dequant_fp8_block
from models.quant.formats.deepseek_v4 import (
    FP4_PACKED_DTYPES,
    SCALE_SUFFIX,
    FP4RowsView,
    dequant_fp4_rows,
    tensor_dtype,
)
from models.quant.formats.mxfp4 import dequant_mxfp4


class DequantizingCheckpoint(Mapping):
    """A {name: array} view over a checkpoint that dequantises FP8-block and MXFP4 tensors.

    * `X.weight` stored as F8_E4M3 with `X.weight_scale_inv` -> float32 `X.weight`; the scale is hidden.
    * `X_blocks` + `X_scales` (MXFP4) -> float32 `X` in transformers' [E, in, out] layout.
    * DeepSeek-V4's `X.weight` + `X.scale` (E8M0): F8_E4M3 weights as FP8 blocks (above), int8 ones as FP4 rows
      [out, in/2] with one scale per 32 values (models/quant/formats/deepseek_v4.py) -> float32 `X.weight`.
    Other tensors pass through. `path_of`, `shape` and `source_names` keep error messages exact.
    """

    def __init__(self, base: Mapping[str, np.ndarray]):
        self.base = base
        names = set(base)
        self.fp8: dict[str, str] = {}  # weight name -> its scale_inv name
        self.mxfp4: dict[str, tuple[str, str]] = {}  # logical name -> (blocks, scales)
        self.fp4: dict[str, str] = {}  # DeepSeek-V4 expert weight name -> its scale name
        for name in names:
            weight = name[: -len(SCALE_SUFFIX)] + ".weight"
            if name.endswith(SCALE_SUFFIX) and weight in names:  # DeepSeek-V4: the scale by its module's name
                dtype = tensor_dtype(base, weight)
                if dtype in FP4_PACKED_DTYPES:
                    self.fp4[weight] = name
                elif dtype == np.dtype(ml_dtypes.float8_e4m3fn):
                    self.fp8[weight] = name
            if name.endswith(SCALE_INV_SUFFIX):
                weight = name[: -len(SCALE_INV_SUFFIX)]
                if weight in names:
                    self.fp8[weight] = name
            if name.endswith("_blocks") and name[: -len("_blocks")] + "_scales" in names:
                logical = name[: -len("_blocks")]
                self.mxfp4[logical] = (name, logical + "_scales")
        hidden = set(self.fp8.values()) | set(self.fp4.values()) | {n for pair in self.mxfp4.values() for n in pair}
        self.names = sorted((names - hidden) | set(self.mxfp4))
        self._known = set(self.names)

    @property
    def quantized(self) -> bool:
        return bool(self.fp8 or self.mxfp4 or self.fp4)

    def source_names(self, name: str) -> tuple[str, ...]:
        if name in self.mxfp4:
            return self.mxfp4[name]
        scale = self.fp8.get(name) or self.fp4.get(name)
        return (name, scale) if scale else (name,)

    def path_of(self, name: str) -> str:
        path_of = getattr(self.base, "path_of", None)
        return path_of(self.source_names(name)[0]) if path_of else "<tensors>"

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.mxfp4:
            blocks = self.mxfp4[name][0]
            b = self.base.shape(blocks) if hasattr(self.base, "shape") else np.shape(self.base[blocks])
            *lead, out, groups, _ = b
            return (*lead, groups * 32, out)
        if name in self.fp4:
            rows, half = self.base.shape(name) if hasattr(self.base, "shape") else np.shape(self.base[name])
            return (rows, 2 * half)
        return tuple(self.base.shape(name)) if hasattr(self.base, "shape") else tuple(self[name].shape)

    def __getitem__(self, name: str) -> np.ndarray:
        if name in self.mxfp4:
            blocks, scales = self.mxfp4[name]
            return np.swapaxes(dequant_mxfp4(self.base[blocks], self.base[scales]), -1, -2)  # [E, in, out]
        if name in self.fp8:
            try:
                return dequant_fp8_block(self.base[name], self.base[self.fp8[name]])
            except ValueError as e:
                raise ValueError(f"{self.path_of(name)}: tensor {self.fp8[name]}: {e}") from None
        if name in self.fp4:
            try:
                return dequant_fp4_rows(self.base[name], self.base[self.fp4[name]])
            except ValueError as e:
                raise ValueError(f"{self.path_of(name)}: tensor {self.fp4[name]}: {e}") from None
        if name not in self.names:
            raise KeyError(name)
        return self.base[name]

    def __contains__(self, name: object) -> bool:  # Mapping's default would read (and dequantise) it
        return name in self._known

    def clear_cache(self) -> None:
        getattr(self.base, "clear_cache", lambda: None)()

    def view(self, name: str) -> views.View:
        """A lazy view, read slice by slice: a plain tensor's own; an FP8-block weight's slice times the scale
        tiles it overlaps (`FP8BlockView`); an MXFP4 stack's slice from the 32-value groups it overlaps
        (`MXFP4View`). Each process of a sharded load dequantises only the slices its devices hold."""
        base_view = getattr(self.base, "view", None)
        if base_view is None:  # an in-memory mapping: whole on first read
            return views.Computed(lambda: self[name], self.shape(name), np.float32)
        if name in self.fp8:
            weight, scale = base_view(name), base_view(self.fp8[name])
            try:
                return FP8BlockView(weight, scale)
            except ValueError as e:
                raise ValueError(f"{self.path_of(name)}: tensor {self.fp8[name]}: {e}") from None
        if name in self.mxfp4:
            blocks, scales = (base_view(n) for n in self.mxfp4[name])
            if blocks.shape[:-1] != scales.shape:
                raise ValueError(f"{self.path_of(name)}: MXFP4 blocks {list(blocks.shape)} do not match scales "
                                 f"{list(scales.shape)}")
            return MXFP4View(blocks, scales)
        if name in self.fp4:
            try:
                return FP4RowsView(base_view(name), base_view(self.fp4[name]))
            except ValueError as e:
                raise ValueError(f"{self.path_of(name)}: tensor {self.fp4[name]}: {e}") from None
        return base_view(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class FP8BlockView(views.View):
    """A DeepSeek FP8-block weight [M, N] (float8_e4m3fn, one float32 `scale_inv` per 128 x 128 tile) as
    float32, read by slice: the slice's codes times the scale tiles it overlaps (`dequant_fp8_block`'s math)."""

    def __init__(self, weight: views.View, scale_inv: views.View, block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)):
        M, N = weight.shape
        expected = (-(-M // block[0]), -(-N // block[1]))
        if tuple(scale_inv.shape) != expected:
            raise ValueError(f"weight_scale_inv has shape {list(scale_inv.shape)}, expected {list(expected)} "
                             f"for a {[M, N]} weight in {block[0]}x{block[1]} blocks")
        self.weight, self.scale_inv, self.block = weight, scale_inv, block
        self.shape, self.dtype = (M, N), np.dtype(np.float32)

    def read(self, index: views.Index) -> np.ndarray:
        (m0, m1), (n0, n1) = index
        bm, bn = self.block
        t0, u0 = m0 // bm, n0 // bn
        s = self.scale_inv.read(((t0, -(-m1 // bm)), (u0, -(-n1 // bn)))).astype(np.float32)  # the tiles
        s = np.repeat(np.repeat(s, bm, axis=0), bn, axis=1)[m0 - t0 * bm: m1 - t0 * bm, n0 - u0 * bn: n1 - u0 * bn]
        return self.weight.read(index).astype(np.float32) * s  # [m1 - m0, n1 - n0]


class MXFP4View(views.View):
    """A GPT-OSS MXFP4 stack, blocks [..., out, G, 16] uint8 + scales [..., out, G] (E8M0), as transformers'
    float32 [..., in = 32 G, out], read by slice: only the 32-value groups the slice's `in` range overlaps."""

    def __init__(self, blocks: views.View, scales: views.View):
        *lead, out, groups, _ = blocks.shape
        self.blocks, self.scales = blocks, scales
        self.shape, self.dtype = (*lead, groups * 32, out), np.dtype(np.float32)

    def read(self, index: views.Index) -> np.ndarray:
        *lead, (i0, i1), (o0, o1) = index
        g0, g1 = i0 // 32, -(-i1 // 32)
        blocks = self.blocks.read((*lead, (o0, o1), (g0, g1), (0, 16)))  # [..., o, g, 16]
        scales = self.scales.read((*lead, (o0, o1), (g0, g1)))  # [..., o, g]
        values = dequant_mxfp4(blocks, scales)[..., i0 - g0 * 32: i1 - g0 * 32]  # [..., o, i]
        return np.swapaxes(values, -1, -2)  # [..., i, o]
