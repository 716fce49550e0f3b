"""Shared builders for parity tests (used by conftest.py and the test modules): tiny random
transformers checkpoints saved to tmp_path.

Reference: docs/models/decoder.md, "fp32 parity conventions" (tiny random configs, fp32, eager attention,
`jax_default_matmul_precision="highest"`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch
import transformers

jax.config.update("jax_default_matmul_precision", "highest")

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)

VARIANTS = {
    "llama": (transformers.LlamaConfig, dict(head_dim=16)),
    "llama_bias": (transformers.LlamaConfig, dict(head_dim=16, attention_bias=True, mlp_bias=True)),
    "llama3_rope": (transformers.LlamaConfig, dict(head_dim=16, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=24, rope_parameters={"rope_type": "default",
                                                                          "rope_theta": 1e6})),
    "qwen3_tied": (transformers.Qwen3Config, dict(head_dim=24, tie_word_embeddings=True)),
}


def build_hf(variant: str, seed: int = 0) -> transformers.PreTrainedModel:
    """A random fp32 transformers model; norms and biases are randomised so that they matter."""
    config_cls, extra = VARIANTS[variant]
    config = config_cls(**TINY, **extra)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                         dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.05)
    return model


def hf_logits(model, ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    with torch.no_grad():
        kw = {} if attention_mask is None else {"attention_mask": torch.tensor(attention_mask)}
        return model(torch.tensor(np.asarray(ids), dtype=torch.long), **kw).logits.float().numpy()


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# ------------------------------------------------------------------------------------------------
# Shared by the quantization parity tests
# ------------------------------------------------------------------------------------------------

QUANT_LLAMA = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
                   rms_norm_eps=1e-5)
QUANT_QWEN3_MOE = dict(vocab_size=128, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
                       num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-5)


def calibration_batches(vocab: int, n: int = 2, b: int = 2, t: int = 32, seed: int = 1, pad: int = 0
                        ) -> list[tuple[np.ndarray, np.ndarray]]:
    """n random (input_ids [b, t], segment_ids [b, t]) batches; with `pad`, row 0 ends in that many
    padding tokens (segment 0, id 0)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(0, vocab, (b, t)).astype(np.int32)
        seg = np.ones((b, t), np.int32)
        if pad:
            seg[0, t - pad:] = 0
            ids[seg == 0] = 0
        out.append((ids, seg))
    return out


def bf16_rounded(model):
    """A copy of our quantized dense model whose quantized Linears hold their dequantized weights rounded to
    bfloat16 as float kernels (what compressed-tensors' NVFP4 decompression hands transformers); their
    activation quantization, if any, kept."""
    import jax.numpy as jnp
    from flax import nnx

    from models.layers import param
    from models.quant import quant_units

    copy = nnx.clone(model)
    for u in quant_units(copy):
        lin = u.module
        w = jnp.asarray(np.asarray(lin.weight()).astype(jnp.bfloat16).astype(np.float32))  # [in, out]
        lin.kernel = param(w, lin.axes)
        lin.qweight = lin.scale = lin.qglobal = None
    return copy


def checkpoint_maker(tmp_path_factory, configs: dict) -> Any:
    """make(arch) -> the folder of a saved tiny random transformers model of `configs[arch]()` (built once)."""
    cache: dict[str, str] = {}

    def make(arch: str) -> str:
        if arch not in cache:
            path = str(tmp_path_factory.mktemp(arch))
            build_from_config(configs[arch](), seed=0).save_pretrained(path)
            cache[arch] = path
        return cache[arch]

    return make


# ------------------------------------------------------------------------------------------------
# Shared by the MoE / MLA family parity tests
# ------------------------------------------------------------------------------------------------

BASE = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)


