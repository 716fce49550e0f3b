"""Quantized activations (fp8-dynamic, int8-w8a8 with SmoothQuant, w4afp8, W4A4 nvfp4 / mxfp4) against
compressed-tensors 0.20.1 and transformers.

Reference: docs/quantization.md (activation quantization, SmoothQuant) and docs/formats/compressed-tensors.md.
Checked here:
* our activation quantize-dequantize (models/numerics.py) equals compressed-tensors' own `forward_quantize`
  with each preset's input args bit for bit, on activations with outlier channels and all-zero tokens/groups;
* a quantized dense model's export: the reference is transformers' decompressed model with compressed-tensors'
  `forward_quantize` on every quantized Linear's input (transformers' CPU path cannot run int8 or FP4
  weights compressed), its NVFP4 global input scales read from our files. Each of our quantized Linears
  on the reference's own inputs gives its outputs (1e-5 relative). End to end, every quantized Linear's input
  and the logits match (1e-5) once the reference resolves each per-token rounding tie as our run did
  (`tie_aligned_quantize`: an element both stacks place within 1e-5 of the row's largest magnitude from the
  boundary between two neighbouring codes; every other code must agree). Unaligned, float summation order
  (~1e-7) moves such ties from one code to its neighbour and the flip compounds through the layers: fp8-dynamic
  7.7e-7 to 9.5e-5 and int8 5e-7 to 9e-3 end to end over three token draws and two XLA:CPU compile settings, against
  1.3e-2 to 7.4e-2 without activation quantization, so the unaligned figure is printed, not bounded. Most int8 ties
  sit at a row's largest negative value, which compressed-tensors' scale amax / 127.5 puts exactly on the
  -127 | -128 boundary. fp8-dynamic and w4afp8 also load through transformers' own compressed path, which gives
  the decompressed reference's logits. Control: our model with activation quantization switched off is far
  from the reference;
* each export's weights decompress through compressed-tensors' own compressors (`FloatQuantizationCompressor`,
  `IntQuantizationCompressor`, `PackedQuantizationCompressor`, NVFP4 / MXFP4) to our dequantized weights bit
  for bit (NVFP4: bf16-rounded, as its decompressor returns them);
* SmoothQuant leaves the float model's function unchanged (logits within 1e-4), for a dense and an MoE family,
  while flattening the activation channels it smooths.
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
from compressed_tensors.compressors.naive_quantized import FloatQuantizationCompressor, IntQuantizationCompressor
from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    QuantizationStatus,
    QuantizationStrategy,
)
from compressed_tensors.quantization.lifecycle.forward import forward_quantize
from compressed_tensors.quantization.quant_args import round_to_quantized_type_args
from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
from compressed_tensors.quantization.utils import calculate_range, compute_dynamic_scales_and_zp
from flax import nnx
from parity_helpers import (
    QUANT_LLAMA,
    QUANT_QWEN3_MOE,
    bf16_rounded,
    calibration_batches,
    checkpoint_maker,
    hf_logits,
    rel_err,
)
from transformers import CompressedTensorsConfig

from models import from_pretrained, jit_forward, parse_scheme, quantize_model, save_pretrained
from models.numerics import nvfp4_global_scale, quantize_activation
from models.quant import quant_units
from models.quant.calibration import _layer_forward, collect_stats
from models.quant.smoothquant import smooth_layer

pytestmark = pytest.mark.parity
V = 128
IDS = np.random.default_rng(0).integers(0, V, (2, 16)).astype(np.int32)
TOL = 1e-5
PRESET = {"fp8": "FP8_DYNAMIC", "int8": "W8A8", "nvfp4": "NVFP4", "mxfp4": "MXFP4"}


def outlier_acts(seed: int = 0) -> np.ndarray:
    """[2, 8, 64] float32 with channel scales spanning e^±6, an all-zero token and an all-zero group."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((2, 8, 64)) * np.exp(2 * rng.standard_normal((1, 1, 64)))).astype(np.float32)
    x[0, 0] = 0.0
    x[0, 1, :32] = 0.0
    return x


