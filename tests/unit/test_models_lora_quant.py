"""LoRA (apply, train only the adapters, merge, PEFT tensor layout) and int8 weight-only quantization."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models import (
    Llama,
    LlamaConfig,
    apply_lora,
    from_pretrained,
    lora_state_to_peft,
    merge_lora,
    quantize_int8,
    save_pretrained,
    weight_bytes,
)
from models.lora import lora_linears
from models.quant import pack, unpack

pytestmark = pytest.mark.unit
jax.config.update("jax_default_matmul_precision", "highest")
V = 64
IDS = jnp.asarray(np.random.default_rng(0).integers(0, V, (2, 10)), jnp.int32)


def make(seed=0, **kw):
    return Llama(LlamaConfig.tiny(V, **kw), rngs=nnx.Rngs(seed))


def randomize_lora_b(model, seed=1):
    key = jax.random.PRNGKey(seed)
    for _, lin in lora_linears(model):
        key, sub = jax.random.split(key)
        lin.lora_b[...] = 0.05 * jax.random.normal(sub, lin.lora_b[...].shape)


def test_apply_lora_is_identity_until_trained_and_merge_preserves_logits():
    model = make()
    base = model(IDS)
    apply_lora(model, rank=4, alpha=8, rngs=nnx.Rngs(3))
    np.testing.assert_array_equal(np.asarray(model(IDS)), np.asarray(base))
    q = model.layers[0].self_attn.q_proj
    assert q.lora_a[...].shape == (64, 4) and q.lora_b[...].shape == (4, 64) and q.lora_scale == 2.0
    assert isinstance(q.lora_a, nnx.LoRAParam) and not isinstance(q.kernel, nnx.LoRAParam)
    assert model.lm_head.lora_a is None
    randomize_lora_b(model)
    adapted = model(IDS)
    assert float(jnp.max(jnp.abs(adapted - base))) > 1e-3
    merge_lora(model)
    assert q.lora_a is None and not nnx.state(model, nnx.LoRAParam)
    np.testing.assert_allclose(np.asarray(model(IDS)), np.asarray(adapted), atol=1e-5)


def test_train_only_lora_params():
    model = make()
    apply_lora(model, rank=2, alpha=4, targets=("q_proj", "v_proj"), rngs=nnx.Rngs(1))
    before = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(nnx.LoRAParam)))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)

    def loss_fn(model, ids):
        logits = model(ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()

    @nnx.jit
    def step(model, optimizer, ids):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))(model, ids)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, IDS)) for _ in range(5)]
    assert losses[-1] < losses[0]
    after = jax.tree.map(np.asarray, nnx.state(model, nnx.Not(nnx.LoRAParam)))
    jax.tree.map(np.testing.assert_array_equal, before, after)  # base weights untouched
    assert float(jnp.abs(model.layers[0].self_attn.q_proj.lora_b[...]).max()) > 0


def test_peft_tensor_layout():
    model = make()
    apply_lora(model, rank=4, alpha=16, targets=("q_proj", "down_proj"))
    config, tensors = lora_state_to_peft(model, "base/model")
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert config["r"] == 4 and config["lora_alpha"] == 16
    assert config["target_modules"] == ["down_proj", "q_proj"]
    assert tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"].shape == (4, 64)
    assert tensors["base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (64, 4)
    assert len(tensors) == 2 * 2 * 2


def test_pack_unpack_round_trip_and_bit_layout():
    q = np.random.default_rng(0).integers(-128, 128, (5, 10)).astype(np.int8)
    packed = pack(q, 8)
    assert packed.shape == (5, 3) and packed.dtype == np.int32
    np.testing.assert_array_equal(unpack(packed, 8, (5, 10)), q)
    word = packed[0, 0].astype(np.int64) & 0xFFFFFFFF
    assert [(word >> (8 * i)) & 0xFF for i in range(4)] == [int(v) + 128 for v in q[0, :4]]
    q4 = np.random.default_rng(1).integers(-8, 8, (6, 19)).astype(np.int8)  # int4: 8 per word, last one padded
    packed = pack(q4, 4)
    assert packed.shape == (6, 3)
    np.testing.assert_array_equal(unpack(packed, 4, (6, 19)), q4)
    word = packed[1, 1].astype(np.int64) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [int(v) + 8 for v in q4[1, 8:16]]
    zp = pack(q4, 4, axis=0)  # zero points are packed along the output dim
    assert zp.shape == (1, 19)
    np.testing.assert_array_equal(unpack(zp, 4, (6, 19), axis=0), q4)


def test_int8_forward_close_to_float_and_smaller(tmp_path):
    model = make()
    ref = model(IDS)
    float_bytes = weight_bytes(model, linears_only=True)
    quantize_int8(model)
    lin = model.layers[0].mlp.up_proj
    assert lin.kernel is None and lin.qweight[...].dtype == jnp.int8 and lin.scale[...].shape == (1, 128)
    assert model.lm_head.qweight is None and model.lm_head.kernel is not None
    assert weight_bytes(model, linears_only=True) / float_bytes < 0.3
    assert weight_bytes(model) < weight_bytes(make())
    out = model(IDS)
    assert float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref))) < 0.02
    assert float(jnp.mean(jnp.argmax(out, -1) == jnp.argmax(ref, -1))) > 0.9
    save_pretrained(model, str(tmp_path))  # compressed-tensors on disk, int8 again on load
    loaded = from_pretrained(str(tmp_path))
    assert loaded.layers[1].self_attn.o_proj.qweight is not None
    np.testing.assert_array_equal(np.asarray(loaded(IDS)), np.asarray(out))
