"""GPT-OSS experts quantized mxfp4a16 and written in GPT-OSS's own MXFP4 layout, against transformers 5.24
(`integrations/mxfp4.py`: `convert_moe_packed_tensors`, `Mxfp4Config`; docs/formats/deepseek-fp8.md, MXFP4).

One tiny random transformers GPT-OSS (2 layers: sliding, full; D 64, I 96 so that the two expert matrices'
group counts differ; 4 experts, top-2; perturbed biases, sinks, router) saved with transformers'
`save_pretrained`, loaded with ours, quantized with `quantize_model` (RTN, no data; and GPTQ) and written with
our `save_pretrained`. Checked:
* the files hold GPT-OSS's tensors and config (`_blocks` / `_scales` uint8, interleaved gate/up, float
  biases, `quant_method: mxfp4` with the published `modules_to_not_convert`), attention float;
* the blocks and scales decode, with our reader and with transformers' `convert_moe_packed_tensors`, to our
  quantized experts' dequantized weights in transformers' [E, in, out] orientation, bit for bit;
* our `from_pretrained` of the folder reproduces our quantized model's logits, and transformers loads it
  (on CPU it dequantizes MXFP4 itself) to within 1e-5; the float model is clearly further away;
* any other scheme on GPT-OSS experts is refused with an error naming mxfp4a16.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
import transformers
from parity_helpers import build_from_config, hf_logits, rel_err
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from models import from_pretrained, jit_forward, parse_scheme, quantize_model, save_pretrained
from models.moe import Experts
from models.quant import check_supported, quant_units
from models.quant.formats import FP4_VALUES, dequant_mxfp4, encode_mxfp4
from models.quant.streaming import quantized_tensors

pytestmark = pytest.mark.parity
VOCAB, L, E, D, I = 128, 2, 4, 64, 96
IDS = np.random.default_rng(0).integers(1, VOCAB, (2, 24)).astype(np.int32)
TOL = 1e-5  # transformers (its own fp32 forward) vs ours
SAME = 1e-6  # our reload vs our quantized model (bit-exact in practice)
NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def hf_config() -> transformers.GptOssConfig:
    return transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=D, intermediate_size=I, num_hidden_layers=L, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=E, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=256, rms_norm_eps=1e-5, pad_token_id=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})


def ours(model) -> np.ndarray:
    return np.asarray(jit_forward(model)(jnp.asarray(IDS)))


def interleaved(a: np.ndarray) -> np.ndarray:
    """[..., 2I] gate columns first, then up -> GPT-OSS's order (gate even, up odd)."""
    return np.stack([a[..., :I], a[..., I:]], axis=-1).reshape(a.shape)