@pytest.mark.parametrize("kind", ["fp8", "int8", "nvfp4", "mxfp4"])
def test_activation_qdq_equals_compressed_tensors(kind):
    x = outlier_acts()
    args = preset_name_to_scheme(PRESET[kind], ["Linear"]).input_activations
    mod = torch.nn.Linear(64, 8)
    mod.quantization_status = QuantizationStatus.FROZEN
    g = None
    if kind == "nvfp4":  # static global scale from a calibration max, as llm-compressor's observer gives it
        g = nvfp4_global_scale(np.abs(x).max() * 0.8)
        mod.input_global_scale = torch.nn.Parameter(torch.from_numpy(g), requires_grad=False)
    ref = forward_quantize(mod, torch.from_numpy(x), "input", args).numpy()
    ours = np.asarray(quantize_activation(jnp.asarray(x), kind, None if g is None else jnp.asarray(g)))
    np.testing.assert_array_equal(ours, ref)
    assert rel_err(ours, x) > 1e-3  # it did quantize


def calibration() -> list[tuple[np.ndarray, np.ndarray]]:
    return calibration_batches(V)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_maker(
        tmp_path_factory,
        {
            "llama": lambda: transformers.LlamaConfig(**QUANT_LLAMA),
            "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**QUANT_QWEN3_MOE),
        },
    )


def ours(model) -> np.ndarray:
    return np.asarray(jit_forward(model)(jnp.asarray(IDS)))


_forward_sown = nnx.jit(lambda m, ids: nnx.capture(lambda mm: mm(ids), nnx.Intermediate)(m))