def tiny_configs() -> dict[str, transformers.PretrainedConfig]:
    """One tiny transformers config per registered architecture (MoE families with 8 experts, k 2), with
    the family's hard paths on: DeepSeek group-limited routing, YaRN with mscale and a q LoRA; GPT-OSS
    sliding window 8 and its default YaRN; GLM q/k/v bias, QK-norm and partial rotary; Qwen3 head_dim
    != hidden / heads; DeepSeek-V3.2's indexer keeping 8 keys (fewer than the tests'
    lengths); DeepSeek-V4's CSA (m=4, top 3 entries) and HCA (m=8) layers with a window of 8. Used by
    test_families_io.py and benchmarks/parity.py."""
    moe = dict(moe_intermediate_size=32, num_experts_per_tok=2)
    return {
        "LlamaForCausalLM": transformers.LlamaConfig(**BASE, intermediate_size=96, num_key_value_heads=2),
        "Qwen3ForCausalLM": transformers.Qwen3Config(**BASE, intermediate_size=96, num_key_value_heads=2, head_dim=24),
        "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig(**BASE, **moe, intermediate_size=96, num_key_value_heads=2,
                                                           head_dim=32, num_experts=8, norm_topk_prob=True),
        "DeepseekV3ForCausalLM": transformers.DeepseekV3Config(
            **BASE, **moe, intermediate_size=96, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
            n_group=2, topk_group=1, first_k_dense_replace=1,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 16}),
        "GptOssForCausalLM": transformers.GptOssConfig(
            **BASE, intermediate_size=32, num_key_value_heads=2, head_dim=16, num_local_experts=8,
            num_experts_per_tok=2, sliding_window=8),
        "Glm4MoeForCausalLM": transformers.Glm4MoeConfig(
            **BASE, **moe, intermediate_size=96, num_key_value_heads=2, head_dim=32, n_routed_experts=8,
            n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1, attention_bias=True,
            use_qk_norm=True),
        "DeepseekV32ForCausalLM": transformers.DeepseekV32Config(
            **BASE, **moe, intermediate_size=96, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
            n_group=2, topk_group=1, first_k_dense_replace=1, index_topk=8, index_head_dim=16, index_n_heads=8),
        "GlmMoeDsaForCausalLM": transformers.GlmMoeDsaConfig(
            **BASE, **moe, intermediate_size=96, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
            n_group=2, topk_group=1, first_k_dense_replace=1, index_topk=8, index_head_dim=16, index_n_heads=8,
            index_topk_pattern="F" + "S" * (BASE["num_hidden_layers"] - 1)),
        "DeepseekV4ForCausalLM": transformers.DeepseekV4Config(
            **BASE, **moe, head_dim=32, q_lora_rank=32, partial_rotary_factor=0.5, n_routed_experts=8,
            layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
            compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, hc_mult=2,
            sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3,
            mlp_layer_types=["hash_moe", "moe"]),
    }


ROTARY_BUFFERS = ("inv_freq", "original_inv_freq")


def perturb(model, seed: int = 0, scale: float = 0.5):
    """Move every tensor that inits to a constant away from it, so that it matters in a parity test:
    norms ~ N(1, 0.2); biases and sinks ~ N(0, scale); e_score_correction_bias ~ N(0, 0.1). Router
    weights (`mlp.gate.weight`, `mlp.router.weight`) are scaled ×25 so that routing depends on the
    token (at the 0.02 init every token picks the same experts once a bias is added). Other random
    matrices keep their transformers init. Returns the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.rsplit(".", 1)[-1] in ROTARY_BUFFERS or not p.is_floating_point():
                continue
            if "norm" in name and p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(("bias", "sinks")):
                p.copy_(scale * torch.randn(p.shape, generator=g))
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                p.mul_(25.0)
    return model


def build_from_config(config: transformers.PretrainedConfig, seed: int = 0) -> transformers.PreTrainedModel:
    """An fp32 eager transformers model from `config`, perturbed (see `perturb`)."""
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                         dtype=torch.float32).eval()
    return perturb(model, seed)


def decode_logits(model, ids: np.ndarray, split: int) -> np.ndarray:
    """Logits [B, T, V] from a prefill of ids[:, :split] then one token at a time through the KV cache
    (jitted: eager MoE dispatch is slow on CPU)."""
    import jax.numpy as jnp

    from models import KVCache, jit_forward

    B, T = ids.shape
    forward = jit_forward(model)
    logits, cache = forward(jnp.asarray(ids[:, :split]), cache=KVCache.init(model.config, B, T, model.dtype))
    out = [np.asarray(logits)]
    for t in range(split, T):
        step, cache = forward(jnp.asarray(ids[:, t:t + 1]), cache=cache)
        out.append(np.asarray(step))
    return np.concatenate(out, axis=1)


def left_padded_rel_err(model, hf, ids: np.ndarray, pads: list[int]) -> float:
    """rel_err of our logits vs transformers' on real tokens, row r left-padded by pads[r] (positions
    restart at each row's first real token; transformers gets the attention mask)."""
    import jax.numpy as jnp

    from models import jit_forward

    mask = np.ones_like(ids)
    for row, n in enumerate(pads):
        mask[row, :n] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    ours = np.asarray(jit_forward(model)(jnp.asarray(ids), positions=jnp.asarray(positions),
                                         segment_ids=jnp.asarray(mask)))
    ref = hf_logits(hf, ids, mask)
    return rel_err(ours[mask == 1], ref[mask == 1])


