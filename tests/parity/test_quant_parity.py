"""Our quantized checkpoints (models/quant/ + `save_pretrained`) loaded by the reference libraries.

Reference: docs/formats/compressed-tensors.md (`pack-quantized` / `float-quantized`),
docs/formats/deepseek-fp8.md (DeepSeek block FP8) and docs/quantization.md (MoE). Each test builds a tiny random
transformers model, loads it with our `from_pretrained`, quantizes it in place with `quantize_model`
(calibrated on random tokens with padding), saves it with our `save_pretrained`, loads that folder with
transformers 5.24 + compressed-tensors 0.20.1 and asserts transformers' logits equal *our quantized
model's* to 1e-4 relative error — while both differ from the float model's by far more, so a checkpoint
that silently held float (or differently rounded) weights would fail.

What transformers can load on CPU (measured; docs/formats/compressed-tensors.md), and therefore what is tested:
* symmetric int `pack-quantized` (dense and per-expert MoE): plain `from_pretrained`;
* asymmetric int: only with `CompressedTensorsConfig(dequantize=True)` and only for dense models — the
  default path allocates an unpacked int8 zero point, and the MoE expert path never reads zero points;
* FP8 128x128 `float-quantized` with weight-only activations: plain `from_pretrained`;
* DeepSeek native FP8 (`weight_scale_inv`): transformers infers the block edge from the scale grid
  (rows // scale_rows), so only models whose every dim is <= 128 or a multiple of 128 load correctly.
The int8 per-channel round trip is covered by test_adapter_quant_parity.py and not repeated here.
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
from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from parity_helpers import build_from_config, calibration_batches, hf_logits, rel_err
from transformers import CompressedTensorsConfig

from models import from_pretrained, jit_forward, parse_scheme, quantize_model, save_pretrained
from models.layers import Linear
from models.quant import quant_units

pytestmark = pytest.mark.parity
V = 128
IDS = np.random.default_rng(0).integers(0, V, (2, 16)).astype(np.int32)
TOL = 1e-4
QUANT_MOVES = 1e-2  # quantization must move the logits by at least 100x the parity tolerance

# hidden 256 (default group 128 and FP8 128x128 tiles divide it), 4 heads of 64, 2 kv heads (k/v: 128 rows)
LLAMA = dict(vocab_size=V, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-5)
# every input width a multiple of 32 (the MoE tests' group)
QWEN3_MOE = dict(vocab_size=V, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
                 norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-5)
DEEPSEEK_V3 = dict(vocab_size=V, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                   qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                   n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=256, rms_norm_eps=1e-5)


def calibration(n: int = 2, b: int = 2, t: int = 32, seed: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """n random (input_ids [b, t], segment_ids [b, t]) batches; row 0's tail is padding (segment 0)."""
    return calibration_batches(V, n, b, t, seed, pad=5)


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    """name -> (path, float logits [2, 16, V]) of a tiny random transformers model, built once per module."""
    configs = {"llama": (transformers.LlamaConfig, LLAMA), "qwen3_moe": (transformers.Qwen3MoeConfig, QWEN3_MOE),
               "deepseek_v3": (transformers.DeepseekV3Config, DEEPSEEK_V3)}
    cache: dict[str, tuple[str, np.ndarray]] = {}

    def make(name: str) -> tuple[str, np.ndarray]:
        if name not in cache:
            config_cls, kw = configs[name]
            hf = build_from_config(config_cls(**kw), seed=0)
            path = str(tmp_path_factory.mktemp(name))
            hf.save_pretrained(path)
            cache[name] = (path, hf_logits(hf, IDS))
        return cache[name]

    return make


def quantized(path: str, scheme: str):
    """Our model from `path`, quantized in place with `scheme` on random calibration batches."""
    model = from_pretrained(path)
    report = quantize_model(model, parse_scheme(scheme), calibration())
    assert report["modules"]
    return model


def ours(model) -> np.ndarray:
    return np.asarray(jit_forward(model)(jnp.asarray(IDS)))


def hf_reload(path: str, **kw) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                             dtype=torch.float32, **kw).eval()
    return hf_logits(model, IDS)


