"""GLM-5 parity with transformers 5.25 `GlmMoeDsaForCausalLM` (fp32, eager attention, highest matmul precision):
DeepSeek-V3.2's MLA + DSA with the indexer's interleaved RoPE and cross-layer top-k sharing ("shared" layers have
no indexer and attend to the last full layer's selection), on sequences longer than `index_topk` (the selection
drops keys), a dense and three MoE layers, YaRN, left padding, the KV cache (decode and `generate` equal the full
forward), our save -> transformers load, and the config spellings (docs/models/glm-moe-dsa.md).

Tiny config: hidden 64, 4 heads, q_lora 32, kv_lora 16, nope 16, rope 8, v 16, 8 experts of 32 (top-2, 4 groups
keep 2), 4 layers (1 dense) with indexer_types full, shared, full, shared, an indexer of 8 heads × 16 dims keeping
the top 6 keys; sequences of 20 tokens.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from flax import nnx
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
from models.glm_moe_dsa import GlmDSAttention, GlmMoeDsa, GlmMoeDsaConfig
from models.hf import from_pretrained, save_pretrained
from models.layers import MLP
from models.moe import MoE
from models.quant.rotation import refuse_indexer

pytestmark = pytest.mark.parity
V, TOPK = 128, 6
TYPES = ["full", "shared", "full", "shared"]
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.8, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
TINY = dict(vocab_size=V, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
            first_k_dense_replace=1, max_position_embeddings=128, rms_norm_eps=1e-5, rope_parameters=YARN,
            index_topk=TOPK, index_head_dim=16, index_n_heads=8, indexer_types=TYPES)
IDS = np.random.default_rng(0).integers(0, V, (2, 20)).astype(np.int32)  # 20 > index_topk


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(transformers model, its folder, our model loaded from it, transformers' logits on IDS)."""
    hf = build_from_config(transformers.GlmMoeDsaConfig(**TINY), seed=0)
    path = tmp_path_factory.mktemp("glm5")
    hf.save_pretrained(path)
    return hf, path, from_pretrained(str(path)), hf_logits(hf, IDS)


def test_logits_match_transformers_with_shared_selections(ckpt, tmp_path):
    hf, path, ours, ref = ckpt
    assert isinstance(ours, GlmMoeDsa) and all(isinstance(l.self_attn, GlmDSAttention) for l in ours.layers)
    assert [type(l.mlp) for l in ours.layers] == [MLP, MoE, MoE, MoE]
    assert [hasattr(l.self_attn, "indexer") for l in ours.layers] == [t == "full" for t in TYPES]
    err = rel_err(jit_forward(ours)(jnp.asarray(IDS)), ref)
    print(f"GLM-5 fp32 logits vs transformers: max rel err {err:.2e}")
    assert err <= 1e-5
    assert left_padded_rel_err(ours, hf, IDS, [0, 5]) <= 1e-5
    # every key kept (index_topk >= the length): other logits, on both sides -- the selection drops keys
    dense_path = with_config(path, tmp_path / "dense", index_topk=IDS.shape[1])
    dense = np.asarray(jit_forward(from_pretrained(dense_path))(jnp.asarray(IDS)))
    assert rel_err(dense, hf_reload_logits(dense_path, IDS)) <= 1e-5
    assert rel_err(dense[:, :TOPK], ref[:, :TOPK]) <= 1e-5  # the first index_topk queries see every key anyway
    assert rel_err(dense, ref) > 1e-3
    # layer 2 shares layer 0's selection instead of running its indexer: other logits, again at parity
    shared_path = with_config(path, tmp_path / "fsss", drop_prefix="model.layers.2.self_attn.indexer.",
                              indexer_types=["full", "shared", "shared", "shared"])
    fsss = np.asarray(jit_forward(from_pretrained(shared_path))(jnp.asarray(IDS)))
    assert rel_err(fsss, hf_reload_logits(shared_path, IDS)) <= 1e-5
    assert rel_err(fsss, ref) > 1e-3


def test_save_has_transformers_tensors_and_loads_back(ckpt, tmp_path):
    hf, path, ours, ref = ckpt
    save_pretrained(ours, str(tmp_path / "ours"))
    theirs, mine = load_file(path / "model.safetensors"), load_file(tmp_path / "ours" / "model.safetensors")
    assert "model.layers.2.self_attn.indexer.k_norm.bias" in theirs
    assert not any(k.startswith(("model.layers.1.self_attn.indexer", "model.layers.3.self_attn.indexer"))
                   for k in theirs)  # shared layers hold no indexer
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in theirs.items()}
    for key, value in theirs.items():
        assert mine[key].dtype == value.dtype and np.array_equal(mine[key], value), key
    assert rel_err(hf_reload_logits(str(tmp_path / "ours"), IDS), ref) <= 1e-5
    assert from_pretrained(str(tmp_path / "ours")).config == ours.config


