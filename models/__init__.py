"""forgeline models: JAX/Flax NNX decoders, HF safetensors I/O, generation, LoRA, quantization.

Families (one file each, registered by HF `architectures` in families.py): llama.py (Llama), qwen3.py
(Qwen3 dense), qwen3_moe.py, deepseek_v3.py (DeepSeek-V3/R1, Kimi K2), gpt_oss.py, glm4_moe.py
(GLM-4.5 / Air), deepseek_v32.py (DeepSeek-V3.2, DSA), glm_moe_dsa.py (GLM-5), deepseek_v4.py (DeepSeek-V4);
shared pieces in layers.py,
decoder.py (masks, GQA, MTP, the causal-LM forward) and moe.py (routers, grouped expert dispatch).

    from models import from_pretrained, save_pretrained, generate
    model = from_pretrained("ckpt/")             # architecture chosen by config.json (families.py)
    logits = model(input_ids)                    # [B, T, V]; jit it with jit_forward(model) or nnx.split

Tests: `pytest tests/unit/test_models*.py tests/parity` (parity needs transformers, peft, compressed-tensors).
"""

from models.lazy import exports

# name -> the module that defines it. Nothing is imported until used, so `import models.hf` does not build
# every family, `tasks/code.py` can tell what a `from models import name` depends on, and a config schema
# that needs one constant does not import JAX.
_LAZY = {
    "GenerateOutput": "models.generate",
    "KVCache": "models.generate",
    "generate": "models.generate",
    "jit_forward": "models.generate",
    "check_pretrained": "models.hf",
    "from_pretrained": "models.hf",
    "hf_to_state": "models.hf",
    "load_config": "models.hf",
    "save_pretrained": "models.hf",
    "state_to_hf": "models.hf",
    "Linear": "models.layers",
    "Llama": "models.llama",
    "LlamaConfig": "models.llama",
    "apply_lora": "models.lora",
    "lora_state_to_peft": "models.lora",
    "merge_lora": "models.lora",
    "save_peft_adapter": "models.lora",
    "parse_scheme": "models.quant.schemes",
    "quantize_int8": "models.quant.driver",
    "quantize_model": "models.quant.driver",
    "to_compressed_tensors": "models.quant.formats.compressed_tensors",
    "weight_bytes": "models.quant.state",
    "ARCHITECTURES": "models.families",
    "DraftHead": "models.speculative",
    "MTPDraft": "models.speculative",
    "SpecOutput": "models.speculative",
    "speculative_generate": "models.speculative",
}
__all__ = sorted(_LAZY)
__getattr__, __dir__ = exports(__name__, _LAZY)
