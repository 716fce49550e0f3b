"""GLM-4.5 (`glm4_moe`) parity with transformers 5.24 (fp32, eager attention, highest matmul precision).

Each variant is a tiny random `Glm4MoeForCausalLM` (D 64, 4 / 2 heads of 32 ≠ D/N with rotary dim 16,
q/k/v biases, 8 experts of 32 in 2 groups with 1 kept, top-2, a shared expert, layer 0 dense) with
every norm, bias and e_score_correction_bias perturbed, saved with transformers and loaded with our
`from_pretrained`; logits must agree to 1e-4 relative error (docs/models/glm4-moe.md). Covers QK-norm
on and off, the partial rotary tables, a left-padded batch, decode through the KV cache, our save
loaded by transformers, the grouped expert dispatch against the dense reference, the required
`head_dim`, and an MTP layer: transformers never writes one, so the test adds one to the safetensors
(a full GLM MoE block taken from a second random model + enorm / hnorm / eh_proj / shared_head), and
checks our `mtp_logits` against transformers' own `MtpModel` / `Glm4MoeDecoderLayer` and torch math,
and that our save writes every MTP tensor back.
"""

from __future__ import annotations

import copy
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from flax import nnx
from parity_helpers import build_from_config, decode_logits, hf_logits, left_padded_rel_err, rel_err
from transformers.modeling_layers import MtpModel

from models import from_pretrained, jit_forward, save_pretrained
from models.decoder import MTPLayer
from models.glm4_moe import Glm4Moe, Glm4MoeConfig
from models.moe import MoE

pytestmark = pytest.mark.parity
V, D, L = 160, 64, 3
TINY = dict(vocab_size=V, hidden_size=D, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=L,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
            n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, attention_bias=True,
            partial_rotary_factor=0.5, rms_norm_eps=1e-5, max_position_embeddings=256)
VARIANTS = {
    "qk_norm": dict(use_qk_norm=True, norm_topk_prob=True, routed_scaling_factor=2.5,
                    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}),
    "no_qk_norm": dict(use_qk_norm=False, norm_topk_prob=False, routed_scaling_factor=1.0),
}
RNG = np.random.default_rng(0)


def random_ids(b: int, t: int) -> np.ndarray:
    return RNG.integers(0, V, size=(b, t)).astype(np.int32)


def hf_config(variant: str) -> transformers.Glm4MoeConfig:
    return transformers.Glm4MoeConfig(**TINY, **VARIANTS[variant])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """variant -> (hf_model, path, our_model), built once per module."""
    cache: dict[str, tuple] = {}

    def make(variant: str):
        if variant not in cache:
            hf = build_from_config(hf_config(variant), seed=sorted(VARIANTS).index(variant))
            path = tmp_path_factory.mktemp(f"glm4_moe_{variant}")
            hf.save_pretrained(path)
            cache[variant] = hf, str(path), from_pretrained(str(path))
        return cache[variant]

    return make


def jit_mtp_logits(*models: Glm4Moe) -> list:
    """Jitted `model.mtp_logits(ids, hidden)` for models of one structure, compiled once (eager MoE
    dispatch is slow on CPU)."""
    graphdef = nnx.graphdef(models[0])
    f = jax.jit(lambda state, ids, hidden: nnx.merge(graphdef, state).mtp_logits(ids, hidden))
    return [lambda ids, hidden, _s=nnx.state(m): np.asarray(f(_s, ids, hidden)) for m in models]


