"""LoRA on the DSA families (DeepSeek-V3.2, GLM-5), exported with `save_peft_adapter` and loaded by peft 0.21 onto
transformers 5's `DeepseekV32ForCausalLM` / `GlmMoeDsaForCausalLM`: the same logits as our LoRA model and as our
merged model (fp32), as tests/parity/test_peft_lora_parity.py checks the other families.

Every projection is adapted (ALL_LINEAR: MLA, the dense first layer, shared and routed experts) and so is the
lightning indexer (INDEXER: wq_b, wk, weights_proj; what `finetune.indexer.mode: kl` trains in LoRA mode), with
random nonzero B factors. The sequences (12 tokens) are longer than index_topk (8), so the indexer's adapters
decide which keys each query attends to; the test checks that they do, and that peft holds exactly our tensors.
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
from models.lora import apply_lora, lora_modules, merge_lora, save_peft_adapter
from models.lora_targets import ALL_LINEAR, INDEXER

pytestmark = pytest.mark.parity
IDS = np.random.default_rng(0).integers(0, 128, (2, 12)).astype(np.int32)
TOL = 1e-5  # fp32, relative


@pytest.mark.parametrize("arch", ["DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"])
def test_peft_loads_our_dsa_adapter_with_our_logits(arch, tmp_path):
    hf = build_from_config(tiny_configs()[arch])
    hf.save_pretrained(tmp_path / "base")
    model = from_pretrained(str(tmp_path / "base"))
    apply_lora(model, rank=4, alpha=8, targets=ALL_LINEAR + INDEXER, rngs=nnx.Rngs(0))
    randomize_b(model)
    forward = jit_forward(model)
    ours = np.asarray(forward(jnp.asarray(IDS)))
    assert rel_err(ours, hf_logits(hf, IDS)) > 1e-2  # the adapter matters
    on_indexer = [m for p, m in lora_modules(model) if "indexer" in p]
    assert on_indexer
    saved = [np.asarray(m.lora_b[...]) for m in on_indexer]
    for m in on_indexer:  # without the indexer's adapters: other keys are selected, other logits
        m.lora_b[...] = jnp.zeros_like(m.lora_b[...])
    assert rel_err(np.asarray(jit_forward(model)(jnp.asarray(IDS))), ours) > 1e-3
    for m, b in zip(on_indexer, saved, strict=True):
        m.lora_b[...] = jnp.asarray(b)

    save_peft_adapter(model, str(tmp_path / "adapter"), base_model_name_or_path=str(tmp_path / "base"))
    written = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert any(".indexer." in k for k in written)
    peft_model = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()

    # peft holds exactly our tensors (nothing dropped, remapped or left at its init)
    held = {k.replace(".default", ""): v for k, v in peft_model.state_dict().items() if ".lora_" in k}
    assert set(held) == set(written)
    for k, v in written.items():
        np.testing.assert_array_equal(held[k].numpy(), v, err_msg=k)

    theirs = hf_logits(peft_model, IDS)
    merge_lora(model)
    merged = np.asarray(jit_forward(model)(jnp.asarray(IDS)))
    with torch.no_grad():
        theirs_merged = hf_logits(peft_model.merge_and_unload(), IDS)
    errs = {"peft vs ours": rel_err(theirs, ours), "peft vs our merged": rel_err(theirs, merged),
            "ours merged": rel_err(merged, ours), "peft merged vs our merged": rel_err(theirs_merged, merged)}
    print(f"{arch}: target_modules={adapter_config['target_modules']} "
          f"target_parameters={adapter_config['target_parameters']} "
          + " ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    assert all(v <= TOL for v in errs.values()), errs