def read_file(path: str) -> dict[str, torch.Tensor]:
    with safetensors.safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def qconfig(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    QuantizationConfig.model_validate(qc)  # the library accepts our config.json block
    return qc


def assert_parity(model, path: str, float_logits: np.ndarray, **kw) -> float:
    """transformers' logits on our folder == our quantized model's; both far from the float model's."""
    mine = ours(model)
    err = rel_err(hf_reload(path, **kw), mine)
    moved = rel_err(mine, float_logits)
    print(f"{os.path.basename(path)}: transformers vs ours {err:.2e}, quantization moved logits {moved:.2e}")
    assert err <= TOL
    assert moved >= QUANT_MOVES
    return err


# ------------------------------------------------------------------------------------------------
# Dense Llama: int4 GPTQ (symmetric / asymmetric + actorder), AWQ, FP8 blocks
# ------------------------------------------------------------------------------------------------


def test_w4a16_gptq_loads_in_transformers(float_checkpoint, tmp_path):
    path, float_logits = float_checkpoint("llama")
    model = quantized(path, "w4a16-gptq")
    out = str(tmp_path / "w4a16-gptq")
    save_pretrained(model, out)

    qc = qconfig(out)
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed"
    (group,) = qc["config_groups"].values()
    w = group["weights"]
    assert (w["num_bits"], w["type"], w["strategy"], w["group_size"], w["symmetric"]) == (4, "int", "group", 128, True)
    assert group["input_activations"] is None and "lm_head" in qc["ignore"]

    tensors = read_file(out)
    q = tensors["model.layers.0.mlp.down_proj.weight_packed"]
    assert q.dtype == torch.int32 and tuple(q.shape) == (256, 512 * 4 // 32)
    assert tuple(tensors["model.layers.0.mlp.down_proj.weight_scale"].shape) == (256, 512 // 128)
    assert "model.layers.0.mlp.down_proj.weight" not in tensors and tensors["lm_head.weight"].is_floating_point()
    assert_parity(model, out, float_logits)


def test_w4a16_asym_actorder_decompresses_and_loads(float_checkpoint, tmp_path):
    """Asymmetric: transformers' default path allocates an unpacked int8 zero point and refuses the packed
    int32 one compressed-tensors itself writes, so the load goes through `dequantize=True`."""
    path, float_logits = float_checkpoint("llama")
    model = quantized(path, "w4a16-asym-gptq-actorder-g64")
    out = str(tmp_path / "w4a16-asym")
    save_pretrained(model, out)

    qc = qconfig(out)
    (group,) = qc["config_groups"].values()
    w = group["weights"]
    assert (w["num_bits"], w["strategy"], w["group_size"], w["symmetric"], w["actorder"]) == (4, "group", 64, False,
                                                                                             "weight")
    scheme = QuantizationScheme(targets=group["targets"], weights=w)
    tensors = read_file(out)
    linears = {".".join(map(str, u.path)): u.module for u in quant_units(model) if isinstance(u.module, Linear)}
    for rel in ("layers.0.self_attn.k_proj", "layers.1.mlp.down_proj"):
        name = f"model.{rel}"
        state = {k: tensors[f"{name}.{k}"] for k in ("weight_packed", "weight_scale", "weight_shape",
                                                     "weight_zero_point")}
        assert state["weight_zero_point"].dtype == torch.int32
        got = PackedQuantizationCompressor.decompress(state, scheme)["weight"]  # [out, in]
        np.testing.assert_array_equal(got.numpy(), np.asarray(linears[rel].weight()).T)
    assert_parity(model, out, float_logits, quantization_config=CompressedTensorsConfig(dequantize=True))


def test_w4a16_awq_folded_norms_load_in_transformers(float_checkpoint, tmp_path):
    """AWQ folds its scales into the RMSNorm weights (and up_proj's rows): the float norms on disk carry them."""
    path, float_logits = float_checkpoint("llama")
    model = quantized(path, "w4a16-awq-g64")
    out = str(tmp_path / "w4a16-awq")
    save_pretrained(model, out)
    original, tensors = read_file(path), read_file(out)
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(tensors[norm], original[norm])  # the fold reached the file
    assert_parity(model, out, float_logits)


def test_fp8_block_compressed_tensors_and_deepseek_layouts(float_checkpoint, tmp_path):
    path, float_logits = float_checkpoint("llama")
    model = quantized(path, "fp8-block")
    mine = ours(model)

    ct = str(tmp_path / "fp8-ct")
    save_pretrained(model, ct)
    qc = qconfig(ct)
    assert qc["format"] == "float-quantized"
    (group,) = qc["config_groups"].values()
    assert group["weights"]["strategy"] == "block" and group["weights"]["block_structure"] == [128, 128]
    assert group["input_activations"] is None  # weight-only: no CPU activation fake-quant in transformers
    tensors = read_file(ct)
    assert tensors["model.layers.0.mlp.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert tuple(tensors["model.layers.0.mlp.gate_proj.weight_scale"].shape) == (4, 2)  # [512/128, 256/128]
    assert_parity(model, ct, float_logits)

    ds = str(tmp_path / "fp8-deepseek")
    save_pretrained(model, ds, layout="deepseek-fp8")
    with open(os.path.join(ds, "config.json")) as f:
        assert json.load(f)["quantization_config"]["quant_method"] == "fp8"
    tensors = read_file(ds)
    assert tuple(tensors["model.layers.0.self_attn.k_proj.weight_scale_inv"].shape) == (1, 2)  # [128/128, 256/128]
    assert rel_err(hf_reload(ds), mine) <= TOL
    assert rel_err(ours(from_pretrained(ds)), mine) <= 1e-5  # ours dequantizes on load: same weights


# ------------------------------------------------------------------------------------------------
# MoE: per-expert symmetric W4A16, routers left in float
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3_moe", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_moe_w4a16_gptq_per_expert(float_checkpoint, tmp_path, arch):
    """Experts are quantized and written one by one (transformers merges and dequantizes them on load);
    asymmetric experts would not load (transformers' expert path never reads zero points), so symmetric."""
    path, float_logits = float_checkpoint(arch)
    model = quantized(path, "w4a16-gptq-g32")
    out = str(tmp_path / arch)
    save_pretrained(model, out)

    qc = qconfig(out)
    assert r"re:.*mlp\.gate$" in qc["ignore"] and "lm_head" in qc["ignore"]
    tensors = read_file(out)
    cfg = QWEN3_MOE if arch == "qwen3_moe" else DEEPSEEK_V3
    E = cfg.get("num_experts") or cfg["n_routed_experts"]
    first = cfg.get("first_k_dense_replace", 0)
    for layer in range(first, cfg["num_hidden_layers"]):
        mlp = f"model.layers.{layer}.mlp"
        for e in range(E):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert tensors[f"{mlp}.experts.{e}.{proj}.weight_packed"].dtype == torch.int32
                assert f"{mlp}.experts.{e}.{proj}.weight" not in tensors
        assert tensors[f"{mlp}.gate.weight"].dtype == torch.float32  # the router stays float
        assert not any(k.startswith(f"{mlp}.gate.weight_") for k in tensors)
    if arch == "deepseek_v3":
        assert "model.layers.1.mlp.shared_experts.down_proj.weight_packed" in tensors
        assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_packed" in tensors
    assert_parity(model, out, float_logits)