def ours_with_inputs(model) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Our logits [B, T, V] for IDS and, from the same jitted forward, the input [B*T, in] each quantized Linear
    hands its activation quantization (sown just before it: models/layers.py), by HF module name."""
    units = quant_units(model)
    for u in units:
        u.module.calibrating = True
    try:
        logits, sown = _forward_sown(model, jnp.asarray(IDS))
    finally:
        for u in units:
            u.module.calibrating = False
    flat = {
        tuple(str(p) for p in path[:-1]): np.asarray((v.get_value() if hasattr(v, "get_value") else v)[0])
        for path, v in nnx.to_flat_state(sown)
    }
    return np.asarray(logits), {u.name: flat[tuple(str(p) for p in u.path)] for u in units}


def code_grid(args: QuantizationArgs) -> torch.Tensor:
    """Every value of the activation format, ascending: FP8 E4M3 (one zero, no NaN) or int8."""
    if args.type == "float":
        v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        return torch.unique(v[torch.isfinite(v)])
    return torch.arange(-128, 128, dtype=torch.float32)


def tie_aligned_quantize(mod, x: torch.Tensor, mine: torch.Tensor, args: QuantizationArgs) -> tuple[torch.Tensor, int]:
    """compressed-tensors' `forward_quantize` of a per-token input x [B, T, in], with each rounding tie resolved
    as our run resolved it. `mine` [B, T, in] is our model's input at the same Linear, end to end. A tie is an
    element whose reference code and whose code in our run (compressed-tensors' rounding of `mine`, the codes of
    models/numerics.py: test_activation_qdq_equals_compressed_tensors) are neighbours on the code grid, with both
    pre-rounding values within TOL of the row's largest magnitude from the boundary between them: the two stacks'
    inputs differ by float summation order (~1e-7 of it), so which side such an element lands on is not determined
    at the precision this file checks (measured: every tie within 1.2e-7 of the row's largest magnitude from its
    boundary). A tie takes our code times the reference's own scale; any other code difference fails. Grouped
    scales (NVFP4, MXFP4) pass through unaligned. Returns (the quantize-dequantized input [B, T, in], the number
    of ties)."""
    out = forward_quantize(mod, x, "input", args)  # [B, T, in]
    if args.strategy != QuantizationStrategy.TOKEN:
        return out, 0
    lo, hi = calculate_range(args, x.device)
    s, s_mine = compute_dynamic_scales_and_zp(x, args, mod)[0], compute_dynamic_scales_and_zp(mine, args, mod)[0]
    y, y_mine = x / s, mine / s_mine  # [B, T, in]: what each stack rounds (s: [B, T, 1])
    q, q_mine = round_to_quantized_type_args(y, args, lo, hi), round_to_quantized_type_args(y_mine, args, lo, hi)
    assert torch.equal(q * s, out)  # the reference's own codes
    grid = code_grid(args)
    neighbours = (torch.searchsorted(grid, q) - torch.searchsorted(grid, q_mine)).abs() == 1
    mid = (q + q_mine) / 2  # round to nearest: the boundary between two neighbouring codes
    w = TOL * y.abs().amax(-1, keepdim=True)  # [B, T, 1]
    tie = neighbours & ((y - mid).abs() <= w) & ((y_mine - mid).abs() <= w)
    differ = q != q_mine
    assert torch.equal(tie, differ), f"{int((differ & ~tie).sum())} activation codes differ away from a tie"
    return torch.where(tie, q_mine * s, out), int(tie.sum())


def with_reference_input_quant(
    hf, path: str, qc: dict, seen: dict, mine: dict | None = None, ties: dict | None = None
) -> None:
    """Run compressed-tensors' own `forward_quantize` on the input of every Linear the config quantizes
    (NVFP4: with the `input_global_scale` our files hold); `seen[name]` collects (input before
    quantization, output) of each call. With `mine` (our inputs [B*T, in] by name, `ours_with_inputs`),
    rounding ties are resolved as ours (`tie_aligned_quantize`), their count in `ties[name]`."""
    (group,) = qc["config_groups"].values()
    args = QuantizationArgs.model_validate(group["input_activations"])
    with safetensors.safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        globals_ = {
            k.removesuffix(".input_global_scale"): f.get_tensor(k)
            for k in f.keys()
            if k.endswith(".input_global_scale")
        }

    def aligned(m, x: torch.Tensor, name: str) -> tuple[torch.Tensor]:
        qdq, ties[name] = tie_aligned_quantize(m, x, torch.from_numpy(mine[name]).reshape(x.shape), args)
        return (qdq,)

    hooked = 0
    for name, mod in hf.named_modules():
        if not isinstance(mod, torch.nn.Linear) or name == "lm_head":
            continue
        mod.quantization_status = QuantizationStatus.FROZEN
        if name in globals_:
            mod.input_global_scale = torch.nn.Parameter(globals_[name], requires_grad=False)
        mod.register_forward_pre_hook(lambda m, inp, n=name: seen.__setitem__(n, [inp[0].detach().clone()]))
        if mine is None:
            mod.register_forward_pre_hook(lambda m, inp: (forward_quantize(m, inp[0], "input", args),))
        else:
            mod.register_forward_pre_hook(lambda m, inp, n=name: aligned(m, inp[0], n))
        mod.register_forward_hook(lambda m, inp, out, n=name: seen[n].append(out.detach().clone()))
        hooked += 1
    assert hooked == 7 * QUANT_LLAMA["num_hidden_layers"]


@pytest.mark.parametrize(
    "scheme", ["fp8-dynamic", "int8-w8a8-gptq", "int8-w8a8-nosmooth", "w4afp8-g64", "nvfp4", "mxfp4"]
)
def test_dense_export_matches_compressed_tensors_activation_quantization(checkpoint, tmp_path, scheme):
    path = checkpoint("llama")
    model = from_pretrained(path)
    report = quantize_model(model, parse_scheme(scheme), calibration())
    assert bool(report["smoothquant"]) == (scheme.startswith("int8-w8a8") and not scheme.endswith("nosmooth"))
    out = str(tmp_path / scheme)
    save_pretrained(model, out)
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    QuantizationConfig.model_validate(qc)
    mine = ours(model)
    np.testing.assert_array_equal(ours(from_pretrained(out)), mine)  # our own load: the same model

    off = nnx.clone(model)  # control: the same weights without activation quantization
    for u in quant_units(off):
        u.module.input_quant = None
    weight_only = ours(off)

    def reference(dequantize: bool = True):  # transformers' model of the export
        if not dequantize:  # its own compressed path (quantized weights, compressed-tensors' input quantization)
            return transformers.AutoModelForCausalLM.from_pretrained(
                out, attn_implementation="eager", dtype=torch.float32
            ).eval()
        config = CompressedTensorsConfig(dequantize=True)  # decompressed (NVFP4 to bf16)
        return (
            transformers.AutoModelForCausalLM.from_pretrained(
                out, attn_implementation="eager", dtype=torch.float32, quantization_config=config
            )
            .eval()
            .float()
        )

    # the reference: compressed-tensors' input quantization on every Linear
    hf = reference()
    seen: dict[str, list] = {}
    with_reference_input_quant(hf, out, qc, seen)
    ref = hf_logits(hf, IDS)
    # NVFP4's decompressor rounds the weights to bf16: compare with our model holding those weights
    same_weights = bf16_rounded(model) if scheme == "nvfp4" else model
    # every quantized Linear on the reference's own inputs: the same quantized GEMM
    modules = {u.name: u.module for u in quant_units(same_weights)}
    for name, (x, y) in seen.items():
        got = np.asarray(modules[name](jnp.asarray(x.numpy())))
        assert rel_err(got, y.numpy()) <= TOL, name

    # end to end, the reference's rounding ties resolved as ours (module docstring): every Linear's input, the logits
    logits, inputs = ours_with_inputs(same_weights)
    hf = reference()
    aligned_seen: dict[str, list] = {}
    ties: dict[str, int] = {}
    with_reference_input_quant(hf, out, qc, aligned_seen, inputs, ties)
    aligned = hf_logits(hf, IDS)
    for name, (x, _) in aligned_seen.items():
        assert rel_err(inputs[name], x.numpy().reshape(inputs[name].shape)) <= TOL, name
    err, control = rel_err(logits, aligned), rel_err(weight_only, ref)
    print(
        f"{scheme}: ours vs compressed-tensors {err:.2e} with {sum(ties.values())} rounding ties aligned "
        f"({rel_err(logits, ref):.2e} unaligned); without activation quantization {control:.2e}"
    )
    assert err <= TOL and control >= 10 * TOL
    if scheme in ("fp8-dynamic", "w4afp8-g64"):  # transformers' own compressed path runs these on CPU too
        assert rel_err(hf_logits(reference(dequantize=False), IDS), ref) <= TOL


COMPRESSORS = {
    "fp8-dynamic": FloatQuantizationCompressor,
    "int8-w8a8": IntQuantizationCompressor,
    "w4afp8-g64": PackedQuantizationCompressor,
    "nvfp4": NVFP4PackedCompressor,
    "mxfp4": MXFP4PackedCompressor,
}


@pytest.mark.parametrize("scheme", list(COMPRESSORS))
def test_export_decompresses_through_compressed_tensors_bit_for_bit(checkpoint, tmp_path, scheme):
    model = from_pretrained(checkpoint("llama"))
    quantize_model(model, parse_scheme(scheme), calibration())
    save_pretrained(model, str(tmp_path))
    with open(os.path.join(tmp_path, "config.json")) as f:
        (group,) = json.load(f)["quantization_config"]["config_groups"].values()
    cscheme = QuantizationScheme(
        targets=group["targets"], weights=group["weights"], input_activations=group["input_activations"]
    )
    with safetensors.safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    for u in quant_units(model):
        state = {
            k.removeprefix(f"{u.name}."): v
            for k, v in tensors.items()
            if k.startswith(f"{u.name}.") and not k.endswith((".bias", "input_global_scale"))
        }
        got = COMPRESSORS[scheme].decompress(state, cscheme)["weight"].float().numpy()  # [out, in]
        mine = np.asarray(u.module.weight()).T
        if scheme == "nvfp4":  # compressed-tensors decompresses NVFP4 to bf16
            mine = mine.astype(jnp.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(got, mine, err_msg=u.name)


def _smooth_all(model, batches):
    xs = [model.embed_tokens(jnp.asarray(ids)) for ids, _ in batches]
    segs = [jnp.asarray(seg, jnp.int32) for _, seg in batches]
    units = quant_units(model)
    rows = []
    for i in range(model.config.num_hidden_layers):
        lu = [u for u in units if u.layer == i]
        rows += smooth_layer(model.layers[i], i, collect_stats(model, xs, segs, i, lu), lu, 0.5)
        xs = [_layer_forward(model, x, s, i) for x, s in zip(xs, segs, strict=True)]
    return rows


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_smoothquant_keeps_the_float_function(checkpoint, arch):
    path = checkpoint(arch)
    model = from_pretrained(path)
    before = ours(model)
    norm0 = np.asarray(model.layers[0].post_attention_layernorm.weight[...]).copy()
    rows = _smooth_all(model, calibration())
    assert len(rows) == 2 * 2  # input_layernorm and post_attention_layernorm folds, per layer
    assert not np.allclose(norm0, np.asarray(model.layers[0].post_attention_layernorm.weight[...]))
    assert all(r["smoothed_spread"] < r["act_spread"] for r in rows)
    assert rel_err(ours(model), before) <= 1e-4
