"""Hadamard rotations (models/quant/rotation.py): the float model's function is unchanged (logits within 1e-4)
for dense, MoE, GPT-OSS (biases, sinks) and MLA families; the matrices are orthogonal; GEMM inputs lose their
outlier channels; refusals are clear; a rotated, W4A4-quantized export reloads to the same model.

Reference: docs/quantization.md (rotations); QuaRot (arXiv:2404.00456) for what is folded where.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from parity_helpers import build_from_config, checkpoint_maker, rel_err

from benchmarks.quant import plant_outlier_channels
from models import from_pretrained, jit_forward, parse_scheme, quantize_model, save_pretrained
from models.quant import Options, quant_units
from models.quant.calibration import collect_stats
from models.quant.rotation import block_hadamard, random_hadamard, rotate_model

pytestmark = pytest.mark.parity
V = 128
IDS = np.random.default_rng(0).integers(0, V, (2, 16)).astype(np.int32)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=V, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, attention_bias=True, mlp_bias=True),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        vocab_size=V, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True),
    "gpt_oss": lambda: transformers.GptOssConfig(
        vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        pad_token_id=0),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        vocab_size=V, hidden_size=64, intermediate_size=160, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
        first_k_dense_replace=1, n_shared_experts=1),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_maker(tmp_path_factory, CONFIGS)


def ours(model) -> np.ndarray:
    return np.asarray(jit_forward(model)(jnp.asarray(IDS)))


@pytest.mark.parametrize("n", [64, 96, 192, 45])
def test_rotation_matrices_are_orthogonal_and_flat(n):
    q = random_hadamard(n, seed=3)
    np.testing.assert_allclose(q @ q.T, np.eye(n), atol=1e-12)
    if n & (n - 1) == 0:  # a Hadamard: every entry ±1/√n, so one outlier channel spreads evenly
        np.testing.assert_allclose(np.abs(q), 1 / np.sqrt(n), rtol=1e-12)
    assert not np.allclose(q, random_hadamard(n, seed=4))  # seeded


def test_block_rotation_is_orthogonal_within_blocks_and_keeps_the_function(checkpoint):
    q = block_hadamard(96, 16, seed=2)
    np.testing.assert_allclose(q @ q.T, np.eye(96), atol=1e-12)
    assert np.count_nonzero(q) == 96 * 16  # one 16x16 Hadamard per block: nothing crosses a scale group
    with pytest.raises(ValueError, match="must be a power of two dividing 96"):
        block_hadamard(96, 24)
    model = from_pretrained(checkpoint("llama"))
    before = ours(model)
    assert rotate_model(model, block=16)["rotation"] == "hadamard-block16"
    assert rel_err(ours(model), before) <= 1e-4


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_rotation_keeps_the_float_function(checkpoint, arch):
    model = from_pretrained(checkpoint(arch))
    before = ours(model)
    embed0 = np.asarray(model.embed_tokens.weight[...]).copy()
    report = rotate_model(model, seed=1)
    assert not np.allclose(embed0, np.asarray(model.embed_tokens.weight[...]))  # it did rotate
    assert np.all(np.asarray(model.layers[0].input_layernorm.weight[...]) == 1)  # γ folded into the readers
    assert report["head_layers"] == ([] if arch == "deepseek_v3" else [0, 1])  # R2: GQA only
    assert rel_err(ours(model), before) <= 1e-4


def _input_spread(model, name: str) -> float:
    """max / median over channels of max |x| of a Linear's calibration input (layer 0)."""
    units = [u for u in quant_units(model) if u.layer == 0]
    x = [model.embed_tokens(jnp.asarray(IDS))]
    seg = [jnp.ones(IDS.shape, jnp.int32)]
    amax = collect_stats(model, x, seg, 0, units)[name].abs_max
    return float(amax.max() / np.median(amax))


def test_rotation_spreads_planted_outlier_channels(checkpoint):
    model = from_pretrained(checkpoint("llama"))
    plant_outlier_channels(model, n=2, factor=30.0)
    q_proj = "model.layers.0.self_attn.q_proj"
    planted = _input_spread(model, q_proj)
    rotate_model(model, seed=0)
    rotated = _input_spread(model, q_proj)
    print(f"q_proj input max/median over channels: planted {planted:.1f}, rotated {rotated:.1f}")
    assert planted > 10 and rotated < planted / 4


def test_rotation_refusals(checkpoint, tmp_path):
    cfg = CONFIGS["llama"]()
    cfg.tie_word_embeddings = True
    build_from_config(cfg, seed=0).save_pretrained(str(tmp_path))
    with pytest.raises(ValueError, match="ties its LM head"):
        rotate_model(from_pretrained(str(tmp_path)))
    model = from_pretrained(checkpoint("llama"))
    quantize_model(model, parse_scheme("int8"), [])
    with pytest.raises(ValueError, match="is quantized or has a LoRA adapter"):
        rotate_model(model)
    with pytest.raises(ValueError, match="rotate must be null, 'hadamard' or 'hadamard-block'"):
        Options(rotate="random")


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_rotated_w4a4_export_reloads_to_the_same_model(checkpoint, tmp_path, arch):
    model = from_pretrained(checkpoint(arch))
    calib = [(np.random.default_rng(1).integers(0, V, (2, 32)).astype(np.int32), np.ones((2, 32), np.int32))]
    report = quantize_model(model, parse_scheme("nvfp4"), calib, opts=Options(rotate="hadamard"))
    assert report["rotation"]["residual"] == "R1"
    save_pretrained(model, str(tmp_path))
    mine = ours(model)
    np.testing.assert_array_equal(ours(from_pretrained(str(tmp_path))), mine)
    float_model = from_pretrained(checkpoint(arch))
    assert rel_err(mine, ours(float_model)) > 1e-3  # W4A4 moved it; the rotation alone would not
