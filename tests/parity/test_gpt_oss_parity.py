"""GPT-OSS parity with transformers 5.24 `GptOssForCausalLM` (fp32, eager attention, highest matmul
precision; docs/models/gpt-oss.md).

One tiny random transformers model (4 layers: sliding, full, sliding, full; window 8 shorter than
every test sequence; 6 experts, top-2; YaRN from 16 positions, factor 4, truncate false) with
perturbed norms, sinks, attention / router / expert biases (parity_helpers.build_from_config),
embeddings ~ N(0, 1), router weights ~ N(0, 0.25²) and q/k weights × 4 so that tokens, routing and
positions matter, saved with `save_pretrained` and loaded with our `from_pretrained`. Logits must
agree to 1e-4 relative error.
"""

from __future__ import annotations

import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from flax import nnx
from parity_helpers import build_from_config, decode_logits, hf_logits, rel_err
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm, GptOssRotaryEmbedding

from models import KVCache, from_pretrained, jit_forward, save_pretrained
from models.gpt_oss import DEFAULT_YARN, GptOss, GptOssConfig
from models.layers import rope_frequencies
from models.quant.formats import dequant_mxfp4

pytestmark = pytest.mark.parity
TOL = 1e-4
VOCAB, E, I, D = 160, 6, 64, 64
# beta_fast 4 / beta_slow 0.25 put the correction range at [0, 2.02] for 16 rotary dims and 16 original
# positions: truncating it (the default) would give [0, 3], a different table (checked below).
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 4.0, "beta_slow": 0.25,
        "truncate": False, "original_max_position_embeddings": 16}
RNG = np.random.default_rng(0)


def hf_config(**overrides) -> transformers.GptOssConfig:
    kw = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=I, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=E, num_experts_per_tok=2, sliding_window=8,
              max_position_embeddings=256, rms_norm_eps=1e-5, rope_parameters=dict(YARN), pad_token_id=0)
    return transformers.GptOssConfig(**{**kw, **overrides})


def random_ids(b: int, t: int) -> np.ndarray:
    return RNG.integers(1, VOCAB, size=(b, t)).astype(np.int32)


def hf_forward(model, ids: np.ndarray, mask: np.ndarray | None = None, positions: np.ndarray | None = None):
    kw = {}
    if mask is not None:
        kw["attention_mask"] = torch.tensor(mask)
    if positions is not None:
        kw["position_ids"] = torch.tensor(positions, dtype=torch.long)
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long), **kw).logits.numpy()


