"""GPT-OSS's MXFP4 expert weights, read: `<name>_blocks` uint8 [..., G, 16] holding two E2M1 (FP4)
codes a byte, low nibble first (the even element), and `<name>_scales` uint8 [..., G], one E8M0 scale
per 32 values (exponent = byte - 127). Decoded to float32 as transformers' `integrations/mxfp4.py`
(`FP4_VALUES`, `convert_moe_packed_tensors`) does; the loader's view
(models/quant/formats/dequantizing.py) then transposes [E, out, in] to transformers' [E, in, out].
See docs/formats/deepseek-fp8.md (MXFP4).
"""

from __future__ import annotations

import numpy as np

FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


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
