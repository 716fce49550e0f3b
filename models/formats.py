"""Dequantisation on load of published checkpoint formats: DeepSeek FP8 block weights and GPT-OSS
MXFP4 experts, presented to the loader as the float tensors transformers would hold.

Reference: /work/shared/reference/architectures.md §6.9 (FP8: `W · weight_scale_inv` per 128×128
tile, edge tiles zero-padded — the scale multiplies despite its name), §8.6–8.7 (MXFP4: two E2M1
codes per byte, low nibble first, one E8M0 scale per 32 values, exponent = byte − 127; transformers
`integrations/mxfp4.py` transposes the decoded [E, out, in] to its [E, in, out] layout) and
§11 pitfall 13.

    view = DequantizingCheckpoint(SafetensorsCheckpoint(folder))
    view["model.layers.0.self_attn.q_a_proj.weight"]     # float32, scale_inv applied
    view["model.layers.0.mlp.experts.gate_up_proj"]      # float32 [E, D, 2I] from _blocks/_scales
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

FP8_BLOCK = (128, 128)
SCALE_INV_SUFFIX = "_scale_inv"  # "<module>.weight_scale_inv" next to "<module>.weight"
FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def dequant_fp8_block(weight: np.ndarray, scale_inv: np.ndarray,
                      block: tuple[int, int] = FP8_BLOCK) -> np.ndarray:
    """weight [M, N] float8_e4m3fn, scale_inv [ceil(M/bm), ceil(N/bn)] -> float32 [M, N]."""
    M, N = weight.shape
    bm, bn = block
    expected = (-(-M // bm), -(-N // bn))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv has shape {list(scale_inv.shape)}, expected {list(expected)} "
                         f"for a {[M, N]} weight in {bm}x{bn} blocks")
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), bm, axis=0), bn, axis=1)[:M, :N]
    return weight.astype(np.float32) * scale


def dequant_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 (E8M0) -> float32 [..., G * 32].

    Each byte holds two FP4 codes: the low nibble is the even element, the high nibble the odd one.
    """
    blocks = np.asarray(blocks).view(np.uint8)
    scales = np.asarray(scales).view(np.uint8)
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}")
    out = np.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), np.float32)  # [..., G, 32]
    out[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    out[..., 1::2] = FP4_VALUES[blocks >> 4]
    out = np.ldexp(out, scales.astype(np.int32)[..., None] - 127)
    return out.reshape(*blocks.shape[:-2], -1)


class DequantizingCheckpoint(Mapping):
    """A {name: array} view over a checkpoint that dequantises FP8-block and MXFP4 tensors.

    * `X.weight` stored as F8_E4M3 with `X.weight_scale_inv` -> float32 `X.weight`; the scale is hidden.
    * `X_blocks` + `X_scales` (MXFP4) -> float32 `X` in transformers' [E, in, out] layout.
    Other tensors pass through. `path_of`, `shape` and `source_names` keep error messages exact.
    """

    def __init__(self, base: Mapping[str, np.ndarray]):
        self.base = base
        names = set(base)
        self.fp8: dict[str, str] = {}  # weight name -> its scale_inv name
        self.mxfp4: dict[str, tuple[str, str]] = {}  # logical name -> (blocks, scales)
        for name in names:
            if name.endswith(SCALE_INV_SUFFIX):
                weight = name[: -len(SCALE_INV_SUFFIX)]
                if weight in names:
                    self.fp8[weight] = name
            if name.endswith("_blocks") and name[: -len("_blocks")] + "_scales" in names:
                logical = name[: -len("_blocks")]
                self.mxfp4[logical] = (name, logical + "_scales")
        hidden = set(self.fp8.values()) | {n for pair in self.mxfp4.values() for n in pair}
        self.names = sorted((names - hidden) | set(self.mxfp4))

    @property
    def quantized(self) -> bool:
        return bool(self.fp8 or self.mxfp4)

    def source_names(self, name: str) -> tuple[str, ...]:
        if name in self.mxfp4:
            return self.mxfp4[name]
        return (name, self.fp8[name]) if name in self.fp8 else (name,)

    def path_of(self, name: str) -> str:
        path_of = getattr(self.base, "path_of", None)
        return path_of(self.source_names(name)[0]) if path_of else "<tensors>"

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.mxfp4:
            blocks = self.mxfp4[name][0]
            b = self.base.shape(blocks) if hasattr(self.base, "shape") else np.shape(self.base[blocks])
            *lead, out, groups, _ = b
            return (*lead, groups * 32, out)
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
        if name not in self.names:
            raise KeyError(name)
        return self.base[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
