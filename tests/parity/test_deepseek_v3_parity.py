"""DeepSeek-V3 / Kimi K2 parity with transformers 5.24 `DeepseekV3ForCausalLM` (fp32, eager attention, highest
matmul precision): MLA with and without q_lora, interleaved RoPE, YaRN with mscale / mscale_all_dim,
group-limited sigmoid routing, shared experts, dense first layer, left padding, the absorbed-MLA KV cache
(which must hold the latent), our save -> transformers load, an MTP layer against transformers' own
`MtpModel`, FP8 block checkpoints, and the config spellings / presets (docs/models/deepseek-v3.md).

Tiny configs: hidden 64, 4 heads (= kv heads: transformers' MLA needs it), q_lora 32, kv_lora 16, nope 16,
rope 8, v 16, 8 experts of 32, top-2, dense F 160 (> 128, so FP8 has an edge tile), 3 layers (1 dense),
vocab 128, rms_norm_eps 1e-5 (so that the latent norms' fixed 1e-6 matters).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
import transformers
from flax import nnx
from parity_helpers import build_from_config, decode_logits, hf_logits, rel_err

from models import KVCache, from_pretrained, jit_forward, save_pretrained
from models.deepseek_v3 import DeepseekV3, DeepseekV3Config

pytestmark = pytest.mark.parity
RNG = np.random.default_rng(0)
V = 128
TINY = dict(vocab_size=V, hidden_size=64, intermediate_size=160, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
            qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
            topk_group=2, first_k_dense_replace=1, max_position_embeddings=128, rms_norm_eps=1e-5)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 0.8, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}  # cos/sin × 0.97, scale × 1.30
KIMI_YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 32,
             "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 1, "beta_slow": 1}
VARIANTS = {
    # q_lora, group-limited routing (4 groups, keep 2), default RoPE
    "grouped": {},
    # q_proj instead of q_a/q_b, attention biases, 2 shared experts, 2 groups keep 1
    "no_q_lora": dict(q_lora_rank=None, attention_bias=True, n_shared_experts=2, n_group=2, topk_group=1),
    # YaRN ×4 from 32 positions (the test lengths go past it), mscale 0.8 != mscale_all_dim 1.0
    "yarn": dict(rope_parameters=YARN),
    # Kimi-K2-like: no group routing, scaling 2.827, theta 5e4, beta_fast = beta_slow = 1; saved with
    # model_type kimi_k2 in the legacy (Hub) spelling
    "kimi": dict(n_group=1, topk_group=1, routed_scaling_factor=2.827, rope_parameters=KIMI_YARN),
}


def hf_config(variant: str, **extra) -> transformers.DeepseekV3Config:
    return transformers.DeepseekV3Config(**{**TINY, **VARIANTS[variant], **extra})


def legacy_kimi_config(path) -> None:
    """Rewrite a transformers-5 config.json as Kimi K2 ships it: model_type kimi_k2, rope_theta + rope_scaling
    {type: yarn}, torch_dtype, topk_method / scoring_func, no derived fields."""
    d = json.loads((path / "config.json").read_text())
    rope = d.pop("rope_parameters")
    d["rope_theta"] = rope.pop("rope_theta")
    d["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    d["torch_dtype"] = d.pop("dtype")
    for k in ("qk_head_dim", "head_dim"):
        d.pop(k)
    d.update(model_type="kimi_k2", topk_method="noaux_tc", scoring_func="sigmoid", num_nextn_predict_layers=0,
             moe_layer_freq=1, auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    (path / "config.json").write_text(json.dumps(d))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant -> (transformers model, saved folder, our loaded model); built once per module."""
    cache = {}

    def get(variant: str):
        if variant not in cache:
            hf = build_from_config(hf_config(variant), seed=len(cache))
            path = tmp_path_factory.mktemp(variant)
            hf.save_pretrained(path)
            if variant == "kimi":
                legacy_kimi_config(path)
            cache[variant] = hf, path, from_pretrained(str(path))
        return cache[variant]

    return get


