"""FP4 weights (NVFP4, MXFP4) against compressed-tensors 0.20.1 and transformers.

Reference: docs/quantization.md (FP4) and docs/formats/compressed-tensors.md (`nvfp4-pack-quantized`,
`mxfp4-pack-quantized`). Checked here:
* our scales, global scales and E2M1 codes equal compressed-tensors' own `calculate_qparams` /
  `generate_gparam` / `quantize` bit for bit, on weights with outlier rows, an all-zero group, subnormal and
  signed-zero values;
* the checkpoint `save_pretrained` writes decompresses through compressed-tensors' own compressors
  (`NVFP4PackedCompressor`, `MXFP4PackedCompressor`) to our dequantized weights, and their `compress` of our
  float weights with our scales packs the same bytes;
* transformers (dequantize=True: it has no CPU FP4 kernel) reproduces our quantized model's logits. Its
  NVFP4 decompression rounds the dequantized weights to bfloat16 (`unpack_fp4_from_uint8`'s default dtype),
  so NVFP4 is compared with our model holding those bf16-rounded weights; MXFP4's weights (E2M1 times a power
  of two) are exact in bf16 and compare with our model as it is. Control: the float model is far off.
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
from compressed_tensors.compressors.mxfp4 import MXFP4PackedCompressor
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam
from flax import nnx
from parity_helpers import (
    QUANT_LLAMA,
    QUANT_QWEN3_MOE,
    bf16_rounded,
    build_from_config,
    calibration_batches,
    hf_logits,
    rel_err,
)
from transformers import CompressedTensorsConfig

from models import from_pretrained, jit_forward, parse_scheme, quantize_model, save_pretrained
from models.layers import Linear
from models.moe import Experts
from models.quant import quant_units
from models.quant import quantizers as Q
from models.quant.targets import Unit, check_divisible

pytestmark = pytest.mark.parity
V = 128
IDS = np.random.default_rng(0).integers(0, V, (2, 16)).astype(np.int32)
TOL = 1e-5
QUANT_MOVES = 1e-2
PRESET = {"nvfp4a16": "NVFP4A16", "mxfp4a16": "MXFP4A16"}
COMPRESSOR = {"nvfp4a16": NVFP4PackedCompressor, "mxfp4a16": MXFP4PackedCompressor}

LLAMA, QWEN3_MOE = QUANT_LLAMA, QUANT_QWEN3_MOE


def hard_weight(seed: int = 0) -> np.ndarray:
    """[64, 128] float32: rows spanning e^±9 (outlier channels), an all-zero group, subnormals, -0."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((64, 128)) * np.exp(3 * rng.standard_normal((64, 1)))).astype(np.float32)
    w[0, :32] = 0.0
    w[1, 3] = 1e-30
    w[2, :32] = 1e-40  # subnormal
    w[3, :32] = 0.75 * 2.0 ** -126  # rounds up to the smallest normal power of two
    w[4, :32] = -0.0
    w[5, 40] = 3e4  # one outlier in a group
    return w


@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
def test_scales_and_codes_equal_compressed_tensors(scheme):
    w = hard_weight()
    args = preset_name_to_scheme(PRESET[scheme], ["Linear"]).weights
    t = torch.from_numpy(w)
    groups = t.reshape(t.shape[0], -1, args.group_size)
    g = generate_gparam(t.min(), t.max()) if scheme == "nvfp4a16" else None
    scale, zero = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=g)
    codes = quantize(t, scale, zero, args, global_scale=g)
    ref = dequantize(codes, scale, zero, args, global_scale=g)

    ours = Q.nvfp4(w) if scheme == "nvfp4a16" else Q.mxfp4(w)
    if g is not None:
        np.testing.assert_array_equal(ours.global_scale, g.numpy())
    np.testing.assert_array_equal(ours.scale, scale.float().numpy())
    np.testing.assert_array_equal(ours.q, codes.float().numpy())
    np.testing.assert_array_equal(np.signbit(ours.q), np.signbit(codes.float().numpy()))  # -0 codes too
    np.testing.assert_array_equal(Q.dequantize_fp4(ours.q, ours.scale, ours.global_scale), ref.float().numpy())
    assert len(np.unique(np.abs(ours.q))) == 8  # every E2M1 magnitude occurs: the test covers the grid