def left_padding(ids: np.ndarray, pads: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids with pad id 0 in front, mask, positions = cumsum(mask) - 1 clipped at 0)."""
    ids = ids.copy()
    mask = np.ones_like(ids)
    for row, n in enumerate(pads):
        mask[row, :n] = 0
        ids[row, :n] = 0
    return ids, mask, np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(transformers model, checkpoint folder, our loaded model, its jitted forward)."""
    hf = build_from_config(hf_config(), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # tokens and routing must matter next to the perturbed (token-independent) biases
        emb = hf.model.embed_tokens.weight
        emb.copy_(torch.randn(emb.shape, generator=g))
        for layer in hf.model.layers:
            layer.mlp.router.weight.copy_(0.25 * torch.randn(layer.mlp.router.weight.shape, generator=g))
            layer.self_attn.q_proj.weight.mul_(4.0)  # sharper attention: positions (YaRN) matter more
            layer.self_attn.k_proj.weight.mul_(4.0)
    path = str(tmp_path_factory.mktemp("gpt_oss") / "hf")
    hf.save_pretrained(path)
    model = from_pretrained(path)
    return hf, path, model, jit_forward(model)


# ------------------------------------------------------------------------------------------------
# Forward parity
# ------------------------------------------------------------------------------------------------


def test_logits_match_transformers(ckpt):
    hf, _, model, _ = ckpt
    c = model.config
    assert isinstance(model, GptOss)
    assert [c.layer_window(i) for i in range(4)] == [8, None, 8, None]
    assert c.rope_scaling["truncate"] is False and c.num_local_experts == E
    # the perturbed tensors really are away from their init and loaded
    sinks = np.asarray(model.layers[0].self_attn.sinks[...])
    np.testing.assert_array_equal(sinks, hf.model.layers[0].self_attn.sinks.detach().numpy())
    assert np.std(sinks) > 0.1
    assert np.std(np.asarray(model.layers[1].mlp.router.bias[...])) > 0.1
    assert np.std(np.asarray(model.layers[1].mlp.experts.down_bias[...])) > 0.1
    assert model.layers[0].input_layernorm.weight[...].dtype == jnp.float32
    ids = random_ids(2, 40)  # 40 > window 8 and > the 16 original YaRN positions
    ref = hf_logits(hf, ids)  # transformers' default experts implementation (grouped_mm)
    ours = np.asarray(model(jnp.asarray(ids)))
    err = rel_err(ours, ref)
    assert hf.get_experts_implementation() == {"": "grouped_mm"}
    hf.set_experts_implementation("eager")  # the per-expert loop of modeling_gpt_oss.py
    try:
        err_eager = rel_err(ours, hf_logits(hf, ids))
    finally:
        hf.set_experts_implementation("grouped_mm")
    print(f"\ngpt_oss logits rel err {err:.2e} (eager experts {err_eager:.2e})")
    assert err <= TOL and err_eager <= TOL
    # routing depends on the token: most experts and several expert pairs are picked in every layer
    with torch.no_grad():
        router_logits = hf(torch.tensor(ids, dtype=torch.long), output_router_logits=True).router_logits
    for layer_logits in router_logits:
        top = torch.topk(layer_logits, 2, dim=-1).indices
        assert len(set(top.flatten().tolist())) >= E - 1
        assert len({tuple(sorted(p)) for p in top.tolist()}) >= 4


def test_yarn_tables_match_transformers(ckpt):
    hf, _, model, _ = ckpt
    c = model.config
    inv_freq, scaling = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
    rotary = hf.model.rotary_emb
    np.testing.assert_allclose(inv_freq, rotary.inv_freq.numpy(), rtol=1e-6, atol=0)
    assert scaling == pytest.approx(rotary.attention_scaling, rel=1e-12)
    assert scaling == pytest.approx(0.1 * np.log(4.0) + 1.0)  # cos and sin × 1.1386
    truncated, _ = rope_frequencies(c.head_dim, c.rope_theta, {**c.rope_scaling, "truncate": True},
                                    c.max_position_embeddings)
    assert np.max(np.abs(truncated - inv_freq) / inv_freq) > 0.1  # truncate: false matters here
    cos, sin = model.rope(jnp.arange(40)[None])
    ref_cos, ref_sin = rotary(torch.zeros(1), torch.arange(40)[None])
    np.testing.assert_allclose(np.asarray(cos)[..., :8], ref_cos.numpy(), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sin)[..., 8:], ref_sin.numpy(), rtol=0, atol=1e-6)


def test_left_padded_batch_matches_transformers(ckpt):
    hf, _, _, fwd = ckpt
    ids, mask, positions = left_padding(random_ids(3, 32), [0, 5, 13])  # row 2: more padding than the window
    ours = np.asarray(fwd(jnp.asarray(ids), positions=jnp.asarray(positions), segment_ids=jnp.asarray(mask)))
    assert np.all(np.isfinite(ours))
    ref = hf_forward(hf, ids, mask, positions)
    err = rel_err(ours[mask == 1], ref[mask == 1])
    print(f"\ngpt_oss left-padded rel err {err:.2e}")
    assert err <= TOL
    # without padding, row 2's real tokens alone give the same logits
    alone = np.asarray(fwd(jnp.asarray(ids[2:, 13:])))
    assert rel_err(ours[2, 13:], alone[0]) <= TOL