# -- jitted entry points shared by every model with the same graph (equal configs compile once) ----


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, ids, positions, segment_ids):
    return nnx.merge(graphdef, state)(ids, positions=positions, segment_ids=segment_ids)


def forward(model, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Logits [B, T, V]; `mask` marks real tokens (left padding: positions = cumsum(mask) - 1, clipped)."""
    mask = np.ones_like(ids) if mask is None else mask
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    graphdef, state = nnx.split(model)
    return np.asarray(_forward(graphdef, state, jnp.asarray(ids), jnp.asarray(positions), jnp.asarray(mask)))


def _cached(graphdef, state, ids, cache):
    return nnx.merge(graphdef, state)(ids, cache=cache)


class Jitted:
    """What parity_helpers.decode_logits needs from a model (config, dtype, __call__), jitted."""

    model: DeepseekV3

    @property
    def config(self):
        return self.model.config

    @property
    def dtype(self):
        return self.model.dtype

    def __call__(self, ids, cache):
        graphdef, state = nnx.split(self.model)
        return _cached(graphdef, state, ids, cache)


@functools.partial(jax.jit, static_argnums=0)
def _mtp(graphdef, state, ids, hidden):
    return nnx.merge(graphdef, state).mtp_logits(ids, hidden)


@functools.partial(jax.jit, static_argnums=0)
def _final_hidden(graphdef, state, ids):
    return nnx.merge(graphdef, state)(ids, return_hidden=(-1,))[1][0]


def random_ids(b: int, t: int) -> np.ndarray:
    return RNG.integers(0, V, size=(b, t)).astype(np.int32)


# ------------------------------------------------------------------------------------------------
# Logits
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(checkpoints, variant):
    hf, _, model = checkpoints(variant)
    c = model.config
    assert (c.q_lora_rank is None) == (variant == "no_q_lora")
    assert c.model_type == ("kimi_k2" if variant == "kimi" else "deepseek_v3")
    assert c.num_mtp_layers == 0 and c.num_nextn_predict_layers == (0 if variant == "kimi" else 1)
    assert c.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    if variant == "yarn":  # both halves of the YaRN temperature are in play
        assert hf.model.rotary_emb.attention_scaling != 1.0 and c.softmax_scale > c.qk_head_dim**-0.5
    ids = random_ids(2, 48)
    err = rel_err(forward(model, ids), hf_logits(hf, ids))
    print(f"{variant}: logits rel err {err:.2e}")
    assert err <= 1e-4


def test_left_padded_batch_matches_transformers(checkpoints):
    hf, _, model = checkpoints("yarn")
    ids = random_ids(2, 48)
    mask = np.ones_like(ids)
    mask[1, :9] = 0  # row 1 is left-padded
    ref = hf_logits(hf, ids, mask)
    err = rel_err(forward(model, ids, mask)[mask == 1], ref[mask == 1])
    print(f"left-padded: rel err {err:.2e}")
    assert err <= 1e-4


@pytest.mark.parametrize("variant", ["grouped", "no_q_lora"])
def test_router_picks_transformers_experts(checkpoints, variant):
    """Router indices as exact sets and weights, on hidden states where the group limit changes the pick."""
    hf, _, model = checkpoints(variant)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, ref_w, ref_idx = hf.model.layers[1].mlp.gate(x)
    w, idx, _ = model.layers[1].mlp.gate(jnp.asarray(x.numpy()))
    ref_idx, ref_w = ref_idx.numpy(), ref_w.numpy()
    order, ref_order = np.argsort(np.asarray(idx), 1), np.argsort(ref_idx, 1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, 1),
                                  np.take_along_axis(ref_idx, ref_order, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, 1),
                               np.take_along_axis(ref_w, ref_order, 1), rtol=1e-5, atol=1e-7)
    gate = model.layers[1].mlp.gate
    biased = jax.nn.sigmoid(jnp.asarray(x.numpy()) @ gate.weight[...].T) + gate.e_score_correction_bias[...]
    unrestricted = np.sort(np.asarray(jax.lax.top_k(biased, 2)[1]), 1)
    assert len({tuple(r) for r in np.sort(ref_idx, 1)}) >= 8  # tokens go to many different expert pairs
    assert np.any(unrestricted != np.sort(ref_idx, 1))  # the group limit really excludes experts


# ------------------------------------------------------------------------------------------------
# KV cache: absorbed MLA over the cached latent
# ------------------------------------------------------------------------------------------------


def test_cache_holds_the_latent():
    c = DeepseekV3Config.tiny()
    cache = KVCache.init(c, 2, 16)
    assert cache.k.shape == (3, 2, 1, 16, c.kv_lora_rank)  # [L, B, 1, S, C]
    assert cache.v.shape == (3, 2, 1, 16, c.qk_rope_head_dim)  # [L, B, 1, S, R]
    assert DeepseekV3Config.deepseek_v3().kv_cache_dims() == ((1, 512), (1, 64))  # 576 values per token


@pytest.mark.parametrize("variant", ["no_q_lora", "yarn"])
def test_decode_through_latent_cache_equals_forward(checkpoints, variant):
    hf, _, model = checkpoints(variant)
    ids, split = random_ids(2, 40), 30
    full = forward(model, ids)
    decoded = decode_logits(model, ids, split)
    err_fwd, err_hf = rel_err(decoded, full), rel_err(decoded, hf_logits(hf, ids))
    print(f"{variant}: decode vs forward {err_fwd:.2e}, decode vs transformers {err_hf:.2e}")
    assert err_fwd <= 1e-4 and err_hf <= 1e-4

    # the cache holds what transformers' own DynamicCache holds for MLA: the normalised latent and the
    # rotated (de-interleaved) shared rope key, one "head" each
    _, cache = jit_forward(model)(jnp.asarray(ids[:, :split]), cache=KVCache.init(model.config, 2, 40))
    assert cache.k.shape[-1] == model.config.kv_lora_rank and cache.k.shape[2] == 1
    with torch.no_grad():
        out = hf(torch.tensor(ids[:, :split], dtype=torch.long), use_cache=True)
    for i, layer in enumerate(out.cache.layers):
        k_ref, v_ref = layer.keys.numpy(), layer.values.numpy()  # [B, 1, T, C], [B, 1, T, R]
        assert k_ref.shape[-1] == model.config.kv_lora_rank
        assert rel_err(np.asarray(cache.k[i, :, :, :split]), k_ref) <= 1e-5
        assert rel_err(np.asarray(cache.v[i, :, :, :split]), v_ref) <= 1e-5


# ------------------------------------------------------------------------------------------------
# Our save -> transformers
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["grouped", "kimi"])
def test_our_save_loads_in_transformers(checkpoints, tmp_path, variant):
    hf, _, model = checkpoints(variant)
    save_pretrained(model, str(tmp_path))
    written = json.loads((tmp_path / "config.json").read_text())
    assert "quantization_config" not in written and written["model_type"] == "deepseek_v3"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager",
                                                                dtype=torch.float32).eval()
    assert type(reloaded).__name__ == "DeepseekV3ForCausalLM"
    ids = random_ids(2, 40)
    np.testing.assert_array_equal(hf_logits(reloaded, ids), hf_logits(hf, ids))  # weights round-trip exactly
    err = rel_err(forward(model, ids), hf_logits(reloaded, ids))
    print(f"{variant}: ours vs transformers-reloaded {err:.2e}")
    assert err <= 1e-4
    again = from_pretrained(str(tmp_path)).config
    assert again == dataclasses.replace(model.config, model_type="deepseek_v3", num_nextn_predict_layers=0)


# ------------------------------------------------------------------------------------------------
# MTP
# ------------------------------------------------------------------------------------------------


def test_mtp_layer_matches_transformers_mtp_model(tmp_path):
    """A checkpoint holding an MTP layer at model.layers.3 (transformers never writes one): the block comes
    from a 4-layer transformers model's layer 3, enorm / hnorm / eh_proj / shared_head.norm are random, the
    embedding / head copies are the main ones. Reference: transformers 5.24's own `MtpModel` (used by
    `generate(use_mtp=True)`) with those weights, fed the same hidden states."""
    from transformers.modeling_layers import MtpModel

    hf = build_from_config(hf_config("grouped"), seed=5)
    donor = build_from_config(hf_config("grouped", num_hidden_layers=4), seed=6)
    hf.save_pretrained(tmp_path / "base")
    donor.save_pretrained(tmp_path / "donor")
    tensors = safetensors.numpy.load_file(str(tmp_path / "base" / "model.safetensors"))
    donor_tensors = safetensors.numpy.load_file(str(tmp_path / "donor" / "model.safetensors"))
    g = np.random.default_rng(7)
    mtp = {k: v for k, v in donor_tensors.items() if k.startswith("model.layers.3.")}
    mtp.update({
        "model.layers.3.enorm.weight": (1 + 0.2 * g.standard_normal(64)).astype(np.float32),
        "model.layers.3.hnorm.weight": (1 + 0.2 * g.standard_normal(64)).astype(np.float32),
        "model.layers.3.eh_proj.weight": (0.05 * g.standard_normal((64, 128))).astype(np.float32),
        "model.layers.3.shared_head.norm.weight": (1 + 0.2 * g.standard_normal(64)).astype(np.float32),
        "model.layers.3.embed_tokens.weight": tensors["model.embed_tokens.weight"],
        "model.layers.3.shared_head.head.weight": tensors["lm_head.weight"],
    })
    path = tmp_path / "with_mtp"
    path.mkdir()
    safetensors.numpy.save_file({**tensors, **mtp}, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text((tmp_path / "base" / "config.json").read_text())

    model = from_pretrained(str(path))
    assert model.config.num_mtp_layers == 1 and model.num_mtp_layers == 1 and len(model.layers) == 4

    ref_mtp = MtpModel(hf, 1).eval()
    layer = ref_mtp.layers[0]
    with torch.no_grad():
        layer.mtp_block.load_state_dict(donor.model.layers[3].state_dict())
        for name in ("enorm", "hnorm", "eh_proj"):
            getattr(layer, name).weight.copy_(torch.from_numpy(mtp[f"model.layers.3.{name}.weight"]))
        layer.post_norm.weight.copy_(torch.from_numpy(mtp["model.layers.3.shared_head.norm.weight"]))

    ids = random_ids(2, 24)
    graphdef, state = nnx.split(model)
    hidden = _final_hidden(graphdef, state, jnp.asarray(ids))  # [B, T, D], what transformers' MTP generator feeds
    with torch.no_grad():
        main = hf(torch.tensor(ids, dtype=torch.long), output_hidden_states=True)
        ref_hidden = main.hidden_states[-1]
        assert rel_err(np.asarray(hidden), ref_hidden.numpy()) <= 1e-5
        # transformers gives the MTP layer the positions of the shifted tokens (i + 1); RoPE only sees
        # position differences, so this equals our positions i up to rounding
        pos = torch.arange(1, ids.shape[1])[None].expand(2, -1)
        h = ref_mtp.forward_layer(0, torch.tensor(np.asarray(hidden))[:, :-1], pos, None,
                                  input_ids=torch.tensor(ids[:, 1:], dtype=torch.long))
        ref = ref_mtp._project_to_logits(h).numpy()  # [B, T-1, V]
    ours = np.asarray(_mtp(graphdef, state, jnp.asarray(ids), hidden))
    err = rel_err(ours, ref)
    print(f"mtp logits rel err {err:.2e}")
    assert ours.shape == (2, ids.shape[1] - 1, V) and err <= 1e-4

    save_pretrained(model, str(tmp_path / "ours"))
    written = safetensors.numpy.load_file(str(tmp_path / "ours" / "model.safetensors"))
    assert sorted(k for k in written if k.startswith("model.layers.3.")) == sorted(mtp)
    for k, v in mtp.items():
        np.testing.assert_array_equal(written[k], v, err_msg=k)
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["num_nextn_predict_layers"] == 1


# ------------------------------------------------------------------------------------------------
# FP8 block checkpoints
# ------------------------------------------------------------------------------------------------

FP8_SKIP = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")  # stay float (docs/formats/deepseek-fp8.md)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [M, N] float32 -> (e4m3 [M, N], weight_scale_inv [ceil(M/128), ceil(N/128)] = tile amax / 448)."""
    M, N = w.shape
    sm, sn = -(-M // 128), -(-N // 128)
    padded = torch.zeros(sm * 128, sn * 128)
    padded[:M, :N] = w
    amax = padded.reshape(sm, 128, sn, 128).abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax)).float()
    full = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:M, :N]
    return (w / full).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale_inv


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    M, N = q.shape
    return q.to(torch.float32) * scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:M, :N]