def test_round_e2m1_ties_go_to_the_even_code():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 7.0, -0.1, 0.26], np.float32)
    got = Q.round_e2m1(x)
    np.testing.assert_array_equal(got, [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0, 6.0, -0.0, 0.5])
    assert np.signbit(got[-2]) and not np.signbit(Q.round_e2m1(np.float32([-0.0]))[0])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    cache: dict[str, tuple[str, np.ndarray]] = {}

    def make(arch: str) -> tuple[str, np.ndarray]:
        if arch not in cache:
            cfg = transformers.LlamaConfig(**LLAMA) if arch == "llama" else transformers.Qwen3MoeConfig(**QWEN3_MOE)
            hf = build_from_config(cfg, seed=0)
            path = str(tmp_path_factory.mktemp(arch))
            hf.save_pretrained(path)
            cache[arch] = (path, hf_logits(hf, IDS))
        return cache[arch]

    return make


def ours(model) -> np.ndarray:
    return np.asarray(jit_forward(model)(jnp.asarray(IDS)))


def read_file(path: str) -> dict[str, torch.Tensor]:
    with safetensors.safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def calibration() -> list[tuple[np.ndarray, np.ndarray]]:
    return calibration_batches(V)


@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16", "nvfp4a16-gptq"])
def test_dense_export_decompresses_bit_for_bit_and_loads_in_transformers(checkpoint, tmp_path, scheme):
    path, float_logits = checkpoint("llama")
    model = from_pretrained(path)
    gptq = scheme.endswith("-gptq")
    report = quantize_model(model, parse_scheme(scheme), calibration() if gptq else [])
    assert {r["method"] for r in report["modules"]} == {"gptq" if gptq else "rtn"}
    scheme = scheme.removesuffix("-gptq")  # the same format on disk
    out = str(tmp_path / scheme)
    save_pretrained(model, out)

    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    QuantizationConfig.model_validate(qc)
    assert qc["format"] == f"{scheme[:5]}-pack-quantized"
    (group,) = qc["config_groups"].values()
    cscheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    tensors = read_file(out)
    linears = {u.name: u.module for u in quant_units(model)}
    floats = {u.name: u.module for u in quant_units(from_pretrained(path))}
    names = ("weight_packed", "weight_scale") + (("weight_global_scale",) if scheme == "nvfp4a16" else ())
    for name, lin in linears.items():
        state = {k: tensors[f"{name}.{k}"] for k in names}
        assert state["weight_packed"].dtype == torch.uint8
        assert state["weight_scale"].dtype == (torch.float8_e4m3fn if scheme == "nvfp4a16" else torch.uint8)
        got = COMPRESSOR[scheme].decompress(state, cscheme)["weight"]  # [out, in], bf16
        mine = np.asarray(lin.weight()).T  # [out, in] float32
        np.testing.assert_array_equal(got.float().numpy(), mine.astype(jnp.bfloat16).astype(np.float32))
        if scheme == "mxfp4a16":  # exact in bf16: the decompressed weight is ours without rounding
            np.testing.assert_array_equal(got.float().numpy(), mine)
        if gptq:  # GPTQ's codes are not the float weight's nearest: compress's packing is checked by RTN
            continue
        # compressed-tensors' own compress of the float weight with our scales packs the same bytes
        float_w = torch.from_numpy(np.ascontiguousarray(np.asarray(floats[name].weight()).T))  # [out, in]
        scale = torch.from_numpy(np.asarray(lin.scale[...], np.float32).T.copy())
        if scheme == "mxfp4a16":
            scale = scale.to(torch.bfloat16)  # compress's E8M0 encoding takes the float scale
        sd = {"weight": float_w, "weight_scale": scale}
        if scheme == "nvfp4a16":
            sd["weight_global_scale"] = torch.from_numpy(np.array(lin.qglobal[...], np.float32))
        packed = COMPRESSOR[scheme].compress(sd, cscheme)
        assert torch.equal(packed["weight_packed"], state["weight_packed"]), name
        assert torch.equal(packed["weight_scale"].view(torch.uint8), state["weight_scale"].view(torch.uint8)), name

    # fused projections share one NVFP4 global scale (engines fuse q/k/v and gate/up into one GEMM)
    if scheme == "nvfp4a16":
        for layer in range(LLAMA["num_hidden_layers"]):
            p = f"model.layers.{layer}"
            qkv = {float(tensors[f"{p}.self_attn.{x}_proj.weight_global_scale"]) for x in "qkv"}
            gu = {float(tensors[f"{p}.mlp.{x}_proj.weight_global_scale"]) for x in ("gate", "up")}
            assert len(qkv) == 1 and len(gu) == 1
            w = np.concatenate([np.asarray(linears[f"{p}.self_attn.{x}_proj"].weight()) for x in "qkv"], 1)
            assert qkv == {float(Q.nvfp4_global_scale(np.abs(w).max())[0])}

    mine = ours(model)
    np.testing.assert_array_equal(ours(from_pretrained(out)), mine)  # our own load: the same model
    ref = ours(bf16_rounded(model)) if scheme == "nvfp4a16" else mine
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32,
        quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    err, moved = rel_err(hf_logits(hf, IDS), ref), rel_err(mine, float_logits)
    print(f"{scheme}: transformers vs ours {err:.2e}; quantization moved the logits {moved:.2e}")
    assert err <= TOL and moved >= QUANT_MOVES