# ------------------------------------------------------------------------------------------------
# Main model
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(checkpoint, variant):
    hf, _, model = checkpoint(variant)
    c = model.config
    assert (c.head_dim, c.rotary_dim, c.use_qk_norm, c.attention_bias) == (32, 16, variant == "qk_norm", True)
    assert c.num_mtp_layers == 0 and len(model.layers) == L  # transformers wrote no MTP tensors
    assert [isinstance(layer.mlp, MoE) for layer in model.layers] == [False, True, True]
    assert model.layers[1].self_attn.o_proj.bias is None and model.layers[1].self_attn.q_proj.bias is not None
    assert float(jnp.abs(model.layers[2].mlp.gate.e_score_correction_bias[...]).max()) > 0.1  # perturbed
    # partial rotary: cos/sin over the 16 rotary dims equal transformers' tables
    pos = np.arange(30)[None]
    cos, sin = model.rope(jnp.asarray(pos))
    ref_cos, ref_sin = hf.model.rotary_emb(torch.zeros(1, 30, D), torch.tensor(pos))
    assert cos.shape == (1, 30, 16) and rel_err(cos, ref_cos.numpy()) <= 1e-6 and rel_err(sin, ref_sin.numpy()) <= 1e-6
    ids = random_ids(2, 40)
    err = rel_err(jit_forward(model)(jnp.asarray(ids)), hf_logits(hf, ids))
    print(f"glm4_moe {variant}: logits rel err {err:.2e}")
    assert err <= 1e-4


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_left_padded_batch_matches_transformers(checkpoint, variant):
    hf, _, model = checkpoint(variant)
    err = left_padded_rel_err(model, hf, random_ids(3, 20), [0, 7, 2])  # rows 1 and 2 are left-padded
    print(f"glm4_moe {variant}: left-padded rel err {err:.2e}")
    assert err <= 1e-4


def test_decode_through_kv_cache_equals_forward(checkpoint):
    _, _, model = checkpoint("qk_norm")
    fwd = jit_forward(model)
    ids = random_ids(2, 18)
    full = np.asarray(fwd(jnp.asarray(ids)))
    err = rel_err(decode_logits(model, ids, split=7), full)
    print(f"glm4_moe: decode-vs-forward rel err {err:.2e}")
    assert err <= 1e-4


def test_our_save_loads_in_transformers(checkpoint, tmp_path):
    hf, _, model = checkpoint("qk_norm")
    out = tmp_path / "ours"
    save_pretrained(model, str(out))
    names = set(safetensors.numpy.load_file(str(out / "model.safetensors")))
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in names
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in names
    assert "model.layers.0.self_attn.k_proj.bias" in names and "model.layers.0.self_attn.o_proj.bias" not in names
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    assert type(reloaded).__name__ == "Glm4MoeForCausalLM"
    ids = random_ids(2, 24)
    np.testing.assert_array_equal(hf_logits(reloaded, ids), hf_logits(hf, ids))  # weights round-trip exactly
    err = rel_err(jit_forward(model)(jnp.asarray(ids)), hf_logits(reloaded, ids))
    print(f"glm4_moe: our save -> transformers rel err {err:.2e}")
    assert err <= 1e-4
    # the declared num_nextn_predict_layers (1, transformers' default) becomes what the files hold (0)
    again = from_pretrained(str(out)).config
    assert again == Glm4MoeConfig.from_hf({**model.config.to_hf(), "num_nextn_predict_layers": 0})
    assert again.num_nextn_predict_layers == 0 and model.config.num_nextn_predict_layers == 1