def test_fp8_checkpoint_equals_transformers_on_dequantized_weights(checkpoints, tmp_path):
    _, path, float_model = checkpoints("grouped")
    tensors = safetensors.torch.load_file(str(path / "model.safetensors"))
    fp8, dequant = {}, {}
    for name, w in tensors.items():
        if w.ndim == 2 and name.endswith(".weight") and not any(s in name for s in FP8_SKIP):
            q, s = quantize_fp8(w)
            fp8[name], fp8[name.replace(".weight", ".weight_scale_inv")] = q, s
            dequant[name] = dequantize_fp8(q, s)
        else:
            fp8[name] = dequant[name] = w
    assert fp8["model.layers.0.mlp.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert fp8["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 1)  # 160 rows: an edge tile
    config = json.loads((path / "config.json").read_text())
    for folder, state, extra in (
        ("fp8", fp8, {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                              "weight_block_size": [128, 128]}}),
        ("dequant", dequant, {}),
    ):
        (tmp_path / folder).mkdir()
        safetensors.torch.save_file(state, str(tmp_path / folder / "model.safetensors"), metadata={"format": "pt"})
        (tmp_path / folder / "config.json").write_text(json.dumps({**config, **extra}))

    ours = from_pretrained(str(tmp_path / "fp8"))
    np.testing.assert_array_equal(np.asarray(ours.layers[0].mlp.gate_proj.kernel[...]).T,
                                  dequant["model.layers.0.mlp.gate_proj.weight"].numpy())
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "dequant"),
                                                                 attn_implementation="eager",
                                                                 dtype=torch.float32).eval()
    ids = random_ids(2, 40)
    ref = hf_logits(ref_model, ids)
    got = forward(ours, ids)
    err = rel_err(got, ref)
    print(f"fp8: ours vs transformers on dequantized weights {err:.2e}; quantization moved logits by "
          f"{rel_err(got, forward(float_model, ids)):.2e}")
    assert err <= 1e-4