def test_cached_decoding_and_generate_equal_the_full_forward(ckpt):
    """Prefill 4 tokens, then one token at a time past index_topk: full layers score the cached indexer keys,
    shared layers reuse their selection. `generate` (greedy, one row left-padded) emits the full forward's argmax
    at every step."""
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
    assert c.indexer_types == tuple(TYPES)
    assert GlmMoeDsaConfig.from_hf(c.to_hf()) == c
    back = transformers.GlmMoeDsaConfig(**c.to_hf())  # transformers builds the same model from our to_hf
    for key in ("index_topk", "index_head_dim", "index_n_heads", "mlp_layer_types", "indexer_types", "q_lora_rank"):
        assert getattr(back, key) == getattr(transformers.GlmMoeDsaConfig(**TINY), key), key
    # the pattern spellings transformers folds: a letter string, a list, the freq / offset schedule
    d = {k: v for k, v in c.to_hf().items() if k != "indexer_types"}
    for spelling in ({"index_topk_pattern": "FSFS"}, {"index_topk_pattern": TYPES},
                     {"index_topk_freq": 2, "index_skip_topk_offset": 1}):
        assert transformers.GlmMoeDsaConfig(**d, **spelling).indexer_types == TYPES, spelling
        assert GlmMoeDsaConfig.from_hf({**d, **spelling}) == c, spelling
    every = {"index_topk_freq": 3, "index_skip_topk_offset": 2}  # full, full, shared, shared
    assert GlmMoeDsaConfig.from_hf({**d, **every}).indexer_types == tuple(
        transformers.GlmMoeDsaConfig(**d, **every).indexer_types)
    assert GlmMoeDsaConfig.from_hf(d).indexer_types is None  # absent: every layer full, as transformers
    assert transformers.GlmMoeDsaConfig(**d).indexer_types == ["full"] * 4
    # the legacy spelling: rope_theta + rope_scaling {type: yarn}, torch_dtype, routing keys, no derived fields
    rope = dict(YARN)
    legacy = with_config(path, tmp_path / "legacy", rope_parameters=None, mlp_layer_types=None, layer_types=None,
                         head_dim=None, qk_head_dim=None, dtype=None, torch_dtype="float32", indexer_types=None,
                         index_topk_pattern="FSFS", rope_theta=rope.pop("rope_theta"),
                         rope_scaling={"type": rope.pop("rope_type"), **rope}, topk_method="noaux_tc",
                         scoring_func="sigmoid", num_nextn_predict_layers=1)
    assert from_pretrained(legacy).config == dataclasses.replace(c, num_nextn_predict_layers=1)  # none in the files
    assert rel_err(hf_reload_logits(legacy, IDS), ref) <= 1e-5
    alias = {k: v for k, v in c.to_hf().items() if k != "n_routed_experts"}
    assert GlmMoeDsaConfig.from_hf({**alias, "num_experts": 8}) == c
    # refusals: one line each, naming the field
    for bad, match in ((dict(indexer_types=("shared", "full", "full", "full")), "layer 0 is 'shared'"),
                       (dict(indexer_types=("full", "half", "full", "full")), "indexer_types"),
                       (dict(indexer_types=("full",)), "indexer_types"), (dict(q_lora_rank=None), "q_lora_rank"),
                       (dict(index_head_dim=4), "index_head_dim 4")):
        with pytest.raises(ValueError, match=match) as e:
            dataclasses.replace(c, **bad)
        assert "\n" not in str(e.value)
    for bad, match in (({"index_topk_pattern": "FXFS"}, "index_topk_pattern"), ({"q_lora_rank": None}, "q_lora_rank"),
                       ({"architectures": ["DeepseekV32ForCausalLM"]}, "architectures"),
                       ({"index_topk_freq": "2"}, "index_topk_freq")):
        with pytest.raises(ValueError, match=match) as e:
            GlmMoeDsaConfig.from_hf({**d, **bad})
        assert "\n" not in str(e.value)
    with pytest.raises(NotImplementedError, match="rope_interleave"):
        GlmMoeDsaConfig.from_hf({**d, "rope_interleave": False})
    tiny = GlmMoeDsaConfig.tiny()
    model = GlmMoeDsa(tiny, rngs=nnx.Rngs(0))
    assert tiny.index_topk < 20 and tiny.is_shared_indexer(1) and model.config is tiny
    indexer = model.layers[2].self_attn.indexer  # layers 1 and 2 are MoE: they differ by layer 2's projections
    weights = sum(lin.weight().size for lin in (indexer.wq_b, indexer.wk, indexer.weights_proj))
    flops = tiny.layer_flops()
    assert flops[2].matmul_params - flops[1].matmul_params == weights
    assert GlmMoeDsaConfig.glm5().to_hf()["model_type"] == "glm_moe_dsa"


def test_quantization_transforms_that_miss_the_indexer_refuse(ckpt):
    """AWQ / SmoothQuant / rotations refuse a GLM-5 model (models/quant/rotation.py refuse_indexer), shared layers
    (no indexer of their own) included."""
    from models import quant

    model = from_pretrained(str(ckpt[1]))
    with pytest.raises(NotImplementedError, match="DSA indexer"):
        refuse_indexer(model.layers[1].self_attn, "rotate")  # a shared layer
    ids = np.random.default_rng(0).integers(0, V, (1, 16)).astype(np.int32)
    with pytest.raises(NotImplementedError, match="DSA indexer"):
        quant.quantize_model(model, quant.parse_scheme("w4a16-awq-g16"), [(ids, np.ones_like(ids))])