@pytest.mark.parametrize("scheme", ["nvfp4a16", "mxfp4a16"])
def test_moe_experts_per_expert_with_shared_gate_up_global_scale(checkpoint, tmp_path, scheme):
    """Experts quantized and written one by one; each expert's gate/up share one NVFP4 global scale."""
    path, float_logits = checkpoint("qwen3_moe")
    model = from_pretrained(path)
    quantize_model(model, parse_scheme(scheme), [])
    out = str(tmp_path / scheme)
    save_pretrained(model, out)
    tensors = read_file(out)
    experts = [u.module for u in quant_units(model) if isinstance(u.module, Experts)]
    assert experts and all(ex.quantized for ex in experts)
    with open(os.path.join(out, "config.json")) as f:
        (group,) = json.load(f)["quantization_config"]["config_groups"].values()
    cscheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    names = ("weight_packed", "weight_scale") + (("weight_global_scale",) if scheme == "nvfp4a16" else ())
    I = QWEN3_MOE["moe_intermediate_size"]
    for layer, ex in enumerate(experts):
        mlp = f"model.layers.{layer}.mlp"
        gate_up, down = (np.asarray(w) for w in ex.weights())  # [E, D, 2I], [E, I, D]
        for e in range(QWEN3_MOE["num_experts"]):
            if scheme == "nvfp4a16":
                assert torch.equal(tensors[f"{mlp}.experts.{e}.gate_proj.weight_global_scale"],
                                   tensors[f"{mlp}.experts.{e}.up_proj.weight_global_scale"])
            parts = (("gate_proj", gate_up[e, :, :I]), ("up_proj", gate_up[e, :, I:]), ("down_proj", down[e]))
            for proj, mine in parts:  # mine [in, out]
                state = {k: tensors[f"{mlp}.experts.{e}.{proj}.{k}"] for k in names}
                got = COMPRESSOR[scheme].decompress(state, cscheme)["weight"]  # [out, in], bf16
                np.testing.assert_array_equal(got.float().numpy(), mine.T.astype(jnp.bfloat16).astype(np.float32))
        assert tensors[f"{mlp}.gate.weight"].dtype == torch.float32  # the router stays float
    mine = ours(model)
    np.testing.assert_array_equal(ours(from_pretrained(out)), mine)
    assert rel_err(mine, float_logits) >= QUANT_MOVES
    if scheme == "mxfp4a16":  # exact in bf16: transformers' decompressed experts are ours
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            out, attn_implementation="eager", dtype=torch.float32,
            quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
        # transformers keeps the merged, decompressed experts in their bf16 and runs them in bf16; their values
        # are exact, so in float32 the model is ours
        hf = hf.float()
        assert rel_err(hf_logits(hf, IDS), mine) <= TOL


def test_group_size_must_divide_every_input_width():
    lin = Linear(48, 64, axes=("embed", "mlp"), rngs=nnx.Rngs(0))
    unit = Unit("model.layers.0.mlp.down_proj", ("layers", 0, "mlp", "down_proj"), lin)
    check_divisible([unit], parse_scheme("nvfp4a16"))  # 16 divides 48
    with pytest.raises(ValueError, match="group size 32 does not divide model.layers.0.mlp.down_proj's input width 48"):
        check_divisible([unit], parse_scheme("mxfp4a16"))