# ------------------------------------------------------------------------------------------------
# Config spellings and presets
# ------------------------------------------------------------------------------------------------

HUB_V3 = {  # deepseek-ai/DeepSeek-V3 config.json (legacy spelling, remote-code fields)
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "first_k_dense_replace": 3, "moe_layer_freq": 1, "ep_size": 1, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "max_position_embeddings": 163840, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu", "attention_bias": False,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "num_nextn_predict_layers": 1,
    "torch_dtype": "bfloat16",
    "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32,
                     "beta_slow": 1, "original_max_position_embeddings": 4096},
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}


def test_presets_and_hub_spelling():
    v3 = DeepseekV3Config.deepseek_v3()
    assert DeepseekV3Config.from_hf(HUB_V3) == v3 == DeepseekV3Config.deepseek_r1()
    assert v3.softmax_scale == pytest.approx(0.1352338, abs=1e-7)  # 192^-0.5 · 1.3688879²
    k2, k2_0905 = DeepseekV3Config.kimi_k2(), DeepseekV3Config.kimi_k2_0905()
    assert k2.softmax_scale == pytest.approx(0.1308608, abs=1e-7)
    assert k2_0905.softmax_scale == pytest.approx(0.1446796, abs=1e-7)
    assert (k2.n_routed_experts, k2.num_attention_heads, k2.n_group, k2.topk_group, k2.first_k_dense_replace,
            k2.routed_scaling_factor, k2.rope_theta, k2.vocab_size, k2.num_mtp_layers) == \
        (384, 64, 1, 1, 1, 2.827, 50000.0, 163840, 0)
    assert (k2.rope_scaling["beta_fast"], k2.rope_scaling["factor"], k2_0905.rope_scaling["factor"]) == (1, 32, 64)
    assert k2.model_type == "kimi_k2" and DeepseekV3Config.from_hf({**HUB_V3, "model_type": "kimi_k2"}).model_type \
        == "kimi_k2"
    # transformers-5 spelling: rope_parameters (with the stray legacy "type"), dtype, no routing method fields
    v5 = {k: v for k, v in HUB_V3.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype", "topk_method",
                                                      "scoring_func", "num_nextn_predict_layers")}
    v5.update(dtype="bfloat16", num_mtp_layers=1, rope_parameters={
        **HUB_V3["rope_scaling"], "rope_type": "yarn", "rope_theta": 10000.0})
    assert DeepseekV3Config.from_hf(v5) == v3