def experts_of(model) -> list[Experts]:
    return [model.layers[i].mlp.experts for i in range(L)]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(float checkpoint folder, transformers' float logits)."""
    hf = build_from_config(hf_config(), seed=0)
    path = str(tmp_path_factory.mktemp("gpt_oss_float"))
    hf.save_pretrained(path)
    return path, hf_logits(hf, IDS)


@pytest.fixture(scope="module")
def exported(source, tmp_path_factory):
    """(our mxfp4a16 model, its logits, the float model's logits, the folder save_pretrained wrote, report)."""
    path, _ = source
    model = from_pretrained(path)
    float_logits = ours(model)
    report = quantize_model(model, parse_scheme("mxfp4a16"), [])
    out = str(tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    save_pretrained(model, out)
    return model, ours(model), float_logits, out, report


def test_round_trip_writes_gpt_oss_layout_and_reloads_to_the_same_logits(source, exported):
    model, mine, float_logits, out, report = exported
    # only the experts are quantized: attention Linears stay float, as in the published checkpoint
    assert {r["module"].rsplit(".", 2)[0] for r in report["modules"]} == {f"model.layers.{i}.mlp.experts"
                                                                          for i in range(L)}
    assert {r["method"] for r in report["modules"]} == {"rtn"}
    assert model.layers[0].self_attn.q_proj.qweight is None and all(ex.quantized for ex in experts_of(model))
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["quantization_config"] == {"quant_method": "mxfp4", "modules_to_not_convert": NOT_CONVERTED}
    assert transformers.Mxfp4Config.from_dict(cfg["quantization_config"]).to_dict() == cfg["quantization_config"]
    tensors = safetensors.numpy.load_file(os.path.join(out, "model.safetensors"))
    floats = safetensors.numpy.load_file(os.path.join(source[0], "model.safetensors"))
    for i in range(L):
        p = f"model.layers.{i}.mlp.experts."
        expected = {"gate_up_proj_blocks": (np.uint8, (E, 2 * I, D // 32, 16)),
                    "gate_up_proj_scales": (np.uint8, (E, 2 * I, D // 32)),
                    "down_proj_blocks": (np.uint8, (E, D, I // 32, 16)),
                    "down_proj_scales": (np.uint8, (E, D, I // 32)),
                    "gate_up_proj_bias": (np.float32, (E, 2 * I)), "down_proj_bias": (np.float32, (E, D))}
        assert {n[len(p):] for n in tensors if n.startswith(p)} == set(expected)
        for name, (dtype, shape) in expected.items():
            assert (tensors[p + name].dtype, tensors[p + name].shape) == (np.dtype(dtype), shape), name
        for name in ("gate_up_proj_bias", "down_proj_bias"):  # biases stay float, interleaved as transformers'
            np.testing.assert_array_equal(tensors[p + name], floats[p + name])
    # every other tensor is the float checkpoint's (attention, router, sinks, norms, embeddings, head)
    rest = {n for n in tensors if ".mlp.experts." not in n}
    assert rest == {n for n in floats if ".mlp.experts." not in n}
    for n in rest:
        np.testing.assert_array_equal(tensors[n], floats[n], err_msg=n)
    reloaded = from_pretrained(out)
    again = ours(reloaded)
    err = rel_err(again, mine)
    print(f"\ngpt_oss mxfp4a16: our reload vs our quantized model {err:.1e}")
    assert err <= SAME
    assert rel_err(mine, float_logits) > 100 * TOL  # quantization moved the logits


def test_blocks_decode_to_our_experts_with_ours_and_transformers_reader(exported):
    model, _, _, out, _ = exported
    tensors = safetensors.numpy.load_file(os.path.join(out, "model.safetensors"))
    for i, ex in enumerate(experts_of(model)):
        gu, down = (np.asarray(w, np.float32) for w in ex.weights())  # dequantized: [E, D, 2I], [E, I, D]
        p = f"model.layers.{i}.mlp.experts."
        for name, mine in (("gate_up_proj", interleaved(gu)), ("down_proj", down)):  # transformers' [E, in, out]
            blocks, scales = tensors[p + name + "_blocks"], tensors[p + name + "_scales"]
            np.testing.assert_array_equal(np.swapaxes(dequant_mxfp4(blocks, scales), 1, 2), mine)
            theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                dtype=torch.float32)
            np.testing.assert_array_equal(theirs.numpy(), mine)
        # the codes really use the grid: every E2M1 magnitude and several scale exponents
        codes = np.concatenate([tensors[p + "gate_up_proj_blocks"] & 15, tensors[p + "gate_up_proj_blocks"] >> 4])
        assert len(np.unique(codes)) == 16 and len(np.unique(tensors[p + "down_proj_scales"])) >= 2


def test_encode_is_the_inverse_of_the_reader_on_every_code_and_exponent():
    rng = np.random.default_rng(3)
    blocks = rng.permutation(np.arange(256, dtype=np.uint8).repeat(4)).reshape(2, 8, 4, 16)  # every byte
    scales = np.concatenate([np.arange(255, dtype=np.uint8), [0]]).reshape(2, 8, 16)[..., :4].copy()
    scales[0, 0] = [0, 1, 254, 127]  # 2^-127 (subnormal float32), 2^-126, 2^127, 1
    values = np.empty((2, 8, 4, 32), np.float32)
    values[..., 0::2], values[..., 1::2] = FP4_VALUES[blocks & 15], FP4_VALUES[blocks >> 4]  # -0 included
    scale = np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127).astype(np.float32)
    got_blocks, got_scales = encode_mxfp4(values.reshape(2, 8, 128), scale)
    np.testing.assert_array_equal(np.asarray(got_blocks), blocks)
    np.testing.assert_array_equal(np.asarray(got_scales), scales)
    with pytest.raises(ValueError, match="mxfp4: values"):
        encode_mxfp4(values.reshape(2, 8, 128), scale[..., :2])


def test_transformers_loads_the_export(exported):
    model, mine, float_logits, out, _ = exported
    # on CPU transformers dequantizes MXFP4 itself (no triton kernels); Mxfp4Config(dequantize=True) says so
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32,
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    for i, ex in enumerate(experts_of(model)):  # its dequantized experts are ours, exactly
        gu, down = (np.asarray(w, np.float32) for w in ex.weights())
        experts = hf.model.layers[i].mlp.experts
        assert experts.gate_up_proj.dtype == torch.float32
        np.testing.assert_array_equal(experts.gate_up_proj.detach().numpy(), interleaved(gu))
        np.testing.assert_array_equal(experts.down_proj.detach().numpy(), down)
    theirs = hf_logits(hf, IDS)
    err, control = rel_err(theirs, mine), rel_err(float_logits, mine)
    print(f"\ngpt_oss mxfp4a16: transformers vs ours {err:.1e}; float model vs quantized {control:.1e}")
    assert err <= TOL
    assert control > 100 * TOL  # the comparison can tell the quantized model from the float one


def test_gptq_round_trip(source, tmp_path):
    model = from_pretrained(source[0])
    rng = np.random.default_rng(1)
    batches = [(rng.integers(1, VOCAB, (2, 32)).astype(np.int32), np.ones((2, 32), np.int32)) for _ in range(2)]
    report = quantize_model(model, parse_scheme("mxfp4a16-gptq"), batches)
    assert "gptq" in {r["method"] for r in report["modules"]}
    out = str(tmp_path / "gptq")
    save_pretrained(model, out)
    tensors = safetensors.numpy.load_file(os.path.join(out, "model.safetensors"))
    gu, _ = (np.asarray(w, np.float32) for w in experts_of(model)[1].weights())
    p = "model.layers.1.mlp.experts.gate_up_proj"
    theirs = convert_moe_packed_tensors(torch.from_numpy(tensors[p + "_blocks"]),
                                        torch.from_numpy(tensors[p + "_scales"]), dtype=torch.float32)
    np.testing.assert_array_equal(theirs.numpy(), interleaved(gu))
    assert rel_err(ours(from_pretrained(out)), ours(model)) <= SAME


@pytest.mark.parametrize("scheme", ["nvfp4a16", "w4a16-rtn-g32", "int8", "fp8-block", "mxfp4"])
def test_other_schemes_refuse_gpt_oss_experts(source, scheme):
    model = from_pretrained(source[0])
    with pytest.raises(ValueError, match=rf"scheme {scheme}: model\.layers\.0\.mlp\.experts: GPT-OSS's fused "
                                         r"experts are written only in GPT-OSS's own MXFP4 layout: quantize them "
                                         r"with mxfp4a16"):
        quantize_model(model, parse_scheme(scheme), [])
    assert not any(ex.quantized for ex in experts_of(model))


def test_mxfp4a16_keeps_linears_float_and_other_writers_refuse(source, exported):
    model = from_pretrained(source[0])
    mx = parse_scheme("mxfp4a16")
    assert all(isinstance(u.module, Experts) for u in quant_units(model, (), mx))
    with pytest.raises(ValueError, match="every Linear stays float"):  # units chosen without the scheme
        check_supported(quant_units(model), mx)
    with pytest.raises(ValueError, match="GPT-OSS's fused experts are not quantized by streaming quantization"):
        quantized_tensors(model, mx, ())
    with pytest.raises(ValueError, match="written only in GPT-OSS's own MXFP4 layout"):
        save_pretrained(exported[0], "/nonexistent/never-written", layout="compressed-tensors")
    # with the experts ignored, a GPT-OSS model's Linears take any scheme (compressed-tensors, as before)
    quantize_model(model, parse_scheme("int8"), [], ignore=(r"re:.*mlp\.experts",))
    assert model.layers[0].self_attn.q_proj.qweight is not None and not experts_of(model)[0].quantized


def test_an_ignored_expert_stack_stays_float_and_is_listed(source, tmp_path):
    model = from_pretrained(source[0])
    quantize_model(model, parse_scheme("mxfp4a16"), [], ignore=("model.layers.0.mlp.experts",))
    assert [ex.quantized for ex in experts_of(model)] == [False, True]
    out = str(tmp_path / "partial")
    save_pretrained(model, out)
    with open(os.path.join(out, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["modules_to_not_convert"] == [*NOT_CONVERTED, "model.layers.0.mlp.experts"]
    names = set(safetensors.numpy.load_file(os.path.join(out, "model.safetensors")))
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.gate_up_proj_blocks"} <= names
    mine = ours(model)
    assert rel_err(ours(from_pretrained(out)), mine) <= SAME
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager",
                                                           dtype=torch.float32).eval()  # plain load on CPU
    assert rel_err(hf_logits(hf, IDS), mine) <= TOL
