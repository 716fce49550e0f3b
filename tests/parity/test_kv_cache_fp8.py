"""FP8 KV cache with calibrated static scales (models/quant/kv_cache.py) against compressed-tensors 0.20.1 and
transformers 5.24.

Reference: docs/quantization.md ("FP8 KV cache") and docs/formats/compressed-tensors.md. Checked here:
* (a) our k/v scales equal compressed-tensors' `calculate_qparams` on the same amax, bit for bit, and its
  `initialize_qparams` shapes ([1] per tensor, [K, 1, 1] per KV head); the amax we observe is that of the keys
  (after k_norm and RoPE) and values transformers' attention hands its cache, padding excluded, with the earlier
  layers' K / V already FP8 (the sequential calibration);
* (b) our K / V quantize-dequantize (models/numerics.py `quantize_kv_fp8`) equals compressed-tensors'
  `forward_quantize` bit for bit, per tensor and per head, on values with outliers, zeros and clamping;
* (c) save -> our load gives identical logits; `kv_cache_scheme` is what compressed-tensors serializes and
  validates with `QuantizationConfig.model_validate`;
* (d) transformers 5.24 does not apply the KV scheme itself on load (its attention's cache argument is named
  `cache`, so compressed-tensors' `is_cached_attention_module` does not recognise it and the scales load as
  unexpected keys), so the reference is transformers' model of our export with compressed-tensors'
  `forward_quantize` on every attention's K and V (our scales from the files, in compressed-tensors' own
  parameters): its logits equal ours to 1e-5, and are far from ours without the FP8 KV cache;
* (e) cached decoding (models/generate.py's KV cache) equals the full forward with the FP8 cache, for every GQA
  family (Llama, Qwen3 with k_norm, Qwen3-MoE, GPT-OSS with sinks and sliding windows, GLM-4.5 with partial
  rotary and q/k/v bias), and MLA (DeepSeek-V3) is refused with its reason;
* (f) FP8 KV changes the logits (control), by little.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors
import torch
import transformers
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationStatus
from compressed_tensors.quantization.lifecycle.forward import forward_quantize
from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams
from compressed_tensors.quantization.utils import calculate_qparams
from flax import nnx
from parity_helpers import calibration_batches, checkpoint_maker, decode_logits, hf_logits, rel_err

from models import deepseek_v3, from_pretrained, glm4_moe, gpt_oss, jit_forward, llama, qwen3_moe, save_pretrained
from models.numerics import quantize_kv_fp8
from models.quant import calibrate_kv_cache, kv_cache_strategy, parse_scheme, quantize_model
from models.quant.kv_cache import kv_cache_args, kv_scale

pytestmark = pytest.mark.parity
V = 128
IDS = np.random.default_rng(0).integers(0, V, (2, 16)).astype(np.int32)
TOL = 1e-5
DIMS = dict(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5)
CONFIGS = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}


def calibration(n: int = 2, b: int = 2, t: int = 24, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """n batches (input_ids [b, t], segment_ids [b, t]); row 0 ends in 5 padding tokens (segment 0)."""
    return calibration_batches(V, n, b, t, seed, pad=5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_maker(tmp_path_factory, {arch: (lambda c=c: c(**DIMS)) for arch, c in CONFIGS.items()})


def ours(model) -> np.ndarray:
    return np.asarray(jit_forward(model)(jnp.asarray(IDS)))


def read_scales(path: str) -> dict[str, torch.Tensor]:
    with safetensors.safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if k.endswith(("k_scale", "v_scale"))}


def reference_with_kv_qdq(path: str, strategy: str, monkeypatch, seen: dict | None = None):
    """transformers' model of our export; every attention gets compressed-tensors' own k/v scale parameters
    (`initialize_qparams`, their shapes asserted equal to our files'), filled from our files, and its eager
    attention runs `forward_quantize` on K and V ([B, K, S, H], after k_norm and RoPE), recording the K / V before
    quantization per layer in `seen`."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                          dtype=torch.float32).eval()
    attn0 = hf.model.layers[0].self_attn
    assert not hasattr(attn0, "k_scale")  # transformers 5.24 + compressed-tensors 0.20.1 leave the KV cache alone
    args = QuantizationArgs.model_validate(kv_cache_args(strategy))
    scales = read_scales(path)
    cfg = hf.config
    for i, layer in enumerate(hf.model.layers):
        a = layer.self_attn
        for base in ("k", "v"):
            initialize_qparams(a, base, args, observed_shape=(cfg.num_key_value_heads, None, cfg.head_dim),
                               observed_dtype=torch.float32, force_zero_point=False)
            ours_ = scales[f"model.layers.{i}.self_attn.{base}_scale"]
            param = getattr(a, f"{base}_scale")
            assert tuple(param.shape) == tuple(ours_.shape) and ours_.dtype == torch.float32
            with torch.no_grad():
                param.copy_(ours_)
        assert not hasattr(a, "k_zero_point")  # symmetric KV args: no zero points, none written
        a.quantization_status = QuantizationStatus.FROZEN
    module = transformers.models.llama.modeling_llama if cfg.model_type == "llama" else \
        transformers.models.qwen3.modeling_qwen3
    eager = module.eager_attention_forward

    def kv_quantized(attn, query, key, value, *rest, **kw):
        if seen is not None:
            seen.setdefault(attn.layer_idx, []).append((key.detach().clone(), value.detach().clone()))
        key, value = forward_quantize(attn, key, "k", args), forward_quantize(attn, value, "v", args)
        return eager(attn, query, key, value, *rest, **kw)

    monkeypatch.setattr(module, "eager_attention_forward", kv_quantized)
    return hf


CASES = [("llama", "w4a16-gptq-g32", "tensor"), ("qwen3", "fp8-dynamic", "attn_head"), ("qwen3", "int8", "tensor")]


@pytest.mark.parametrize(("arch", "scheme", "strategy"), CASES)
def test_export_matches_compressed_tensors_kv_quantization(checkpoint, tmp_path, monkeypatch, arch, scheme, strategy):
    batches = calibration()
    model = from_pretrained(checkpoint(arch))
    quantize_model(model, parse_scheme(scheme), batches)
    weights_only = ours(model)
    kv = calibrate_kv_cache(model, batches, strategy)
    assert kv_cache_strategy(model) == strategy
    mine = ours(model)
    out = str(tmp_path / "q")
    save_pretrained(model, out)

    # (c) config and our round trip
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    QuantizationConfig.model_validate(qc)
    want = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy, dynamic=False)
    assert qc["kv_cache_scheme"] == want.model_dump(mode="json")  # compressed-tensors' own serialization
    assert QuantizationConfig.model_validate(qc).kv_cache_scheme == want
    reloaded = from_pretrained(out)
    assert kv_cache_strategy(reloaded) == strategy
    np.testing.assert_array_equal(ours(reloaded), mine)

    # (a) the scales: calculate_qparams on our amax, bit for bit
    for row, i in zip(kv["layers"], range(DIMS["num_hidden_layers"]), strict=True):
        for base in ("k", "v"):
            amax = torch.tensor(row[f"{base}_amax"], dtype=torch.float32)
            ref, zp = calculate_qparams(-amax, amax, want)  # min / max of a symmetric range: max |x| = amax
            got = np.asarray(getattr(model.layers[i].self_attn, f"{base}_scale")[...])
            np.testing.assert_array_equal(got.reshape(-1), ref.numpy().reshape(-1))
            np.testing.assert_array_equal(kv_scale(np.asarray(row[f"{base}_amax"])), ref.numpy())
            assert float(zp.float().abs().max()) == 0.0

    # (d) + (a): transformers' model of the export with compressed-tensors' KV QDQ
    seen: dict[int, list] = {}
    hf = reference_with_kv_qdq(out, strategy, monkeypatch, seen)
    ref = hf_logits(hf, IDS)
    err, control = rel_err(mine, ref), rel_err(weights_only, ref)
    print(f"{arch} {scheme} {strategy}: ours vs compressed-tensors KV QDQ {err:.2e}; without FP8 KV {control:.2e}")
    assert err <= TOL and control >= 100 * TOL
    # the amax we calibrated on is that of the K / V transformers caches (its real tokens, earlier layers' K / V
    # quantized with the same scales): equal up to float summation order
    seen.clear()
    for ids, seg in batches:
        hf_logits(hf, ids, attention_mask=seg)
    for i, row in enumerate(kv["layers"]):
        for j, base in enumerate(("k", "v")):
            amax = np.zeros(DIMS["num_key_value_heads"] if strategy == "attn_head" else 1, np.float32)
            for (_, seg), pair in zip(batches, seen[i], strict=True):
                t = pair[j].abs() * torch.from_numpy(seg != 0)[:, None, :, None]  # [B, K, S, H], padding zeroed
                a = t.amax(dim=(0, 2, 3)) if strategy == "attn_head" else t.amax().reshape(1)
                amax = np.maximum(amax, a.numpy())
            np.testing.assert_allclose(row[f"{base}_amax"], amax, rtol=1e-5)


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_kv_qdq_equals_compressed_tensors(strategy):
    rng = np.random.default_rng(0)
    K, H = 2, 32
    x = (rng.standard_normal((2, K, 8, H)) * np.exp(2 * rng.standard_normal((1, K, 1, H)))).astype(np.float32)
    x[0, :, 0] = 0.0  # a zero token
    amax = np.abs(x).max(axis=(0, 2, 3)) if strategy == "attn_head" else np.abs(x).max().reshape(1)
    scale = kv_scale(amax * 0.5)  # half the range: the largest values clamp to ±448
    shape = (1,) if strategy == "tensor" else (K, 1, 1)
    args = QuantizationArgs.model_validate(kv_cache_args(strategy))
    mod = torch.nn.Module()
    mod.quantization_status = QuantizationStatus.FROZEN
    for base in ("k", "v"):
        mod.register_parameter(f"{base}_scale", torch.nn.Parameter(torch.from_numpy(scale.reshape(shape)),
                                                                   requires_grad=False))
    ref = forward_quantize(mod, torch.from_numpy(x), "k", args).numpy()  # [B, K, S, H], compressed-tensors' layout
    got = np.asarray(quantize_kv_fp8(jnp.asarray(x.transpose(0, 2, 1, 3)), jnp.asarray(scale.reshape(shape))))
    np.testing.assert_array_equal(got.transpose(0, 2, 1, 3), ref)  # ours on [B, T, K, H]
    assert np.abs(ref).max() <= 448 * scale.max() + 1e-6 and rel_err(ref, x) > 1e-3  # clamped, and quantized


