"""Post-training weight quantization (RTN, GPTQ, AWQ int4/int8; FP8 128x128 blocks) and the checkpoint
layouts serving engines load. Algorithms and on-disk formats live apart, as llm-compressor's modifiers
do from compressed-tensors' formats:

    schemes.py       scheme names -> Scheme (bits, group, symmetry, method), Options
    targets.py       which modules get quantized (Linears, expert stacks; `ignore`)
    quantizers.py    the math on one matrix: min-max parameters, RTN, GPTQ, AWQ scale search, FP8 tiles
    calibration.py   per-layer activation statistics (Hessians H = Σ x xᵀ, |x| means)
    awq.py           AWQ scales folded into the op before each group of Linears
    driver.py        quantize_model: layer by layer, calibrate -> (AWQ) -> quantize -> next layer
    state.py         the quantized state in memory (codes, scales, zero points on Linear / Experts)
    formats/         on-disk layouts only: compressed-tensors (written and read), DeepSeek FP8 (written
                     and read), GPT-OSS MXFP4 (read)

    scheme = parse_scheme("w4a16-gptq")                       # int4, group 128, symmetric, GPTQ
    report = quantize_model(model, scheme, calibration)       # in place; calibration: [(ids, segment_ids)]
    save_pretrained(model, "out/")                            # compressed-tensors, see `to_compressed_tensors`

See docs/quantization.md, docs/formats/compressed-tensors.md and docs/formats/deepseek-fp8.md.
"""

from models.moe import Experts  # the tests read it as quant.Experts
from models.quant.awq import awq_layer
from models.quant.calibration import _layer_context, _layer_forward, calibration_tokens, collect_stats
from models.quant.driver import quantize_int8, quantize_model
from models.quant.formats.compressed_tensors import (
    load_experts,
    load_linear,
    pack,
    prepare_for_load,
    read_scheme,
    to_compressed_tensors,
    unpack,
)
from models.quant.formats.deepseek_fp8 import to_deepseek_fp8
from models.quant.schemes import SCHEME_RE, Options, Scheme, parse_scheme
from models.quant.state import iter_qmatrices, scheme_of, weight_bytes
from models.quant.targets import check_divisible, check_supported, is_quantized, quant_units

__all__ = [
    "SCHEME_RE", "Experts", "Options", "Scheme",
    "_layer_context", "_layer_forward", "awq_layer", "calibration_tokens", "check_divisible", "check_supported",
    "collect_stats", "is_quantized", "iter_qmatrices", "load_experts", "load_linear", "pack", "parse_scheme",
    "prepare_for_load", "quant_units", "quantize_int8", "quantize_model", "read_scheme", "scheme_of",
    "to_compressed_tensors", "to_deepseek_fp8", "unpack", "weight_bytes",
]
