"""DeepSeek-V4 parity with transformers 5.25 `DeepseekV4ForCausalLM` (fp32, eager attention, highest matmul precision):
a sliding-only, a CSA and an HCA layer on sequences longer than the window, both compression rates and the indexer's
top-k (so every sparse and compressed path runs), mHC with perturbed weights, a hash-routed first layer (a random
`tid2eid`), sqrt-softplus routing and clamped SwiGLU; the KV cache (sliding keys, finished compressed entries and
the open windows' projections) in decode, `generate` and speculative verify-and-roll-back calls, and a decode step's
compressor work independent of the cache length; our save -> transformers load; the config spellings
(docs/models/deepseek-v4.md).

Tiny config: hidden 64, 4 heads of 32 (16 rotated), q_lora 32, 2 streams, window 8, CSA m=4 keeping the top 3 of
its entries with an 8-head indexer of 16 dims, HCA m=8, 8 experts of 32 (top-2), o_groups 2 × 16; 24 tokens (6 CSA
entries, 3 HCA entries).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import torch
import transformers
from parity_helpers import (
    assert_generate_is_the_forwards_argmax,
    build_from_config,
    calibration_batches,
    decode_logits,
    hf_logits,
    hf_reload_logits,
    rel_err,
    with_config,
)
from safetensors.numpy import load_file

from models import KVCache, generate, jit_forward
from models.deepseek_v4 import CSA, HCA, SLIDING, DeepseekV4, DeepseekV4Config, HashRouter, V4Router
from models.hf import from_pretrained, save_pretrained
from models.layers import RMSNorm

pytestmark = pytest.mark.parity
V, E, TOPK = 128, 8, 3
TYPES = [SLIDING, CSA, HCA]
TINY = dict(vocab_size=V, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            head_dim=32, q_lora_rank=32, num_experts_per_tok=2, n_routed_experts=E, partial_rotary_factor=0.5,
            layer_types=TYPES, compress_rates={CSA: 4, HCA: 8}, hc_mult=2, sliding_window=8, o_groups=2,
            o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=TOPK,
            mlp_layer_types=["hash_moe", "moe", "moe"], max_position_embeddings=512, rms_norm_eps=1e-5,
            swiglu_limit=0.05)
IDS = np.random.default_rng(0).integers(0, V, (2, 24)).astype(np.int32)  # 24 > window, 2·m_HCA, 4·TOPK


def build(config: transformers.DeepseekV4Config, seed: int = 0) -> transformers.PreTrainedModel:
    """build_from_config, plus what it leaves at its constant init: a random distinct-expert `tid2eid`, the
    compressors' position biases, and mHC weights large enough that the streams differ."""
    hf = build_from_config(config, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in list(hf.named_parameters()) + list(hf.named_buffers()):
            if name.endswith("tid2eid"):
                p.copy_(torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(p.shape[0])]))
            elif name.endswith("position_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith(("hc.base", "hc_base")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith(("hc.scale", "hc_scale")):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith(("hc.fn", "hc_fn")):
                p.mul_(10)
    return hf


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(transformers model, its folder, our model loaded from it, transformers' logits on IDS)."""
    hf = build(transformers.DeepseekV4Config(**TINY))
    path = tmp_path_factory.mktemp("dsv4")
    hf.save_pretrained(path)
    return hf, path, from_pretrained(str(path)), hf_logits(hf, IDS)


def test_logits_match_transformers_and_every_path_matters(ckpt, tmp_path):
    hf, path, ours, ref = ckpt
    assert isinstance(ours, DeepseekV4) and [l.attn.kind for l in ours.layers] == TYPES
    assert [type(l.ffn.gate) for l in ours.layers] == [HashRouter, V4Router, V4Router]
    err = rel_err(jit_forward(ours)(jnp.asarray(IDS)), ref)
    print(f"DeepSeek-V4 fp32 logits vs transformers: max rel err {err:.2e}")
    assert err <= 1e-5
    # the same weights with every compressed entry kept, a window past the length, no clamp: other logits on
    # both sides, equal to each other (the sparse selection, the window and the clamp each change the model)
    for change in (dict(index_topk=IDS.shape[1]), dict(sliding_window=IDS.shape[1]), dict(swiglu_limit=100.0)):
        other = with_config(path, tmp_path / next(iter(change)), **change)
        logits = np.asarray(jit_forward(from_pretrained(other))(jnp.asarray(IDS)))
        assert rel_err(logits, hf_reload_logits(other, IDS)) <= 1e-5, change
        assert rel_err(logits, ref) > 1e-3, change


def test_save_has_transformers_tensors_and_loads_back(ckpt, tmp_path):
    hf, path, ours, ref = ckpt
    save_pretrained(ours, str(tmp_path / "ours"))
    theirs, mine = load_file(path / "model.safetensors"), load_file(tmp_path / "ours" / "model.safetensors")
    for name in ("model.layers.1.attn.indexer.compressor.ape", "model.layers.0.ffn.gate.tid2eid", "head.weight",
                 "model.layers.2.ffn.experts.7.w3.weight", "model.hc_head.hc_fn", "model.layers.1.hc_ffn_scale"):
        assert name in theirs, name
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in theirs.items()}
    for key, value in theirs.items():
        assert mine[key].dtype == value.dtype and np.array_equal(mine[key], value), key
    assert rel_err(hf_reload_logits(str(tmp_path / "ours"), IDS), ref) <= 1e-5
    assert from_pretrained(str(tmp_path / "ours")).config == ours.config


def test_cached_decoding_and_generate_equal_the_full_forward(ckpt):
    """Prefill 5 tokens (inside the first CSA window's successor, before any HCA window closes), then one token at
    a time through the cache (each closing window appends its entry from the cached open window), and `generate`
    (greedy) emitting the full forward's argmax at every step past the window and both compression rates."""
    _, _, ours, ref = ckpt
    assert rel_err(decode_logits(ours, IDS, split=5), ref) <= 1e-5  # windows close at 7, 11, 15, 19, 23 as it goes
    prompt = IDS[:, :5]
    out = generate(ours, jnp.asarray(prompt), max_new_tokens=14)
    lengths = np.full(2, 5, np.int32)  # rows of 19 tokens, past twice the window (8)
    assert_generate_is_the_forwards_argmax(ours, prompt, lengths, np.asarray(out.tokens), longer_than=2 * 8)


def test_a_padded_row_generates_what_it_does_alone(ckpt):
    """A 5-token prompt batched with an 11-token one, padded on either side, generates what it does alone, past the
    window and both compression rates: the compressed windows pool from each row's first token (left padding
    would pool the padding with it: `generate` decodes such rows right-padded), and the prompt's hidden states
    come back in the caller's slots."""
    _, _, ours, _ = ckpt
    short = IDS[0, :5]
    # row 0 of the unpadded batch is the short prompt alone (the call the test above compiled, shapes and all)
    alone = np.asarray(generate(ours, jnp.asarray(IDS[:, :5]), max_new_tokens=14).tokens)[0]
    _, (feature,) = jax.jit(lambda x: ours(x, return_hidden=(1,)))(jnp.asarray(short[None]))  # [1, 5, D]
    for side, at in (("left", slice(6, 11)), ("right", slice(0, 5))):
        batch = np.zeros((2, 11), np.int32)
        batch[0, at], batch[1] = short, IDS[1, :11]
        out = generate(ours, jnp.asarray(batch), prompt_lengths=jnp.asarray([5, 11]), padding_side=side,
                       max_new_tokens=14, return_hidden=(1,))
        assert np.array_equal(np.asarray(out.tokens)[0], alone), side
        assert rel_err(np.asarray(out.hidden[0])[0, at], np.asarray(feature)[0]) <= 1e-5, side


def test_verify_and_roll_back_through_the_compressed_cache_equals_transformers(ckpt):
    """Speculative decoding's target calls: a block of W = 4 tokens of which each row accepts a random prefix
    (the rest are wrong tokens), then a rollback to the accepted length, from 4 tokens to all 24. The accepted
    positions' logits equal transformers' full forward ≤ 1e-5: the entries rejected tokens closed are never seen
    and rewritten, and the ring of open-window projections (sized for W) still holds what the rolled-back windows
    need. The cache holds no per-token projections: entries [B, S / m, ·] and the ring [B, span + W − 1, ·]."""
    _, _, ours, ref = ckpt
    B, T, W = *IDS.shape, 4
    cache = KVCache.init(ours.config, B, T + W, ours.dtype, call_width=W)
    c = ours.config
    assert cache.v.shape[-1] == 0 and sorted(cache.extra) == ["1", "2"]  # the CSA and HCA layers
    for i, m, span in ((1, 4, 8), (2, 8, 8)):
        assert cache.extra[str(i)]["entries"].shape == (B, (T + W) // m, c.head_dim)
        assert cache.extra[str(i)]["ring"].shape == (B, span + W - 1, c.raw_width(i))
    assert cache.extra["1"]["index"].shape == (B, (T + W) // 4, c.index_head_dim)
    forward, rng = jit_forward(ours), np.random.default_rng(3)
    got, want, length = [], [], np.zeros(B, np.int64)
    while length.min() < T:  # one compiled call shape: the prefill is the first block, all of it accepted
        accept = np.minimum(rng.integers(0, W, B) if length.any() else W - 1, T - 1 - length)  # right up to here
        block = rng.integers(0, V, (B, W)).astype(np.int32)
        for b in range(B):
            block[b, :accept[b] + 1] = IDS[b, length[b]:length[b] + accept[b] + 1]
        logits, cache = forward(jnp.asarray(block), positions=jnp.asarray(length[:, None] + np.arange(W), jnp.int32),
                                cache=cache)
        for b in range(B):
            got.append(np.asarray(logits)[b, :accept[b] + 1])
            want.append(ref[b, length[b]:length[b] + accept[b] + 1])
        length = length + accept + 1
        cache = cache.rollback(jnp.asarray(length, jnp.int32))
    assert np.all(length == T)  # past the window and both rates, with windows closing in rolled-back calls
    err = rel_err(np.concatenate([g.reshape(-1, V) for g in got]), np.concatenate([w.reshape(-1, V) for w in want]))
    print(f"DeepSeek-V4 verify-and-roll-back decoding vs transformers: max rel err {err:.2e}")
    assert err <= 1e-5


def test_a_decode_step_pools_one_window_whatever_the_cache_length(ckpt, monkeypatch):
    """What the compressors pool in one decode step (the entries their softmax, sum and norm run over) is one
    window [B, 1, X] at every cache length: the step appends at most one entry and never re-pools the cached
    windows (re-pooling every closed window, as a cache of per-token projections must, is [B, S / m, X])."""
    _, _, ours, _ = ckpt
    norms = {id(layer.attn.compressor.norm) for layer in ours.layers if layer.attn.compressor is not None}
    norms |= {id(layer.attn.indexer.compressor.norm) for layer in ours.layers if layer.attn.indexer is not None}
    seen: list[tuple[int, ...]] = []
    call = RMSNorm.__call__

    def spy(self, x, *args, **kwargs):
        if id(self) in norms:
            seen.append(tuple(x.shape))
        return call(self, x, *args, **kwargs)

    monkeypatch.setattr(RMSNorm, "__call__", spy)
    pooled = {}
    for S in (32, 256):
        seen.clear()
        cache = dataclasses.replace(KVCache.init(ours.config, 2, S), length=jnp.full((2,), S // 2, jnp.int32))
        jax.make_jaxpr(lambda ids, cache: ours(ids, cache=cache))(jnp.zeros((2, 1), jnp.int32), cache)
        pooled[S] = sorted(seen)
    c = ours.config
    assert pooled[32] == pooled[256] == sorted([(2, 1, c.head_dim), (2, 1, c.index_head_dim), (2, 1, c.head_dim)])


def test_config_spellings_and_refusals(ckpt, tmp_path):
    _, path, ours, ref = ckpt
    c = ours.config
    assert DeepseekV4Config.from_hf(c.to_hf()) == c
    back = transformers.DeepseekV4Config(**c.to_hf())  # transformers builds the same model from our to_hf
    want = transformers.DeepseekV4Config(**TINY)
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters", "qk_rope_head_dim",
                "index_topk", "sliding_window", "hc_mult"):
        assert getattr(back, key) == getattr(want, key), key
    # the published (legacy) spelling transformers folds in: per-layer compress_ratios, num_hash_layers,
    # qk_rope_head_dim, compress_rate_csa / _hca, a flat rope_scaling for the compressed layers
    yarn = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1}
    legacy = with_config(path, tmp_path / "legacy", layer_types=None, mlp_layer_types=None, compress_rates=None,
                         rope_parameters=None, partial_rotary_factor=None, dtype=None, torch_dtype="float32",
                         compress_ratios=[0, 4, 128], compress_rate_hca=8, num_hash_layers=1, qk_rope_head_dim=16,
                         rope_theta=10000.0, rope_scaling=yarn)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(legacy, attn_implementation="eager",
                                                               dtype=torch.float32).eval()
    assert theirs.config.layer_types == TYPES and theirs.config.compress_rates[HCA] == 8
    mine = from_pretrained(legacy)
    assert mine.config.mlp_layer_types == ("hash_moe", "moe", "moe") and mine.config.rope_scaling["factor"] == 4.0
    yarn_ref = hf_logits(theirs, IDS)
    assert rel_err(jit_forward(mine)(jnp.asarray(IDS)), yarn_ref) <= 1e-5
    assert rel_err(yarn_ref, ref) > 1e-3  # YaRN on the compressed layers' RoPE changes the model
    assert DeepseekV4Config.from_hf(mine.config.to_hf()) == mine.config
    for bad, match in ((dict(layer_types=(SLIDING,)), "layer_types"), (dict(num_key_value_heads=2), "num_key_val"),
                       (dict(scoring_func="softmax"), "scoring_func"), (dict(qk_rope_head_dim=40), "qk_rope_head_dim"),
                       (dict(n_shared_experts=2), "n_shared_experts")):
        with pytest.raises((ValueError, NotImplementedError), match=match):
            dataclasses.replace(c, **bad)
    with pytest.raises(ValueError, match="compress_ratios"):
        DeepseekV4Config.from_hf({**c.to_hf(), "layer_types": None, "compress_ratios": [0, 4, 64]})
    tiny = DeepseekV4Config.tiny()
    assert tiny.index_topk < 20 and DeepseekV4(tiny, rngs=__import__("flax").nnx.Rngs(0)).config is tiny
    flash = DeepseekV4Config.deepseek_v4_flash()
    assert flash.layer_types[:3] == (HCA, HCA, HCA) and flash.layer_types[3] == CSA
    assert transformers.DeepseekV4Config(**flash.to_hf()).rope_parameters["compress"]["factor"] == 16.0


def test_quantization_refuses_the_family(ckpt):
    """The folds that do not know V4's readers (AWQ through the clamped experts, the norm folds and rotations
    past the compressors, the indexer and the streams) refuse the model by name instead of writing something
    transformers would not load; RTN, GPTQ and fp8-block run (the tests below)."""
    from models import quant

    model = from_pretrained(str(ckpt[1]))
    ids = IDS[:1, :16]
    for scheme, opts in (("w4a16-awq-g16", {}), ("int8", {"rotate": "hadamard"})):
        with pytest.raises(ValueError, match="DeepSeek-V4 .* not supported by quantization"):
            quant.quantize_model(model, quant.parse_scheme(scheme), [(ids, np.ones_like(ids))],
                                 opts=quant.Options(**opts))


# ------------------------------------------------------------------------------------------------
# Quantization: calibration through the streams and the hash routers, compressed-tensors export
# ------------------------------------------------------------------------------------------------

FLOAT_KEPT = ("model.layers.1.attn.compressor.wkv", "model.layers.2.attn.compressor.wgate",
              "model.layers.1.attn.indexer.compressor.wkv", "model.layers.1.attn.indexer.weights_proj")


def torch_tensors(folder) -> dict[str, torch.Tensor]:
    """A saved folder's tensors as torch tensors (numpy has no float8)."""
    with safetensors.safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def quantized_v4(path, scheme: str):
    """Our model from `path` quantized with `scheme` on random calibration batches (row 0's tail padding)."""
    from models import quant

    model = from_pretrained(str(path))
    report = quant.quantize_model(model, quant.parse_scheme(scheme), calibration_batches(V, 2, 2, 32, 1, pad=5))
    return model, {r["module"]: r for r in report["modules"]}


@pytest.mark.parametrize("scheme", ["w4a16-gptq-g16", pytest.param("fp8-block", marks=pytest.mark.slow)])
def test_quantized_export_loads_in_transformers(ckpt, tmp_path, scheme):
    """Every Linear and expert but the head, the compressors and the indexer's compressor and weights_proj (bf16 in
    the published checkpoint) quantized, GPTQ on the routed experts' own tokens (the hash layer's too); the
    compressed-tensors folder loads in transformers (its renamed modules, its merged experts) with our logits."""
    _, path, _, ref = ckpt
    model, rows = quantized_v4(path, scheme)
    assert not set(FLOAT_KEPT) & set(rows) and "head" not in rows
    expert_rows = [r for name, r in rows.items() if ".ffn.experts." in name]
    assert len(expert_rows) == 3 * E * 3
    assert {"model.layers.1.attn.indexer.wq_b", "model.layers.0.attn.wo_a"} <= set(rows)
    if scheme.endswith("gptq-g16"):
        assert all(r["tokens"] > 0 and r["method"] == "gptq" for r in expert_rows if "experts.0." in r["module"])
    out = tmp_path / scheme
    save_pretrained(model, str(out))
    tensors = torch_tensors(out)
    stored = ("weight_packed", torch.int32) if scheme.startswith("w4a16") else ("weight", torch.float8_e4m3fn)
    for name in ("model.layers.0.ffn.experts.5.w1", "model.layers.2.ffn.experts.0.w2", "model.layers.1.attn.wq_a",
                 "model.layers.1.ffn.shared_experts.w3"):
        assert f"{name}.weight_scale" in tensors and tensors[f"{name}.{stored[0]}"].dtype == stored[1], name
    for name in (*FLOAT_KEPT, "head"):
        assert tensors[f"{name}.weight"].dtype == torch.float32 and f"{name}.weight_scale" not in tensors, name
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    assert {"head", "lm_head", r"re:.*\.self_attn\.compressor\.(kv|gate)_proj$"} <= set(ignore)
    mine = np.asarray(jit_forward(model)(jnp.asarray(IDS)))
    theirs = hf_reload_logits(str(out), IDS)
    err, moved = rel_err(theirs, mine), rel_err(mine, ref)
    print(f"DeepSeek-V4 {scheme}: transformers vs ours {err:.2e}, quantization moved logits {moved:.2e}")
    assert err <= 1e-4 and moved >= 1e-2
    assert rel_err(jit_forward(from_pretrained(str(out)))(jnp.asarray(IDS)), mine) <= 1e-5  # our own load


@pytest.mark.slow
def test_w8a8_round_trips_and_the_folds_are_refused(ckpt, tmp_path):
    """int8 W8A8 without SmoothQuant: each exported expert decompresses through compressed-tensors to our weight
    and our load gives our logits (transformers' CPU loader does not merge int8 experts); SmoothQuant, AWQ and
    rotations are refused by name (the clamp, the compressors and the streams are outside their folds)."""
    from compressed_tensors.compressors.naive_quantized import IntQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    from models import quant

    _, path, _, ref = ckpt
    model, _ = quantized_v4(path, "int8-w8a8-nosmooth")
    save_pretrained(model, str(tmp_path / "w8a8"))
    qc = json.loads((tmp_path / "w8a8" / "config.json").read_text())["quantization_config"]
    (group,) = qc["config_groups"].values()
    cscheme = QuantizationScheme(targets=group["targets"], weights=group["weights"],
                                 input_activations=group["input_activations"])
    tensors = torch_tensors(tmp_path / "w8a8")
    ex = model.layers[2].ffn.experts
    gate_up, down = (np.asarray(w) for w in ex.base_weights(jnp.float32))  # [E, D, 2I], [E, I, D]
    I = ex.intermediate_size
    for part, want in (("w1", gate_up[3, :, :I].T), ("w3", gate_up[3, :, I:].T), ("w2", down[3].T)):
        state = {k.split(f"experts.3.{part}.")[1]: v for k, v in tensors.items()
                 if k.startswith(f"model.layers.2.ffn.experts.3.{part}.")}
        got = IntQuantizationCompressor.decompress(state, cscheme)["weight"].float().numpy()  # [out, in]
        np.testing.assert_array_equal(got, want, err_msg=part)
    mine = np.asarray(jit_forward(model)(jnp.asarray(IDS)))
    assert rel_err(mine, ref) >= 1e-3
    np.testing.assert_allclose(np.asarray(jit_forward(from_pretrained(str(tmp_path / "w8a8")))(jnp.asarray(IDS))),
                               mine, rtol=1e-5, atol=1e-6)
    fresh = from_pretrained(str(path))
    ids = IDS[:1, :16]
    for scheme, opts, what in (("int8-w8a8", {}, "SmoothQuant"), ("w4a16-awq-g16", {}, "AWQ"),
                               ("fp8-block", {"rotate": "hadamard"}, "rotate")):
        with pytest.raises(ValueError, match=f"{what}.*DeepSeek-V4 .* not supported by quantization's folds"):
            quant.quantize_model(fresh, quant.parse_scheme(scheme), [(ids, np.ones_like(ids))],
                                 opts=quant.Options(**opts))