def test_decode_equals_forward_past_the_window(ckpt):
    hf, _, model, fwd = ckpt
    ids = random_ids(2, 32)
    full = np.asarray(fwd(jnp.asarray(ids)))
    steps = decode_logits(model, ids, split=5)  # 27 single-token steps, the cache grows past window 8
    err, err_hf = rel_err(steps, full), rel_err(steps, hf_logits(hf, ids))
    print(f"\ngpt_oss decode-vs-forward rel err {err:.2e} (vs transformers {err_hf:.2e})")
    assert err <= TOL and err_hf <= TOL


def test_left_padded_prefill_then_decode_matches_transformers(ckpt):
    hf, _, model, fwd = ckpt
    B, P, T = 2, 12, 32
    ids, mask, positions = left_padding(random_ids(B, T), [0, 6])
    cache = KVCache.init(model.config, B, T)
    logits, cache = fwd(jnp.asarray(ids[:, :P]), positions=jnp.asarray(positions[:, :P]),
                          segment_ids=jnp.asarray(mask[:, :P]), cache=cache)
    out = [np.asarray(logits)]
    for t in range(P, T):
        step, cache = fwd(jnp.asarray(ids[:, t:t + 1]), positions=jnp.asarray(positions[:, t:t + 1]), cache=cache)
        out.append(np.asarray(step))
    ours = np.concatenate(out, axis=1)
    ref = hf_forward(hf, ids, mask, positions)
    err = rel_err(ours[mask == 1], ref[mask == 1])
    print(f"\ngpt_oss padded prefill + decode rel err {err:.2e}")
    assert err <= TOL


# ------------------------------------------------------------------------------------------------
# Checkpoints: our save in transformers, MXFP4 experts
# ------------------------------------------------------------------------------------------------


def test_our_save_loads_in_transformers(ckpt, tmp_path):
    hf, _, model, fwd = ckpt
    out = str(tmp_path / "ours")
    save_pretrained(model, out)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert "quantization_config" not in cfg and cfg["architectures"] == ["GptOssForCausalLM"]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                                 dtype=torch.float32).eval()
    assert type(reloaded).__name__ == "GptOssForCausalLM"
    rc = reloaded.config
    assert rc.layer_types == hf.config.layer_types and rc.sliding_window == 8
    assert rc.rope_parameters == hf.config.rope_parameters
    assert (rc.swiglu_limit, rc.swiglu_alpha, rc.num_local_experts) == (7.0, 1.702, E)
    ids = random_ids(2, 32)
    np.testing.assert_array_equal(hf_logits(reloaded, ids), hf_logits(hf, ids))  # weights round-trip exactly
    err = rel_err(fwd(jnp.asarray(ids)), hf_logits(reloaded, ids))
    print(f"\ngpt_oss our save -> transformers rel err {err:.2e}")
    assert err <= TOL
    assert from_pretrained(out).config == model.config


