"""DeepSeek-V3.2 parity with transformers 5.25 `DeepseekV32ForCausalLM` (fp32, eager attention, highest matmul
precision): MLA + the DSA lightning indexer on sequences longer than `index_topk` (so the top-k selection drops
keys), a dense and two MoE layers, YaRN with mscale != mscale_all_dim (the indexer's RoPE tables are scaled too),
left padding, the KV cache holding the indexer keys (decode and `generate` equal the full forward), our save ->
transformers load, and the config spellings (docs/models/deepseek-v32.md).

Tiny config: hidden 64, 4 heads, q_lora 32, kv_lora 16, nope 16, rope 8, v 16, 8 experts of 32 (top-2, 4 groups
keep 2), 3 layers (1 dense), an indexer of 8 heads × 16 dims keeping the top 6 keys; sequences of 20 tokens.
With 4 indexer heads, keys whose every head score is relu'd to 0 tie exactly at the top-k boundary often enough
that torch's and XLA's (unspecified) tie orders keep different keys.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from parity_helpers import (
    assert_generate_is_the_forwards_argmax,
    build_from_config,
    decode_logits,
    hf_logits,
    hf_reload_logits,
    left_padded_rel_err,
    rel_err,
    with_config,
)
from safetensors.numpy import load_file

from models import generate, jit_forward
from models.deepseek_v32 import DeepseekV32, DeepseekV32Config, DSAttention
from models.hf import from_pretrained, save_pretrained
from models.layers import MLP
from models.moe import MoE

pytestmark = pytest.mark.parity
V, TOPK = 128, 6
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.8, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
TINY = dict(vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
            first_k_dense_replace=1, max_position_embeddings=128, rms_norm_eps=1e-5, rope_parameters=YARN,
            index_topk=TOPK, index_head_dim=16, index_n_heads=8)
IDS = np.random.default_rng(0).integers(0, V, (2, 20)).astype(np.int32)  # 20 > index_topk


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(transformers model, its folder, our model loaded from it, transformers' logits on IDS)."""
    hf = build_from_config(transformers.DeepseekV32Config(**TINY), seed=0)
    path = tmp_path_factory.mktemp("dsv32")
    hf.save_pretrained(path)
    return hf, path, from_pretrained(str(path)), hf_logits(hf, IDS)


def test_logits_match_transformers_and_the_selection_drops_keys(ckpt, tmp_path):
    hf, path, ours, ref = ckpt
    assert isinstance(ours, DeepseekV32) and all(isinstance(l.self_attn, DSAttention) for l in ours.layers)
    assert [type(l.mlp) for l in ours.layers] == [MLP, MoE, MoE]
    err = rel_err(jit_forward(ours)(jnp.asarray(IDS)), ref)
    print(f"DeepSeek-V3.2 fp32 logits vs transformers: max rel err {err:.2e}")
    assert err <= 1e-5
    assert left_padded_rel_err(ours, hf, IDS, [0, 5]) <= 1e-5
    # the same weights with every key kept (index_topk >= the length): other logits, on both sides
    dense_path = with_config(path, tmp_path / "dense", index_topk=IDS.shape[1])
    dense = np.asarray(jit_forward(from_pretrained(dense_path))(jnp.asarray(IDS)))
    assert rel_err(dense, hf_reload_logits(dense_path, IDS)) <= 1e-5
    assert rel_err(dense[:, :TOPK], ref[:, :TOPK]) <= 1e-5  # the first index_topk queries see every key anyway
    assert rel_err(dense, ref) > 1e-3


def test_save_has_transformers_tensors_and_loads_back(ckpt, tmp_path):
    hf, path, ours, ref = ckpt
    save_pretrained(ours, str(tmp_path / "ours"))
    theirs, mine = load_file(path / "model.safetensors"), load_file(tmp_path / "ours" / "model.safetensors")
    assert "model.layers.2.self_attn.indexer.k_norm.bias" in theirs
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in theirs.items()}
    for key, value in theirs.items():
        assert mine[key].dtype == value.dtype and np.array_equal(mine[key], value), key
    assert rel_err(hf_reload_logits(str(tmp_path / "ours"), IDS), ref) <= 1e-5
    assert from_pretrained(str(tmp_path / "ours")).config == ours.config


