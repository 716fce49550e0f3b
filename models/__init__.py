"""forgeline models: JAX/Flax NNX decoders, HF safetensors I/O, generation, LoRA, quantization.

Families (one file each, registered by HF `architectures` in registry.py): llama.py (Llama), qwen3.py
(Qwen3 dense), qwen3_moe.py, deepseek_v3.py (DeepSeek-V3/R1, Kimi K2), gpt_oss.py, glm4_moe.py
(GLM-4.5 / Air); shared pieces in layers.py, decoder.py (masks, GQA, MTP, the causal-LM forward)
and moe.py (routers, grouped expert dispatch).

    from models import from_pretrained, save_pretrained, generate
    model = from_pretrained("ckpt/")             # architecture chosen by config.json (registry.py)
    logits = model(input_ids)                    # [B, T, V]; jit it with jit_forward(model) or nnx.split

Tests: `pytest tests/unit/test_models*.py tests/parity` (parity needs transformers, peft, compressed-tensors).
"""

from models.generate import GenerateOutput, KVCache, generate, jit_forward
from models.hf import from_pretrained, hf_to_state, save_pretrained, state_to_hf
from models.layers import Linear
from models.llama import Llama, LlamaConfig
from models.lora import apply_lora, lora_state_to_peft, merge_lora, save_peft_adapter
from models.quant import parse_scheme, quantize_int8, quantize_model, to_compressed_tensors, weight_bytes
from models.registry import ARCHITECTURES
from models.speculative import DraftHead, MTPDraft, SpecOutput, speculative_generate

__all__ = [
    "ARCHITECTURES", "DraftHead", "GenerateOutput", "KVCache", "Linear", "Llama", "LlamaConfig", "MTPDraft",
    "SpecOutput",
    "apply_lora", "from_pretrained", "generate", "hf_to_state", "jit_forward", "lora_state_to_peft", "merge_lora",
    "parse_scheme", "quantize_int8", "quantize_model", "save_peft_adapter", "save_pretrained",
    "speculative_generate", "state_to_hf", "to_compressed_tensors", "weight_bytes",
]