def test_mxfp4_checkpoint_matches_dequantized_transformers(ckpt, tmp_path):
    hf, path, _, _ = ckpt
    rng = np.random.default_rng(7)
    tensors = safetensors.numpy.load_file(os.path.join(path, "model.safetensors"))
    ref = build_from_config(hf_config(), seed=0)
    ref.load_state_dict(hf.state_dict())
    for i, layer in enumerate(ref.model.layers):
        p = f"model.layers.{i}.mlp.experts."
        for name, (out_dim, in_dim) in (("gate_up_proj", (2 * I, D)), ("down_proj", (D, I))):
            assert tensors.pop(p + name).shape == (E, in_dim, out_dim)  # bf16/fp32 layout [E, in, out]
            blocks = rng.integers(0, 256, size=(E, out_dim, in_dim // 32, 16), dtype=np.uint8)
            scales = rng.integers(118, 125, size=(E, out_dim, in_dim // 32), dtype=np.uint8)  # exponents -9..-3
            tensors[p + name + "_blocks"], tensors[p + name + "_scales"] = blocks, scales
            w = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
            assert tuple(w.shape) == (E, in_dim, out_dim)
            with torch.no_grad():
                getattr(layer.mlp.experts, name).copy_(w)
    folder = tmp_path / "mxfp4"
    folder.mkdir()
    safetensors.numpy.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(cfg))
    model = from_pretrained(str(folder))
    # layer 0's experts hold the decoded values, de-interleaved (gate = even columns of [E, D, 2I])
    dec = np.swapaxes(dequant_mxfp4(tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"],
                                    tensors["model.layers.0.mlp.experts.gate_up_proj_scales"]), 1, 2)
    gu = np.asarray(model.layers[0].mlp.experts.gate_up[...])
    np.testing.assert_array_equal(gu[..., :I], dec[..., 0::2])
    np.testing.assert_array_equal(gu[..., I:], dec[..., 1::2])
    ids = random_ids(2, 32)
    err = rel_err(model(jnp.asarray(ids)), hf_logits(ref, ids))
    print(f"\ngpt_oss mxfp4 checkpoint rel err {err:.2e}")
    assert err <= TOL
    assert rel_err(hf_logits(ref, ids), hf_logits(hf, ids)) > 1e-2  # the new experts changed the model


# ------------------------------------------------------------------------------------------------
# Sinks train
# ------------------------------------------------------------------------------------------------


def rms_norm_f64(self, x: torch.Tensor) -> torch.Tensor:
    """GptOssRMSNorm's formula without its float32 cast (for the float64 finite difference)."""
    return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def test_sink_gradient_matches_torch_autograd(ckpt):
    """d(next-token loss)/d sinks: non-zero in every layer, equal to torch autograd through the
    eager transformers model, and to a float64 central finite difference of that model's loss."""
    hf, _, model, _ = ckpt
    ids = random_ids(2, 24)
    graphdef, state = nnx.split(model)

    @jax.jit
    def loss_and_grad(state):
        def loss_fn(state):
            logits = nnx.merge(graphdef, state)(jnp.asarray(ids))[:, :-1]
            logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
            return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(ids)[:, 1:, None], axis=-1))

        return jax.value_and_grad(loss_fn)(state)

    loss, grads = loss_and_grad(state)
    ours = np.stack([np.asarray(grads["layers"][i]["self_attn"]["sinks"][...]) for i in range(4)])  # [L, N]
    targets = torch.tensor(ids[:, 1:], dtype=torch.long).reshape(-1)

    def hf_loss(m):
        return torch.nn.functional.cross_entropy(m(torch.tensor(ids, dtype=torch.long)).logits[:, :-1].reshape(
            -1, VOCAB), targets)

    hf.zero_grad()
    ref_loss = hf_loss(hf)
    ref_loss.backward()
    ref = np.stack([hf.model.layers[i].self_attn.sinks.grad.numpy() for i in range(4)])
    hf.zero_grad()
    assert float(loss) == pytest.approx(ref_loss.item(), rel=1e-5)
    assert np.all(ours != 0)
    err = rel_err(ours, ref)
    # central difference in float64 on the sink with the largest gradient
    layer, head = np.unravel_index(np.argmax(np.abs(ours)), ours.shape)
    h = 1e-5
    m64 = build_from_config(hf_config(), seed=0).double()
    m64.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
    for mod in m64.modules():  # GptOssRMSNorm normalises in float32 even in a float64 model
        if isinstance(mod, GptOssRMSNorm):
            mod.forward = types.MethodType(rms_norm_f64, mod)
    m64.load_state_dict({k: v.double() for k, v in hf.state_dict().items()})
    sink = m64.model.layers[int(layer)].self_attn.sinks
    vals = []
    with torch.no_grad():
        for sign in (1, -1):
            sink[head] += sign * h
            vals.append(hf_loss(m64).item())
            sink[head] -= sign * h
    fd = (vals[0] - vals[1]) / (2 * h)
    print(f"\ngpt_oss sink grad rel err vs torch autograd {err:.2e}; layer {layer} head {head}: "
          f"ours {ours[layer, head]:.7e}, float64 finite difference {fd:.7e} "
          f"(rel {abs(ours[layer, head] - fd) / abs(fd):.1e})")
    assert err <= TOL
    assert ours[layer, head] == pytest.approx(fd, rel=1e-3)


# ------------------------------------------------------------------------------------------------
# Config spellings and presets
# ------------------------------------------------------------------------------------------------


def hf_rope(d: dict) -> dict:
    params = dict(transformers.GptOssConfig(**{k: v for k, v in d.items() if k not in ("architectures",
                                                                                      "model_type")}).rope_parameters)
    params.pop("type", None)
    return params


def our_rope(c: GptOssConfig) -> dict:
    return {**dict(c.rope_scaling), "rope_theta": c.rope_theta}


def test_config_spellings_match_transformers():
    tiny = GptOssConfig.tiny()
    v5 = tiny.to_hf()
    legacy = {k: v for k, v in v5.items() if k not in ("rope_parameters", "num_local_experts", "layer_types")}
    legacy.update(num_experts=tiny.num_local_experts, rope_theta=tiny.rope_theta,
                  rope_scaling={"type": "yarn", **{k: v for k, v in tiny.rope_scaling.items() if k != "rope_type"}})
    assert GptOssConfig.from_hf(v5) == GptOssConfig.from_hf(legacy) == tiny
    assert hf_rope(legacy) == our_rope(GptOssConfig.from_hf(legacy))
    # no RoPE fields at all: transformers' default YaRN dict with theta 150000
    bare = {k: v for k, v in v5.items() if k != "rope_parameters"}
    assert our_rope(GptOssConfig.from_hf(bare)) == hf_rope(bare) == {**DEFAULT_YARN, "rope_theta": 150000.0}
    # a legacy YaRN dict without original_max_position_embeddings takes max_position_embeddings
    short = {**legacy, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}
    assert our_rope(GptOssConfig.from_hf(short)) == hf_rope(short)
    assert GptOssConfig.from_hf(short).rope_scaling["original_max_position_embeddings"] == 256
    # a minimal config.json: every field at transformers' class default (head_dim 64, not 2880 // 64)
    minimal = {"model_type": "gpt_oss", "num_hidden_layers": 2}
    ours, theirs = GptOssConfig.from_hf(minimal), transformers.GptOssConfig(num_hidden_layers=2)
    assert our_rope(ours) == dict(theirs.rope_parameters)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window", "max_position_embeddings",
                  "rms_norm_eps", "attention_bias", "swiglu_limit", "swiglu_alpha", "router_aux_loss_coef"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert list(ours.layer_types) == theirs.layer_types
    # transformers reads back what to_hf writes
    hc = transformers.GptOssConfig.from_dict(v5)
    assert (hc.num_local_experts, hc.layer_types, hc.sliding_window, hc.swiglu_alpha, hc.head_dim) == \
        (8, list(tiny.layer_types), 8, 1.702, 16)


@pytest.mark.parametrize("preset,layers,experts", [("gpt_oss_20b", 24, 32), ("gpt_oss_120b", 36, 128)])
def test_presets_load_in_transformers(preset, layers, experts):
    c = getattr(GptOssConfig, preset)()
    hc = transformers.GptOssConfig.from_dict(c.to_hf("bfloat16"))
    assert (hc.num_hidden_layers, hc.num_local_experts, hc.num_attention_heads, hc.num_key_value_heads) == \
        (layers, experts, 64, 8)
    assert (hc.hidden_size, hc.intermediate_size, hc.head_dim, hc.vocab_size) == (2880, 2880, 64, 201088)
    assert hc.layer_types[:2] == ["sliding_attention", "full_attention"] and hc.sliding_window == 128
    assert hc.router_aux_loss_coef == 0.9 and hc.pad_token_id == 199999
    rotary = GptOssRotaryEmbedding(hc)
    inv_freq, scaling = rope_frequencies(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
    np.testing.assert_allclose(inv_freq, rotary.inv_freq.numpy(), rtol=1e-6)
    assert scaling == pytest.approx(rotary.attention_scaling) == pytest.approx(1.3465736, abs=1e-7)
    assert GptOssConfig.from_hf(c.to_hf()) == c
