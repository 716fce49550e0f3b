"""The release flow on frontier-architecture bases: a tiny random Qwen3-MoE and a tiny DeepSeek-V3
(MLA + sigmoid group-limited MoE + shared expert) checkpoint, built with transformers in the test
with a BPE tokenizer trained on the standard library, go through every stage (`forgeline release
--set base.url=...`), int4 GPTQ of every expert included; the exported model/ loads in transformers
with our logits.
~1 minute per architecture on 2 cores: `pytest -m slow`."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import sysconfig

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import storage
from models import from_pretrained
from tests.conftest import SMOKE_MOE

pytestmark = [pytest.mark.integration, pytest.mark.slow]
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "parity"))
from parity_helpers import build_from_config, tiny_configs  # noqa: E402


def make_base(arch: str, out: str) -> None:
    """A saved tiny transformers model of `arch` plus a 512-token byte-level BPE tokenizer."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers import models as tok_models

    texts = [open(p).read() for p in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")))]
    tok = Tokenizer(tok_models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|pad|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    config = tiny_configs()[arch]
    config.vocab_size = tok.get_vocab_size()
    config.eos_token_id, config.pad_token_id, config.bos_token_id = tok.token_to_id("<|endoftext|>"), \
        tok.token_to_id("<|pad|>"), None
    build_from_config(config, seed=0).save_pretrained(out)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}, f)


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"])
def test_release_on_an_moe_base(tmp_path, arch):
    base = str(tmp_path / "base")
    make_base(arch, base)
    store = f"file://{tmp_path}/artifacts"
    # int4 GPTQ in groups of 16: the narrowest widths here (moe_intermediate_size 32, kv_lora_rank 16) need it
    sets = ["--set", "quantize.schemes=[int8,w4a16-gptq-g16]"]
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "FORGELINE_WORKDIR": str(tmp_path / "work")}
    done = subprocess.run([sys.executable, "-m", "flows.cli", "release", "--recipe", SMOKE_MOE, "--store", store,
                           "--set", f"base.url=file://{base}", *sets], env=env, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    url = done.stdout.strip().splitlines()[-1]
    report = json.loads(storage.read_bytes(storage.join(url, "eval/report.json")))
    assert report["passed"] and report["perplexity"]["finetuned"] < report["perplexity"]["base"], report
    assert report["draft"]["lossless"], report["draft"]
    assert report["perplexity"]["w4a16-gptq-g16"] <= 1.02 * report["perplexity"]["finetuned"], report["perplexity"]
    made = json.loads(storage.read_bytes(storage.join(url, "quantized/w4a16-gptq-g16/quantization_report.json")))
    experts = [r for r in made["modules"] if ".mlp.experts." in r["module"]]
    assert experts and all(r["method"] == "gptq" for r in experts)  # every expert, on its routed tokens or pooled
    model_dir = storage.local_path(storage.join(url, "model"))
    ids = np.random.default_rng(0).integers(0, 500, (2, 24))
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    assert hf.config.architectures == [arch]
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    ours = np.asarray(from_pretrained(model_dir)(jnp.asarray(ids, jnp.int32)))
    assert np.max(np.abs(ours - ref)) / np.max(np.abs(ref)) <= 1e-4
    # the LoRA adapter (attention, dense MLP, shared and routed experts) on the transformers base
    # reproduces the merged model through peft
    import peft

    config = json.loads(storage.read_bytes(storage.join(url, "adapter/adapter_config.json")))
    assert config.get("target_parameters"), config  # routed experts are adapted too
    base_hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32,
                                                               attn_implementation="eager")
    adapted = peft.PeftModel.from_pretrained(base_hf, storage.local_path(storage.join(url, "adapter"))).eval()
    with torch.no_grad():
        via_peft = adapted(torch.tensor(ids)).logits.numpy()
    assert np.max(np.abs(via_peft - ref)) / np.max(np.abs(ref)) <= 1e-4