def set_expert_impl(model, impl: str) -> int:
    """Switch every models.moe.Experts of `model` to dispatch `impl`; returns how many there are."""
    from flax import nnx

    from models.moe import Experts

    n = 0
    for _, node in nnx.iter_graph(model):
        if isinstance(node, Experts):
            node.impl, n = impl, n + 1
    return n


def hf_reload_logits(path: str, ids: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
    """Load a folder we wrote with transformers (eager, fp32) and return its logits."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                             dtype=torch.float32).eval()
    return hf_logits(model, ids, attention_mask)


def with_config(src, dst, drop_prefix: str | None = None, **changes) -> str:
    """A copy of checkpoint folder `src` at `dst` with config.json keys changed (None deletes a key) and the
    tensors whose names start with `drop_prefix` left out."""
    import json

    import safetensors.numpy

    dst.mkdir()
    if drop_prefix is None:
        (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    else:
        tensors = safetensors.numpy.load_file(src / "model.safetensors")
        kept = {k: v for k, v in tensors.items() if not k.startswith(drop_prefix)}
        safetensors.numpy.save_file(kept, dst / "model.safetensors", metadata={"format": "pt"})
    d = json.loads((src / "config.json").read_text())
    d.update({k: v for k, v in changes.items() if v is not None})
    for k in [k for k, v in changes.items() if v is None]:
        d.pop(k, None)
    (dst / "config.json").write_text(json.dumps(d))
    return str(dst)


def assert_generate_is_the_forwards_argmax(model, prompt: np.ndarray, lengths: np.ndarray, tokens: np.ndarray,
                                           longer_than: int) -> None:
    """Each row's generated `tokens` [B, N] (greedy, after its left-padded prompt of lengths[row] real tokens) are
    the full forward's argmax over prompt + tokens (longer than `longer_than`, so the sparse paths run), with no
    near-tie the ≤ 1e-5 logit error could flip. One jitted forward for every row (rows of one length share it)."""
    import jax.numpy as jnp

    from models import jit_forward

    forward, P = jit_forward(model), prompt.shape[1]
    for row in range(len(prompt)):
        seq = np.concatenate([prompt[row, P - lengths[row]:], tokens[row]])[None]  # [1, len + N]
        assert seq.shape[1] > longer_than
        full = np.asarray(forward(jnp.asarray(seq)))[0, lengths[row] - 1:-1]  # [N, V]
        assert np.array_equal(full.argmax(-1), tokens[row]), row
        top2 = np.sort(full, axis=-1)[:, -2:]
        assert np.all(top2[:, 1] - top2[:, 0] > 1e-4)


def randomize_b(model, seed: int = 0, scale: float = 0.2) -> None:
    """Random LoRA B factors (they start at zero, where an adapter changes nothing and every parity holds)."""
    import jax.numpy as jnp

    from models.lora import lora_modules

    rng = np.random.default_rng(seed)
    for _, m in lora_modules(model):
        for name in ("lora_b", "gate_up_lora_b", "down_lora_b"):
            var = getattr(m, name, None)
            if var is not None:
                var[...] = jnp.asarray(scale * rng.normal(size=var[...].shape), jnp.float32)
