"""On-disk quantized checkpoint formats, and nothing else (the algorithms are in models/quant/):

    compressed_tensors.py   compressed-tensors: pack-quantized int4/int8, float-quantized FP8 blocks and
                            config.json's `quantization_config`; written and read
    deepseek_fp8.py         DeepSeek-V3 block FP8 (`weight_scale_inv` per 128x128 tile); written and read
    mxfp4.py                GPT-OSS MXFP4 experts (`_blocks` / `_scales`) and config.json's `mxfp4`
                            `quantization_config`; written and read
    dequantizing.py         the loader's float view over a published FP8 / MXFP4 checkpoint

See docs/formats/compressed-tensors.md and docs/formats/deepseek-fp8.md.
"""

from models.quant.formats.deepseek_fp8 import dequant_fp8_block
from models.quant.formats.dequantizing import DequantizingCheckpoint
from models.quant.formats.mxfp4 import FP4_VALUES, dequant_mxfp4, encode_mxfp4, has_gpt_oss_mxfp4, to_gpt_oss_mxfp4

__all__ = ["FP4_VALUES", "DequantizingCheckpoint", "dequant_fp8_block", "dequant_mxfp4", "encode_mxfp4",
           "has_gpt_oss_mxfp4", "to_gpt_oss_mxfp4"]
