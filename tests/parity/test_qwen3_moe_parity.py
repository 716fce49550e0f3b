"""Qwen3-MoE parity with transformers 5.24 (fp32, eager attention, highest matmul precision).

Each variant is a tiny random `Qwen3MoeForCausalLM` (D 64, 4 / 2 heads of 32 ≠ D/N, 8 experts of
32, top-2, 3 layers mixing dense and sparse FFNs) with every norm and bias perturbed, saved with
transformers and loaded with our `from_pretrained`; logits must agree to 1e-4 relative error
(docs/models/qwen3-moe.md). Covers: decoder_sparse_step and mlp_only_layers, norm_topk_prob true and
false, q/k/v/o biases, tied embeddings, YaRN that matters at the test length (factor 4, original 16),
the sliding window, a left-padded batch, decode through the KV cache, our save loaded by transformers,
the grouped expert dispatch against the dense reference, and the legacy config.json spelling.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from parity_helpers import build_from_config, decode_logits, hf_logits, left_padded_rel_err, rel_err

from models import from_pretrained, jit_forward, save_pretrained
from models.moe import MoE
from models.qwen3_moe import Qwen3MoeConfig

pytestmark = pytest.mark.parity
V = 160
TINY = dict(vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
            rms_norm_eps=1e-5, max_position_embeddings=256)
VARIANTS = {
    # layers: dense, MoE, dense
    "sparse_step": dict(decoder_sparse_step=2, norm_topk_prob=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # layers: MoE, dense, MoE; biases on q/k/v/o, tied head, no renormalisation
    "mlp_only": dict(mlp_only_layers=[1], norm_topk_prob=False, attention_bias=True, tie_word_embeddings=True),
    # YaRN whose correction range matters beyond 16 tokens
    "yarn": dict(mlp_only_layers=[0], norm_topk_prob=True, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 16}),
    # every layer slides over 6 keys (transformers 5.24 qwen3_moe ignores max_window_layers)
    "sliding": dict(mlp_only_layers=[2], norm_topk_prob=True, use_sliding_window=True, sliding_window=6),
}
RNG = np.random.default_rng(0)


def random_ids(b: int, t: int) -> np.ndarray:
    return RNG.integers(0, V, size=(b, t)).astype(np.int32)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """variant -> (hf_model, path, our_model), built once per module."""
    cache: dict[str, tuple] = {}

    def make(variant: str):
        if variant not in cache:
            hf = build_from_config(transformers.Qwen3MoeConfig(**TINY, **VARIANTS[variant]),
                                   seed=sorted(VARIANTS).index(variant))
            path = tmp_path_factory.mktemp(f"qwen3_moe_{variant}")
            hf.save_pretrained(path)
            cache[variant] = hf, str(path), from_pretrained(str(path))
        return cache[variant]

    return make


# ------------------------------------------------------------------------------------------------
# Logits
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(checkpoint, variant):
    hf, _, model = checkpoint(variant)
    sparse = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    assert [isinstance(layer.mlp, MoE) for layer in model.layers] == sparse
    assert any(sparse) and not all(sparse)  # dense and sparse layers both appear
    assert model.config.head_dim == 32 != model.config.hidden_size // model.config.num_attention_heads
    assert model.config.norm_topk_prob == VARIANTS[variant]["norm_topk_prob"]
    ids = random_ids(2, 40)
    err = rel_err(jit_forward(model)(jnp.asarray(ids)), hf_logits(hf, ids))
    print(f"qwen3_moe {variant}: logits rel err {err:.2e}")
    assert err <= 1e-4


@pytest.mark.parametrize("variant", ["yarn", "sliding"])
def test_left_padded_batch_matches_transformers(checkpoint, variant):
    hf, _, model = checkpoint(variant)
    err = left_padded_rel_err(model, hf, random_ids(3, 20), [0, 7, 2])  # rows 1 and 2 are left-padded
    print(f"qwen3_moe {variant}: left-padded rel err {err:.2e}")
    assert err <= 1e-4


@pytest.mark.parametrize("variant", ["mlp_only", "sliding"])
def test_decode_through_kv_cache_equals_forward(checkpoint, variant):
    _, _, model = checkpoint(variant)
    fwd = jit_forward(model)
    ids = random_ids(2, 18)
    full = np.asarray(fwd(jnp.asarray(ids)))
    err = rel_err(decode_logits(model, ids, split=7), full)
    print(f"qwen3_moe {variant}: decode-vs-forward rel err {err:.2e}")
    assert err <= 1e-4


# ------------------------------------------------------------------------------------------------
# Checkpoints and config.json
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["yarn", "mlp_only"])
def test_our_save_loads_in_transformers(checkpoint, tmp_path, variant):
    hf, _, model = checkpoint(variant)
    out = tmp_path / "ours"
    save_pretrained(model, str(out), max_shard_bytes=150_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    names = set(index["weight_map"])
    assert len(set(index["weight_map"].values())) > 1
    for i in range(3):  # per-expert tensors on sparse layers, a dense SwiGLU elsewhere
        sparse = model.config.is_moe_layer(i)
        assert (f"model.layers.{i}.mlp.experts.7.down_proj.weight" in names) == sparse
        assert (f"model.layers.{i}.mlp.gate.weight" in names) == sparse
        assert (f"model.layers.{i}.mlp.down_proj.weight" in names) != sparse
    assert ("lm_head.weight" in names) != model.config.tie_word_embeddings
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"
    ids = random_ids(2, 24)
    np.testing.assert_array_equal(hf_logits(reloaded, ids), hf_logits(hf, ids))  # weights round-trip exactly
    err = rel_err(jit_forward(model)(jnp.asarray(ids)), hf_logits(reloaded, ids))
    print(f"qwen3_moe {variant}: our save -> transformers rel err {err:.2e}")
    assert err <= 1e-4
    assert from_pretrained(str(out)).config == model.config


def test_legacy_config_spelling_loads_the_same_model(checkpoint, tmp_path):
    hf, path, model = checkpoint("yarn")
    legacy = json.loads(open(os.path.join(path, "config.json")).read())
    rope = legacy.pop("rope_parameters")
    legacy["rope_theta"] = rope.pop("rope_theta")
    legacy["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    legacy["num_experts"] = legacy.pop("num_local_experts")
    legacy["torch_dtype"] = legacy.pop("dtype")
    assert Qwen3MoeConfig.from_hf(legacy) == model.config
    for fn in os.listdir(path):
        if fn != "config.json":
            os.symlink(os.path.join(path, fn), tmp_path / fn)
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    ids = random_ids(1, 30)
    ref = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager"), ids)
    np.testing.assert_array_equal(ref, hf_logits(hf, ids))  # transformers reads the legacy spelling the same way
    assert rel_err(jit_forward(from_pretrained(str(tmp_path)))(jnp.asarray(ids)), ref) <= 1e-4


def test_config_fields_presets_and_round_trip():
    d = Qwen3MoeConfig.tiny().to_hf()
    hf_cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert hf_cfg.num_experts == 8 and hf_cfg.head_dim == 32 and hf_cfg.mlp_only_layers == [1]
    assert Qwen3MoeConfig.from_hf(d) == Qwen3MoeConfig.tiny()
    a3b = Qwen3MoeConfig.qwen3_30b_a3b()
    assert (a3b.num_hidden_layers, a3b.hidden_size, a3b.head_dim, a3b.num_experts, a3b.moe_intermediate_size) == \
        (48, 2048, 128, 128, 768) and a3b.norm_topk_prob
    big = Qwen3MoeConfig.qwen3_235b_a22b()
    assert (big.num_hidden_layers, big.hidden_size, big.num_attention_heads, big.num_key_value_heads, big.head_dim,
            big.num_experts, big.num_experts_per_tok, big.moe_intermediate_size, big.vocab_size) == \
        (94, 4096, 64, 4, 128, 128, 8, 1536, 151936)
    assert all(big.is_moe_layer(i) for i in range(94))
    # head_dim and norm_topk_prob are read, never the class defaults
    published = {**a3b.to_hf(), "num_experts": 128}
    published.pop("num_local_experts")
    got = Qwen3MoeConfig.from_hf(published)
    assert got.head_dim == 128 and got.norm_topk_prob and got.num_experts == 128
    assert Qwen3MoeConfig.from_hf({k: v for k, v in published.items() if k != "head_dim"}).head_dim == 64
    cfg = Qwen3MoeConfig.tiny(decoder_sparse_step=2, mlp_only_layers=())
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, False]
    with pytest.raises(NotImplementedError, match="longrope"):
        Qwen3MoeConfig.from_hf({**d, "rope_parameters": {"rope_type": "longrope", "factor": 4.0}})
