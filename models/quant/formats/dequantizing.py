"""Dequantisation on load of published checkpoints: a {name: array} view that presents DeepSeek FP8
block weights (models/quant/formats/deepseek_fp8.py) and GPT-OSS MXFP4 experts
(models/quant/formats/mxfp4.py) as the float tensors transformers would hold after loading them
(transformers `integrations/finegrained_fp8.py`, `integrations/mxfp4.py`).

    view = DequantizingCheckpoint(SafetensorsCheckpoint(folder))
    view["model.layers.0.self_attn.q_a_proj.weight"]     # float32, scale_inv applied
    view["model.layers.0.mlp.experts.gate_up_proj"]      # float32 [E, D, 2I] from _blocks/_scales

See docs/formats/deepseek-fp8.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np

from models import views
from models.quant.formats.deepseek_fp8 import SCALE_INV_SUFFIX, dequant_fp8_block
from models.quant.formats.mxfp4 import dequant_mxfp4


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
        self._known = set(self.names)

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

    def __contains__(self, name: object) -> bool:  # Mapping's default would read (and dequantise) it
        return name in self._known

    def clear_cache(self) -> None:
        getattr(self.base, "clear_cache", lambda: None)()

    def view(self, name: str) -> views.View:
        """A lazy view: a plain tensor's own (slices read alone); a quantised one dequantised whole on first
        read, then sliced."""
        if name not in self.fp8 and name not in self.mxfp4 and hasattr(self.base, "view"):
            return self.base.view(name)
        return views.Computed(lambda: self[name], self.shape(name), np.float32)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)