def test_config_without_head_dim_fails_naming_it(checkpoint, tmp_path):
    _, path, _ = checkpoint("qk_norm")
    cfg = json.loads(open(os.path.join(path, "config.json")).read())
    del cfg["head_dim"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    os.symlink(os.path.join(path, "model.safetensors"), tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="head_dim") as e:
        from_pretrained(str(tmp_path))
    assert "\n" not in str(e.value)


def test_config_spellings_presets_and_for_checkpoint():
    tiny = Glm4MoeConfig.tiny()
    d = tiny.to_hf()
    assert Glm4MoeConfig.from_hf(d) == tiny
    hf_cfg = transformers.Glm4MoeConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert hf_cfg.head_dim == 32 and hf_cfg.rope_parameters["partial_rotary_factor"] == 0.5
    legacy = {k: v for k, v in d.items() if k != "rope_parameters"}
    legacy.update(rope_theta=1e6, partial_rotary_factor=0.5)  # top-level spelling
    assert Glm4MoeConfig.from_hf(legacy) == tiny
    assert Glm4MoeConfig.from_hf({**legacy, "partial_rotary_factor": None}).partial_rotary_factor == 0.5  # default
    big, air = Glm4MoeConfig.glm4_5(), Glm4MoeConfig.glm4_5_air()
    assert (big.num_hidden_layers, big.hidden_size, big.head_dim, big.n_routed_experts, big.routed_scaling_factor,
            big.use_qk_norm, big.first_k_dense_replace, big.rotary_dim) == (92, 5120, 128, 160, 2.5, True, 3, 64)
    assert (air.num_hidden_layers, air.hidden_size, air.n_routed_experts, air.moe_intermediate_size,
            air.routed_scaling_factor, air.use_qk_norm, air.first_k_dense_replace) == (46, 4096, 128, 1408, 1.0,
                                                                                       False, 1)
    assert big.attention_bias and air.attention_bias
    # MTP layers are found from the tensor names (enorm at index >= num_hidden_layers), never a hard-coded 92 / 46
    names = {"model.layers.91.enorm.weight", "model.layers.92.enorm.weight", "model.layers.92.eh_proj.weight"}
    assert big.for_checkpoint(names).num_mtp_layers == 1
    assert air.for_checkpoint({"model.layers.46.enorm.weight", "model.layers.47.enorm.weight"}).num_mtp_layers == 2
    assert big.for_checkpoint({"model.norm.weight"}).num_mtp_layers == 0
    with pytest.raises(ValueError, match="consecutive"):
        big.for_checkpoint({"model.layers.93.enorm.weight"})


# ------------------------------------------------------------------------------------------------
# MTP
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """(hf main model, donor model whose layer 1 is the MTP block, extra MTP tensors, path, our model)."""
    hf = build_from_config(hf_config("qk_norm"), seed=11)
    donor = build_from_config(hf_config("qk_norm"), seed=12)
    root = tmp_path_factory.mktemp("glm4_moe_mtp")
    hf.save_pretrained(root / "main")
    donor.save_pretrained(root / "donor")
    main = safetensors.numpy.load_file(str(root / "main" / "model.safetensors"))
    donor_t = safetensors.numpy.load_file(str(root / "donor" / "model.safetensors"))
    # a full GLM MoE block (input_layernorm, self_attn.*, post_attention_layernorm, mlp.*) at index L
    mtp = {k.replace("model.layers.1.", f"model.layers.{L}."): v for k, v in donor_t.items()
           if k.startswith("model.layers.1.")}
    assert f"model.layers.{L}.mlp.gate.e_score_correction_bias" in mtp and f"model.layers.{L}.self_attn.q_norm.weight" \
        in mtp
    g = np.random.default_rng(13)
    for n in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.{L}.{n}.weight"] = (1 + 0.2 * g.standard_normal(D)).astype(np.float32)
    mtp[f"model.layers.{L}.eh_proj.weight"] = (0.1 * g.standard_normal((D, 2 * D))).astype(np.float32)  # [D, 2D]
    mtp[f"model.layers.{L}.embed_tokens.weight"] = main["model.embed_tokens.weight"]
    mtp[f"model.layers.{L}.shared_head.head.weight"] = main["lm_head.weight"]
    safetensors.numpy.save_file({**main, **mtp}, str(root / "main" / "model.safetensors"), metadata={"format": "pt"})
    return hf, donor, mtp, str(root / "main"), from_pretrained(str(root / "main"))


def rms(x: torch.Tensor, w: np.ndarray, eps: float = 1e-5) -> torch.Tensor:
    return torch.tensor(w) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def test_mtp_layer_loads_and_matches_transformers(mtp_checkpoint):
    hf, donor, mtp, _, model = mtp_checkpoint
    assert model.config.num_mtp_layers == 1 and len(model.layers) == L + 1
    assert isinstance(model.layers[L], MTPLayer) and isinstance(model.layers[L].mlp, MoE)
    ids = random_ids(2, 16)
    logits, (hidden,) = jit_forward(model)(jnp.asarray(ids), return_hidden=(-1,))
    assert rel_err(logits, hf_logits(hf, ids)) <= 1e-4  # the MTP layer leaves the main model alone
    ours = jit_mtp_logits(model)[0](jnp.asarray(ids), hidden)  # [B, T-1, V]
    assert ours.shape == (2, 15, V)
    tids = torch.tensor(ids, dtype=torch.long)
    with torch.no_grad():
        # transformers feeds its MtpModel `hidden_states[-1]` (tied to the final-normed hidden)
        h = hf(tids, output_hidden_states=True).hidden_states[-1][:, :-1]
        assert rel_err(np.asarray(hidden)[:, :-1], h.numpy()) <= 1e-5
        h = torch.tensor(np.asarray(hidden)[:, :-1])  # the very same input for both references
        pos = torch.arange(15)[None].expand(2, 15)
        # (1) torch math around transformers' own Glm4MoeDecoderLayer holding the MTP block's tensors
        p = f"model.layers.{L}."
        u = torch.cat([rms(hf.model.embed_tokens(tids[:, 1:]), mtp[p + "enorm.weight"]),
                       rms(h, mtp[p + "hnorm.weight"])], dim=-1) @ torch.tensor(mtp[p + "eh_proj.weight"]).T
        cos, sin = hf.model.rotary_emb(u, pos)
        causal = torch.full((15, 15), float("-inf")).triu(1)[None, None]
        u = donor.model.layers[1](u, attention_mask=causal, position_embeddings=(cos, sin), position_ids=pos)
        ref = hf.lm_head(rms(u, mtp[p + "shared_head.norm.weight"])).numpy()
        # (2) transformers' generic MtpModel (MtpLayer: [enorm(emb), hnorm(h)] -> eh_proj -> block -> post_norm)
        mtp_model = MtpModel(copy.deepcopy(hf), 1).eval()
        layer = mtp_model.layers[0]
        layer.mtp_block.load_state_dict(donor.model.layers[1].state_dict())
        for name, module in (("enorm", layer.enorm), ("hnorm", layer.hnorm), ("eh_proj", layer.eh_proj),
                             ("shared_head.norm", layer.post_norm)):
            module.weight.copy_(torch.tensor(mtp[f"{p}{name}.weight"]))
        mtp_model.embed_tokens.weight.copy_(hf.model.embed_tokens.weight)
        mtp_model.shared_head.weight.copy_(hf.lm_head.weight)
        out = mtp_model.forward_layer(0, h, pos, None, input_ids=tids[:, 1:])
        ref2 = mtp_model._project_to_logits(out).numpy()
    err, err2 = rel_err(ours, ref), rel_err(ours, ref2)
    print(f"glm4_moe MTP: mtp_logits rel err {err:.2e} (torch + Glm4MoeDecoderLayer), {err2:.2e} (MtpModel)")
    assert err <= 1e-4 and err2 <= 1e-4


def test_save_writes_every_mtp_tensor_back(mtp_checkpoint, tmp_path):
    hf, _, mtp, _, model = mtp_checkpoint
    save_pretrained(model, str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    written = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    assert set(mtp) <= set(written)
    for name, value in mtp.items():
        np.testing.assert_array_equal(written[name], value, err_msg=name)
    again = from_pretrained(str(tmp_path))
    assert again.config == model.config and again.num_mtp_layers == 1
    ids = jnp.asarray(random_ids(1, 12))
    hidden = jnp.asarray(np.random.default_rng(1).standard_normal((1, 12, D)), jnp.float32)
    ours, theirs = jit_mtp_logits(again, model)
    np.testing.assert_array_equal(ours(ids, hidden), theirs(ids, hidden))
    # transformers' main model ignores the extra layer (unexpected keys) and gives the same logits
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").eval()
    np.testing.assert_array_equal(hf_logits(reloaded, np.asarray(ids)), hf_logits(hf, np.asarray(ids)))
