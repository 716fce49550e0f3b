"""Quantization formats: what one weight becomes (registered classes) and the on-disk checkpoint layouts
that write and read them (the algorithms are in models/quant/):

    registry.py             the registry: `WeightFormat` (one class per weight format), `ActFormat`,
                            `register_weight_format`, `weight_format(name)`
    int_formats.py          packed int4/int8 (pack-quantized) and int8 per channel (int-quantized)
    fp8_formats.py          FP8 128x128 blocks and FP8 per output channel (float-quantized)
    fp4_formats.py          NVFP4 and MXFP4 (nvfp4- / mxfp4-pack-quantized)
    compressed_tensors.py   the compressed-tensors layout: config.json's `quantization_config` and every
                            module's tensors, dispatched to the weight formats; written and read
    deepseek_fp8.py         DeepSeek-V3 block FP8 (`weight_scale_inv` per 128x128 tile); written and read
    mxfp4.py                GPT-OSS MXFP4 experts (`_blocks` / `_scales`) and config.json's `mxfp4`
                            `quantization_config`; written and read
    dequantizing.py         the loader's float view over a published FP8 / MXFP4 checkpoint

Names are imported when first used (so that parsing a scheme name does not import JAX). See
docs/adding-a-quantization-format.md, docs/formats/compressed-tensors.md and docs/formats/deepseek-fp8.md.
"""

from models.lazy import exports

_LAZY = {
    "DequantizingCheckpoint": "models.quant.formats.dequantizing",
    "FP4_VALUES": "models.quant.formats.mxfp4",
    "dequant_fp8_block": "models.quant.formats.deepseek_fp8",
    "dequant_mxfp4": "models.quant.formats.mxfp4",
    "encode_mxfp4": "models.quant.formats.mxfp4",
    "has_gpt_oss_mxfp4": "models.quant.formats.mxfp4",
    "to_gpt_oss_mxfp4": "models.quant.formats.mxfp4",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = exports(__name__, _LAZY)