def tiny(mod, **kw):
    cfg_cls, model_cls = mod.FAMILY
    return model_cls(cfg_cls.tiny(**kw), rngs=nnx.Rngs(0))


FAMILIES = {
    "llama": (llama, dict(vocab_size=V, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2), ()),
    "qwen3_moe": (qwen3_moe, dict(vocab_size=V, num_hidden_layers=2), ()),
    "gpt_oss": (gpt_oss, dict(vocab_size=V, num_hidden_layers=2, sliding_window=4), (r"re:.*mlp\.experts",)),
    "glm4_moe": (glm4_moe, dict(vocab_size=V, num_hidden_layers=2), ()),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_cached_decoding_equals_full_forward(family, strategy):
    """(e) and (f): the FP8 cache in prefill + one-token decode steps equals the full forward; FP8 moves the
    logits, a little."""
    mod, kw, ignore = FAMILIES[family]
    model = tiny(mod, **kw)
    batches = calibration()
    quantize_model(model, parse_scheme("int8"), batches, ignore=ignore)
    plain = ours(model)
    calibrate_kv_cache(model, batches, strategy)
    full = ours(model)
    cached = decode_logits(model, IDS, split=6)
    err, moved = rel_err(cached, full), rel_err(full, plain)
    rms = float(np.sqrt(np.mean((full - plain) ** 2) / np.mean(plain**2)))  # relative RMS change
    print(f"{family} {strategy}: cached vs full {err:.2e}; FP8 KV moved the logits by {moved:.2e} (max), "
          f"{rms:.2e} (RMS)")
    assert err <= 1e-5
    # E4M3 keeps 3 mantissa bits (up to 6 % per value): ~2 % RMS on the dense random model; in the MoE ones the
    # changed K / V also flip some top-k routings (the tiny GPT-OSS moves 22 % (max) under int8 weights alone)
    assert moved >= 1e-4 and rms <= (0.05 if family == "llama" else 0.2)


def test_mla_and_bad_strategy_refused():
    model = tiny(deepseek_v3, vocab_size=V, num_hidden_layers=2)
    with pytest.raises(ValueError, match=r"DeepseekV3 uses multi-head latent attention .* GQA families only"):
        calibrate_kv_cache(model, calibration(), "tensor")
    with pytest.raises(ValueError, match=r"kv_cache strategy 'channel'"):
        calibrate_kv_cache(tiny(llama, vocab_size=V), calibration(), "channel")


def test_stage_config_errors():
    from tasks.configs import QuantizeConfig
    from tasks.recipe import ConfigError, apply_overrides

    with pytest.raises(ConfigError, match=r"kv_cache: kv_cache must be null .* or 'fp8'.*got 'fp16'"):
        apply_overrides(QuantizeConfig(), ["kv_cache=fp16"])
    with pytest.raises(ConfigError, match=r"kv_cache_strategy must be 'tensor' .* or 'attn_head'.*got 'channel'"):
        apply_overrides(QuantizeConfig(), ["kv_cache_strategy=channel"])
    cfg = apply_overrides(QuantizeConfig(), ["kv_cache=fp8", "kv_cache_strategy=attn_head"])
    assert (cfg.kv_cache, cfg.kv_cache_strategy) == ("fp8", "attn_head")


def test_quantize_stage_and_eval_report(tmp_path):
    """The stage with `kv_cache: fp8`: every scheme's checkpoint carries the scales and kv_cache_scheme (the
    fp8-block DeepSeek-layout copy, whose format has none, keeps the serving dtype); the eval report row names the
    KV cache and its bytes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks import quantize as stage
    from tasks.configs import CalibrationConfig, QuantizeConfig
    from tasks.evaluate import markdown

    model = tiny(llama, vocab_size=V, hidden_size=128, intermediate_size=256, head_dim=32)
    save_pretrained(model, str(tmp_path / "model"))
    data = tmp_path / "data"
    data.mkdir()
    rows = np.random.default_rng(0).integers(1, V, (4, 32)).tolist()
    col = lambda v: pa.array(v, pa.list_(pa.int32()))  # noqa: E731
    ones = [[1] * 32] * 4
    pq.write_table(pa.table({"input_ids": col(rows), "target_ids": col(rows), "positions": col([list(range(32))] * 4),
                             "segment_ids": col(ones), "loss_mask": col(ones)}), data / "train-00000.parquet")
    cfg = QuantizeConfig(schemes=("int8", "fp8-block"), kv_cache="fp8", kv_cache_strategy="attn_head",
                         calibration=CalibrationConfig(samples=4, batch_size=2, min_tokens=64))
    stage.check_fits(cfg, model)
    stats = stage.quantize(cfg, tmp_path / "model", data, tmp_path / "out")
    for name in cfg.schemes:
        assert stats[name]["kv_cache"] == "fp8-attn_head" and stats[name]["kv_bytes_ratio_vs_bf16"] == 0.5
        with open(tmp_path / "out" / name / "config.json") as f:
            assert json.load(f)["quantization_config"]["kv_cache_scheme"]["strategy"] == "attn_head"
        assert kv_cache_strategy(from_pretrained(str(tmp_path / "out" / name))) == "attn_head"
        report = json.loads((tmp_path / "out" / name / "quantization_report.json").read_text())
        assert len(report["kv_cache_calibration"]["layers"]) == model.config.num_hidden_layers
    deepseek = tmp_path / "out" / "fp8-block" / "deepseek"
    assert not read_scales(str(deepseek)) and kv_cache_strategy(from_pretrained(str(deepseek))) is None
    row = {"perplexity": 10.0, "perplexity_increase": 0.01, "kl": 1e-3, "kl_p99": 1e-2, "kl_max": 0.1,
           "top1_flip_rate": 0.01, "kv_cache": "fp8-attn_head", "kv_bytes_ratio_vs_bf16": 0.5}
    md = markdown({"perplexity": {"finetuned": 10.0}, "quantization": {"int8": row}, "gates": []})
    assert "| KV cache |" in md and "| fp8-attn_head (0.50x) |" in md

    with pytest.raises(ValueError, match="multi-head latent attention"):
        stage.check_fits(cfg, tiny(deepseek_v3, vocab_size=V, num_hidden_layers=2))
    float_model = tiny(llama, vocab_size=V)
    calibrate_kv_cache(float_model, calibration(), "tensor")
    with pytest.raises(ValueError, match="quantize the weights too"):
        save_pretrained(float_model, str(tmp_path / "float-kv"))
