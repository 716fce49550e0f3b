"""PEFT adapters and compressed-tensors int8 checkpoints checked against the reference libraries.

* our `save_peft_adapter` output loads with `peft.PeftModel.from_pretrained` and gives our logits;
* our `to_compressed_tensors` int8 tensors decompress with compressed-tensors'
  PackedQuantizationCompressor (and `unpack_from_int32` + `dequantize`) to exactly our weights
  (docs/formats/compressed-tensors.md), and transformers loads our int8 checkpoint.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers
from compressed_tensors.compressors.pack_quantized import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import dequantize
from parity_helpers import hf_logits, rel_err

from models import (
    apply_lora,
    from_pretrained,
    quantize_int8,
    save_peft_adapter,
    save_pretrained,
)
from models.layers import Linear
from models.lora import lora_linears
from models.quant import quant_units, scheme_of, to_compressed_tensors

pytestmark = pytest.mark.parity
IDS = np.random.default_rng(0).integers(0, 128, (2, 16)).astype(np.int32)


def test_peft_loads_our_adapter(hf_checkpoint, tmp_path):
    hf, path = hf_checkpoint("qwen3")
    model = from_pretrained(path)
    apply_lora(model, rank=4, alpha=8, targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
    key = jax.random.PRNGKey(0)
    for _, lin in lora_linears(model):  # nonzero B so that a layout mistake changes the logits
        key, sub = jax.random.split(key)
        lin.lora_b[...] = 0.1 * jax.random.normal(sub, lin.lora_b[...].shape)
    ours = np.asarray(model(jnp.asarray(IDS)))
    base = hf_logits(hf, IDS)
    assert rel_err(ours, base) > 1e-2  # the adapter matters

    save_peft_adapter(model, str(tmp_path / "adapter"), base_model_name_or_path=path)
    peft_model = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    assert isinstance(peft_model.peft_config["default"], peft.LoraConfig)
    assert rel_err(ours, hf_logits(peft_model, IDS)) <= 1e-4


def test_compressed_tensors_decompresses_to_our_weights(hf_checkpoint):
    _, path = hf_checkpoint("llama")
    model = quantize_int8(from_pretrained(path))
    qconfig, tensors = to_compressed_tensors(model, scheme_of(model))
    QuantizationConfig.model_validate(qconfig)  # the library accepts our config.json block
    group = qconfig["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    linears = [(u.name, u.module) for u in quant_units(model) if isinstance(u.module, Linear)]
    assert len(linears) == 2 * 7
    for name, lin in linears:
        packed, scale = tensors[f"{name}.weight_packed"], tensors[f"{name}.weight_scale"]
        shape = tensors[f"{name}.weight_shape"]
        out_f, in_f = lin.out_features, lin.in_features
        assert packed.dtype == np.int32 and packed.shape == (out_f, in_f // 4)
        assert scale.shape == (out_f, 1) and shape.tolist() == [out_f, in_f]
        ours = np.asarray(lin.weight()).T  # our dequantized weight [out, in]
        q = torch.from_numpy(np.asarray(lin.qweight[...]).T.copy())
        # library packing is bit-identical to ours
        np.testing.assert_array_equal(pack_to_int32(q, 8).numpy(), packed)
        # library unpack + dequantize
        unpacked = unpack_from_int32(torch.from_numpy(packed), 8, torch.tensor(shape))
        np.testing.assert_array_equal(unpacked.numpy(), q.numpy())
        deq = dequantize(x_q=unpacked, scale=torch.from_numpy(scale), args=scheme.weights)
        np.testing.assert_array_equal(deq.numpy(), ours)
        # the full decompressor
        state = {"weight_packed": torch.from_numpy(packed), "weight_scale": torch.from_numpy(scale),
                 "weight_shape": torch.from_numpy(shape)}
        decompressed = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
        np.testing.assert_array_equal(decompressed.numpy(), ours)


def test_transformers_loads_our_int8_checkpoint(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("qwen3_tied")
    model = quantize_int8(from_pretrained(path))
    save_pretrained(model, str(tmp_path / "w8a16"))
    config = json.loads((tmp_path / "w8a16" / "config.json").read_text())
    assert config["quantization_config"]["ignore"] == ["lm_head", r"re:.*\.eh_proj$", r"re:.*mlp\.gate$",
                                                       r"re:.*mlp\.router$"]
    # transformers' compressed-tensors integration decompresses on load
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "w8a16")).eval()
    assert rel_err(model(jnp.asarray(IDS)), hf_logits(reloaded, IDS)) <= 1e-4