@pytest.mark.parametrize("field,value", [("topk_method", "greedy"), ("scoring_func", "softmax"),
                                         ("topk_method", "group_limited_greedy")])
def test_unsupported_routing_is_rejected(field, value):
    with pytest.raises(NotImplementedError) as e:
        DeepseekV3Config.from_hf({**HUB_V3, field: value})
    assert field in str(e.value) and value in str(e.value) and "\n" not in str(e.value)


def test_for_checkpoint_counts_mtp_layers():
    c = DeepseekV3Config.tiny(num_nextn_predict_layers=1)
    assert c.num_mtp_layers == 1
    assert c.for_checkpoint({"model.embed_tokens.weight"}).num_mtp_layers == 0
    names = {"model.layers.3.enorm.weight", "model.layers.4.enorm.weight", "model.layers.3.hnorm.weight"}
    assert c.for_checkpoint(names).num_mtp_layers == 2


@pytest.mark.parametrize("preset", ["deepseek_v3", "kimi_k2", "kimi_k2_0905"])
def test_to_hf_is_read_back_by_transformers(tmp_path, preset):
    ours = getattr(DeepseekV3Config, preset)()
    (tmp_path / "config.json").write_text(json.dumps(ours.to_hf("bfloat16")))
    theirs = transformers.AutoConfig.from_pretrained(str(tmp_path))
    assert type(theirs).__name__ == "DeepseekV3Config"
    for field in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                  "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
                  "topk_group", "routed_scaling_factor", "norm_topk_prob", "first_k_dense_replace", "rms_norm_eps",
                  "max_position_embeddings", "rope_interleave", "attention_bias", "bos_token_id", "eos_token_id"):
        assert getattr(theirs, field) == getattr(ours, field), field
    assert theirs.num_mtp_layers == ours.num_mtp_layers
    assert {k: theirs.rope_parameters[k] for k in ours.rope_scaling} == dict(ours.rope_scaling)
    assert theirs.rope_parameters["rope_theta"] == ours.rope_theta
    assert DeepseekV3Config.from_hf(theirs.to_dict()) == dataclasses.replace(ours, model_type="deepseek_v3")
    assert os.path.exists(tmp_path / "config.json")