def test_cached_decoding_and_generate_equal_the_full_forward(ckpt):
    """Prefill 4 tokens, then one token at a time past index_topk: the cache's indexer keys are what the
    selection scores. `generate` (greedy, one row left-padded) emits the full forward's argmax at every step."""
    _, _, ours, ref = ckpt
    assert rel_err(decode_logits(ours, IDS, split=4), ref) <= 1e-5
    prompt = IDS[:, :4].copy()
    prompt[1, :1] = 0  # row 1: a 3-token prompt, left-padded
    lengths = np.array([4, 3], np.int32)
    out = generate(ours, jnp.asarray(prompt), prompt_lengths=jnp.asarray(lengths), max_new_tokens=12)
    assert_generate_is_the_forwards_argmax(ours, prompt, lengths, np.asarray(out.tokens), longer_than=TOPK)


def test_config_spellings_and_refusals(ckpt, tmp_path):
    _, path, ours, ref = ckpt
    c = ours.config
    assert DeepseekV32Config.from_hf(c.to_hf()) == c
    back = transformers.DeepseekV32Config(**c.to_hf())  # transformers builds the same model from our to_hf
    for key in ("index_topk", "index_head_dim", "index_n_heads", "mlp_layer_types", "q_lora_rank"):
        assert getattr(back, key) == getattr(transformers.DeepseekV32Config(**TINY), key), key
    # the Hub spelling: rope_theta + rope_scaling {type: yarn}, torch_dtype, routing keys, no derived fields
    rope = dict(YARN)
    legacy = with_config(path, tmp_path / "legacy", rope_parameters=None, mlp_layer_types=None, layer_types=None,
                         head_dim=None, qk_head_dim=None, dtype=None, torch_dtype="float32",
                         rope_theta=rope.pop("rope_theta"), rope_scaling={"type": rope.pop("rope_type"), **rope},
                         topk_method="noaux_tc", scoring_func="sigmoid", num_nextn_predict_layers=1, moe_layer_freq=1)
    assert from_pretrained(legacy).config == dataclasses.replace(c, num_nextn_predict_layers=1)  # none in the files
    assert rel_err(hf_reload_logits(legacy, IDS), ref) <= 1e-5
    alias = {k: v for k, v in c.to_hf().items() if k != "n_routed_experts"}
    assert DeepseekV32Config.from_hf({**alias, "num_experts": 8}) == c
    types = ("dense", "sparse", "dense")
    odd = DeepseekV32Config.from_hf({**c.to_hf(), "mlp_layer_types": list(types)})
    assert [odd.is_moe_layer(i) for i in range(3)] == [False, True, False]
    assert transformers.DeepseekV32Config(**odd.to_hf()).mlp_layer_types == list(types)
    assert odd.kv_cache_dims() == ((1, 16), (1, 8 + 16))
    for bad, match in ((dict(q_lora_rank=None), "q_lora_rank"), (dict(rope_interleave=False), "rope_interleave"),
                       (dict(index_head_dim=4), "index_head_dim 4"), (dict(mlp_layer_types=("dense",)), "mlp_layer_t")):
        with pytest.raises((ValueError, NotImplementedError), match=match):
            dataclasses.replace(c, **bad)
    with pytest.raises(ValueError, match="q_lora_rank null"):
        DeepseekV32Config.from_hf({**c.to_hf(), "q_lora_rank": None})
    tiny = DeepseekV32Config.tiny()
    assert tiny.index_topk < 20 and DeepseekV32(tiny, rngs=__import__("flax").nnx.Rngs(0)).config is tiny
    assert DeepseekV32Config.deepseek_v32_exp().to_hf()["model_type"] == "deepseek_v32"


@pytest.mark.parametrize("scheme, opts", [("w4a16-awq-g16", {}), ("int8-w8a8", {}), ("int8", {"rotate": "hadamard"})])
def test_quantization_transforms_that_miss_the_indexer_refuse(ckpt, scheme, opts):
    """AWQ, SmoothQuant and rotations fold scales or rotations into every Linear that reads a norm's output; the
    indexer's wk / weights_proj (the normed input) and wq_b (the q latent) are not among them yet, so these
    transforms refuse a DeepSeek-V3.2 model rather than change it silently."""
    from models import quant

    model = from_pretrained(str(ckpt[1]))
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, 16)).astype(np.int32)
    with pytest.raises(NotImplementedError, match="DSA indexer"):
        quant.quantize_model(model, quant.parse_scheme(scheme), [(ids, np.ones_like(ids))],
                             opts=quant.Options(**opts))
