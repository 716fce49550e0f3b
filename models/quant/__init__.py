"""Post-training weight quantization (RTN, GPTQ, AWQ int4/int8; FP8 128x128 blocks) and the checkpoint
layouts serving engines load. Algorithms and on-disk formats live apart, as llm-compressor's modifiers
do from compressed-tensors' formats:

    schemes.py       scheme names -> Scheme (its weight and activation formats, bits, group, method), Options
    targets.py       which modules get quantized (Linears, expert stacks; `ignore`)
    quantizers.py    the math on one matrix: min-max parameters, RTN, GPTQ, AWQ scale search, FP8 tiles
    calibration.py   per-layer activation statistics (Hessians H = Σ x xᵀ, |x| means)
    awq.py           AWQ scales folded into the op before each group of Linears
    kv_cache.py      FP8 KV cache: static k/v scales calibrated on the quantized model, any weight scheme
    driver.py        quantize_model: layer by layer, calibrate -> (AWQ) -> quantize -> next layer
    state.py         the quantized state in memory (codes, scales, zero points on Linear / Experts)
    formats/         the weight formats, registered (registry.py: rounding, QuantizationArgs, tensors,
                     pack / unpack), and the on-disk layouts dispatching to them: compressed-tensors
                     (written and read), DeepSeek FP8 (written and read), GPT-OSS MXFP4 experts

    scheme = parse_scheme("w4a16-gptq")                       # int4, group 128, symmetric, GPTQ
    report = quantize_model(model, scheme, calibration)       # in place; calibration: [(ids, segment_ids)]
    save_pretrained(model, "out/")                            # compressed-tensors, see `to_compressed_tensors`

See docs/quantization.md, docs/formats/compressed-tensors.md and docs/formats/deepseek-fp8.md.
"""

from models.lazy import exports

# name -> the module that defines it. Nothing is imported until used, so `models.quant.schemes` does not import
# the algorithms, `tasks/code.py` can tell what a `from models import name` depends on, and a config schema
# that needs one constant does not import JAX.
_LAZY = {
    "Experts": "models.moe",
    "awq_layer": "models.quant.awq",
    "_layer_context": "models.quant.calibration",
    "_layer_forward": "models.quant.calibration",
    "calibration_tokens": "models.quant.calibration",
    "collect_stats": "models.quant.calibration",
    "quantize_int8": "models.quant.driver",
    "quantize_model": "models.quant.driver",
    "calibrate_kv_cache": "models.quant.kv_cache",
    "check_kv_cache": "models.quant.kv_cache",
    "kv_cache_bytes": "models.quant.kv_cache",
    "kv_cache_scheme": "models.quant.kv_cache",
    "kv_cache_strategy": "models.quant.kv_cache",
    "prepare_kv_scales": "models.quant.kv_cache",
    "read_kv_cache_scheme": "models.quant.kv_cache",
    "without_kv_scales": "models.quant.kv_cache",
    "to_deepseek_fp8": "models.quant.formats.deepseek_fp8",
    "has_gpt_oss_mxfp4": "models.quant.formats.mxfp4",
    "to_gpt_oss_mxfp4": "models.quant.formats.mxfp4",
    "load_experts": "models.quant.formats.compressed_tensors",
    "load_linear": "models.quant.formats.compressed_tensors",
    "pack": "models.quant.formats.int_formats",
    "prepare_for_load": "models.quant.formats.compressed_tensors",
    "read_scheme": "models.quant.formats.compressed_tensors",
    "to_compressed_tensors": "models.quant.formats.compressed_tensors",
    "unpack": "models.quant.formats.int_formats",
    "ActFormat": "models.quant.formats.registry",
    "WeightFormat": "models.quant.formats.registry",
    "register_weight_format": "models.quant.formats.registry",
    "weight_format": "models.quant.formats.registry",
    "SCHEME_RE": "models.quant.schemes",
    "Options": "models.quant.schemes",
    "Scheme": "models.quant.schemes",
    "parse_scheme": "models.quant.schemes",
    "iter_qmatrices": "models.quant.state",
    "scheme_of": "models.quant.state",
    "weight_bytes": "models.quant.state",
    "check_divisible": "models.quant.targets",
    "check_supported": "models.quant.targets",
    "is_quantized": "models.quant.targets",
    "quant_units": "models.quant.targets",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = exports(__name__, _LAZY)
