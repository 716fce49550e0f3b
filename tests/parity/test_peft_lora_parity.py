"""Our LoRA adapters, exported with `save_peft_adapter`, loaded by peft 0.21 onto the transformers 5
base (`peft.PeftModel.from_pretrained`): the same logits as our LoRA model and as our merged model.

Every projection is adapted (ALL_LINEAR) with random nonzero B factors, on a dense Llama, a Qwen3-MoE
with one dense MLP layer (`mlp_only_layers`), and a DeepSeek-V3 (MLA projections, a dense first layer,
shared and routed experts), and a DeepSeek-V4 (CSA and HCA layers: the low-rank q, the shared K=V, the
grouped low-rank output, the compressors, clamped shared and routed experts; the export names transformers'
modules, not the checkpoint's tensors, and adapts the grouped `o_a_proj` through its weight). On the MoE
bases peft rewrites gate/up/down_proj `target_modules` onto the fused experts (see models/lora.py), which
is why the check also counts the adapted tensors: peft must hold exactly the tensors we wrote, with our
values. GPT-OSS (interleaved gate/up, transposed experts), GLM-4.5 and DeepSeek-V4 run in the slow tier,
as does a LoRA `finetune` of DeepSeek-V4 whose trained adapter peft loads (the default tier checks V4's
exported names in tests/unit/test_lora_targets.py).
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
from flax import nnx
from parity_helpers import build_from_config, hf_logits, randomize_b, rel_err, tiny_configs
from safetensors.numpy import load_file

from models import from_pretrained, jit_forward
from models.lora import apply_lora, merge_lora, save_peft_adapter

pytestmark = pytest.mark.parity
IDS = np.random.default_rng(0).integers(0, 128, (2, 12)).astype(np.int32)
TOL = 2e-5  # fp32; measured 1e-6 .. 5e-6

CASES = [
    pytest.param("LlamaForCausalLM", {}, id="llama"),
    pytest.param("Qwen3MoeForCausalLM", {"mlp_only_layers": [1]}, id="qwen3_moe"),
    pytest.param("DeepseekV3ForCausalLM", {}, id="deepseek_v3"),
    pytest.param("DeepseekV4ForCausalLM", {}, id="deepseek_v4", marks=pytest.mark.slow),
    pytest.param("GptOssForCausalLM", {}, id="gpt_oss", marks=pytest.mark.slow),
    pytest.param("Glm4MoeForCausalLM", {}, id="glm4_moe", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("arch, overrides", CASES)
def test_peft_loads_our_adapter_with_our_logits(arch, overrides, tmp_path):
    config = tiny_configs()[arch]
    for k, v in overrides.items():
        setattr(config, k, v)
    hf = build_from_config(config)
    hf.save_pretrained(tmp_path / "base")
    model = from_pretrained(str(tmp_path / "base"))
    apply_lora(model, rank=4, alpha=8, rngs=nnx.Rngs(0))
    randomize_b(model)
    ours = np.asarray(jit_forward(model)(jnp.asarray(IDS)))
    assert rel_err(ours, hf_logits(hf, IDS)) > 1e-2  # the adapter matters

    save_peft_adapter(model, str(tmp_path / "adapter"), base_model_name_or_path=str(tmp_path / "base"))
    written = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    peft_model = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()

    # peft holds exactly our tensors (nothing dropped, remapped or left at its init)
    held = {k.replace(".default", ""): v for k, v in peft_model.state_dict().items() if ".lora_" in k}
    assert set(held) == set(written)
    for k, v in written.items():
        np.testing.assert_array_equal(held[k].numpy(), v, err_msg=k)

    err_peft = rel_err(hf_logits(peft_model, IDS), ours)
    merge_lora(model)
    err_merged = rel_err(np.asarray(jit_forward(model)(jnp.asarray(IDS))), ours)
    with torch.no_grad():
        err_peft_merged = rel_err(hf_logits(peft_model.merge_and_unload(), IDS), ours)
    print(f"{arch}: target_modules={adapter_config['target_modules']} "
          f"target_parameters={adapter_config['target_parameters']} peft {err_peft:.1e} "
          f"ours merged {err_merged:.1e} peft merged {err_peft_merged:.1e}")
    assert err_peft <= TOL and err_merged <= TOL and err_peft_merged <= TOL
