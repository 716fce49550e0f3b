"""Llama / Qwen3 parity with transformers 5.24 (fp32, eager attention, highest matmul precision).

Each test builds a tiny random transformers model, saves it with `save_pretrained` and loads it
with our `from_pretrained`; logits must agree to 1e-4 relative error (docs/models/decoder.md).
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from parity_helpers import TINY, VARIANTS, build_hf, hf_logits, rel_err

from models import KVCache, from_pretrained, generate, jit_forward, save_pretrained

pytestmark = pytest.mark.parity
RNG = np.random.default_rng(0)


def random_ids(b: int, t: int) -> np.ndarray:
    return RNG.integers(0, TINY["vocab_size"], size=(b, t)).astype(np.int32)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(hf_checkpoint, variant):
    hf, path = hf_checkpoint(variant)
    model = from_pretrained(path)
    assert model.config.qk_norm == variant.startswith("qwen3")
    ids = random_ids(2, 40)
    assert rel_err(model(jnp.asarray(ids)), hf_logits(hf, ids)) <= 1e-4


def test_tied_checkpoint_has_no_lm_head(hf_checkpoint):
    _, path = hf_checkpoint("qwen3_tied")
    model = from_pretrained(path)
    assert model.lm_head is None and model.config.tie_word_embeddings
    assert model.config.head_dim == 24 != model.config.hidden_size // model.config.num_attention_heads


def test_left_padded_batch_matches_transformers(hf_checkpoint):
    hf, path = hf_checkpoint("qwen3")
    model = from_pretrained(path)
    ids = random_ids(2, 12)
    mask = np.ones_like(ids)
    mask[1, :5] = 0  # row 1 is left-padded
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    ours = model(jnp.asarray(ids), positions=jnp.asarray(positions), segment_ids=jnp.asarray(mask))
    ours = np.asarray(ours)
    ref = hf_logits(hf, ids, mask)
    assert rel_err(ours[mask == 1], ref[mask == 1]) <= 1e-4


def test_segment_packing_equals_separate_sequences(hf_checkpoint):
    hf, path = hf_checkpoint("llama3_rope")
    model = from_pretrained(path)
    a, b = random_ids(1, 9), random_ids(1, 6)
    packed = np.concatenate([a, b, np.zeros((1, 3), np.int32)], axis=1)  # [1, 18] with 3 padding tokens
    seg = np.array([[1] * 9 + [2] * 6 + [0] * 3], np.int32)
    out = np.asarray(model(jnp.asarray(packed), segment_ids=jnp.asarray(seg)))
    assert np.all(np.isfinite(out))
    assert rel_err(out[:, :9], hf_logits(hf, a)) <= 1e-4
    assert rel_err(out[:, 9:15], hf_logits(hf, b)) <= 1e-4
    assert rel_err(out[:, 9:15], model(jnp.asarray(b))) <= 1e-5


def test_long_packed_rows_use_blocked_attention_and_match_transformers(hf_checkpoint):
    hf, path = hf_checkpoint("qwen3")
    model = jit_forward(from_pretrained(path))
    a, b = random_ids(1, 170), random_ids(1, 60)  # T = 240 > CAUSAL_CHUNK: several query blocks
    packed = np.concatenate([a, b, np.zeros((1, 10), np.int32)], axis=1)
    seg = np.array([[1] * 170 + [2] * 60 + [0] * 10], np.int32)
    out = np.asarray(model(jnp.asarray(packed), segment_ids=jnp.asarray(seg)))
    assert rel_err(out[:, :170], hf_logits(hf, a)) <= 1e-4
    assert rel_err(out[:, 170:230], hf_logits(hf, b)) <= 1e-4


@pytest.mark.parametrize("variant", ["llama", "qwen3_tied"])
def test_incremental_decoding_equals_full_forward(hf_checkpoint, variant):
    _, path = hf_checkpoint(variant)
    loaded = from_pretrained(path)
    model = jit_forward(loaded)
    ids = jnp.asarray(random_ids(2, 14))
    full = model(ids)
    cache = KVCache.init(loaded.config, 2, 16)
    logits, cache = model(ids[:, :6], cache=cache)  # prefill
    steps = [logits]
    for t in range(6, 14):
        logits, cache = model(ids[:, t : t + 1], cache=cache)
        steps.append(logits)
    assert rel_err(jnp.concatenate(steps, axis=1), full) <= 1e-5
    assert cache.length.tolist() == [14, 14]


def test_multi_token_verify_after_rollback_equals_full_forward(hf_checkpoint):
    _, path = hf_checkpoint("llama")
    loaded = from_pretrained(path)
    model = jit_forward(loaded)
    ids = jnp.asarray(random_ids(1, 12))
    full = model(ids)
    _, cache = model(ids[:, :5], cache=KVCache.init(loaded.config, 1, 16))
    _, cache = model(jnp.full((1, 4), 7, jnp.int32), cache=cache)  # rejected junk
    cache = cache.rollback(jnp.array([5]))
    logits, cache = model(ids[:, 5:12], cache=cache)  # verify 7 tokens at once
    assert rel_err(logits, full[:, 5:12]) <= 1e-5


@pytest.mark.parametrize("variant,max_shard_bytes", [("llama", 2**30), ("qwen3_tied", 60_000)])
def test_our_save_loads_in_transformers(hf_checkpoint, tmp_path, variant, max_shard_bytes):
    hf, path = hf_checkpoint(variant)
    model = from_pretrained(path)
    out = tmp_path / "ours"
    save_pretrained(model, str(out), max_shard_bytes=max_shard_bytes)
    files = sorted(os.listdir(out))
    if max_shard_bytes < 2**30:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert "lm_head.weight" not in index["weight_map"]  # tied: omitted like transformers does
    else:
        assert "model.safetensors" in files
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    assert type(reloaded).__name__ == type(hf).__name__
    ids = random_ids(2, 20)
    np.testing.assert_array_equal(hf_logits(reloaded, ids), hf_logits(hf, ids))  # weights round-trip exactly
    assert rel_err(model(jnp.asarray(ids)), hf_logits(reloaded, ids)) <= 1e-4
    assert from_pretrained(str(out)).config == model.config


def test_bf16_save_loads_in_transformers(hf_checkpoint, tmp_path):
    _, path = hf_checkpoint("llama")
    model = from_pretrained(path)
    save_pretrained(model, str(tmp_path / "bf16"), dtype=jnp.bfloat16)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "bf16"))
    assert reloaded.dtype == torch.bfloat16
    ours = from_pretrained(str(tmp_path / "bf16"), dtype=jnp.bfloat16)
    assert ours.embed_tokens.weight[...].dtype == jnp.bfloat16


@pytest.mark.parametrize("variant", ["llama", "qwen3_tied"])
def test_greedy_generate_matches_transformers(hf_checkpoint, variant):
    hf, path = hf_checkpoint(variant)
    model = from_pretrained(path)
    ids = random_ids(2, 7)
    mask = np.ones_like(ids)
    mask[0, :3] = 0  # row 0 left-padded to 4 real tokens
    ids[0, :3] = 0
    eos = 3
    with torch.no_grad():
        ref = hf.generate(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                          max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=0)
    ref = ref[:, ids.shape[1]:].numpy()
    out = generate(model, jnp.asarray(ids), prompt_lengths=jnp.asarray(mask.sum(1)), max_new_tokens=12,
                   eos_token_id=eos, pad_token_id=0)
    got = np.asarray(out.tokens)[:, : ref.shape[1]]
    np.testing.assert_array_equal(got, ref)


def test_transformers_sharded_checkpoint_loads(tmp_path):
    hf = build_hf("llama_bias", seed=3)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ids = random_ids(1, 16)
    assert rel_err(from_pretrained(str(tmp_path))(jnp.asarray(ids)), hf_logits(hf, ids)) <= 1e-4
