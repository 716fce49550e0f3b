"""Logical-axis sharding rules, checked on 8 fake CPU devices in a subprocess (the device count is
fixed when jax initialises, so the flag must be set before the child imports jax)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from jax.sharding import PartitionSpec as P

from models.sharding import RULES, logical_to_spec
from tests.devices import cpu_devices_env

pytestmark = pytest.mark.unit
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    from models import Llama, LlamaConfig, jit_forward
    from models.sharding import make_mesh, shard_model

    jax.config.update("jax_default_matmul_precision", "highest")
    assert jax.device_count() == 8, jax.devices()
    cfg = LlamaConfig.tiny(128, num_attention_heads=8, num_key_value_heads=4, head_dim=8)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (4, 16)), jnp.int32)
    ref = np.asarray(jit_forward(model)(ids))

    mesh = make_mesh(data=1, fsdp=2, tensor=4)
    shard_model(model, mesh)
    spec = lambda v: v[...].sharding.spec
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    assert spec(attn.q_proj.kernel) == P("fsdp", "tensor"), spec(attn.q_proj.kernel)
    assert spec(attn.k_proj.kernel) == P("fsdp", "tensor")
    assert spec(attn.o_proj.kernel) == P("tensor", "fsdp")
    assert spec(mlp.down_proj.kernel) == P("tensor", "fsdp")
    assert spec(model.embed_tokens.weight) == P("tensor", "fsdp")
    assert spec(model.lm_head.kernel) == P("fsdp", "tensor")
    assert spec(model.norm.weight) == P(None)
    assert len(model.layers[0].mlp.up_proj.kernel[...].addressable_shards) == 8
    out = np.asarray(jit_forward(model)(ids))
    np.testing.assert_allclose(out, ref, atol=1e-5)
    print("OK")
""")


def test_rule_table_maps_logical_names():
    assert logical_to_spec(("embed", "heads")) == P("fsdp", "tensor")
    assert logical_to_spec(("batch", "length")) == P(("data", "fsdp", "expert"), None)
    assert logical_to_spec(("norm",)) == P(None)
    assert set(RULES) >= {"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm"}
    with pytest.raises(KeyError, match="experts_typo"):
        logical_to_spec(("experts_typo",))


def test_shard_model_on_8_fake_devices():
    env = cpu_devices_env(8)
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


EXPERT_PARALLEL = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from models import gpt_oss, lora, qwen3_moe
    from models.moe import Experts
    from models.sharding import make_mesh, set_activation_sharding, shard_model

    def build(kind):
        if kind == "qwen3_moe_lora":  # LoRA factors on the experts, dropout off
            m = qwen3_moe.Qwen3Moe(qwen3_moe.Qwen3MoeConfig.tiny(), rngs=nnx.Rngs(0))
            lora.apply_lora(m, rank=4, alpha=8.0, rngs=nnx.Rngs(1))
            for _, node in nnx.iter_graph(m):  # B factors start at 0: give them values
                if isinstance(node, Experts) and node.gate_up_lora_b is not None:
                    node.gate_up_lora_b[...] = 0.05 * jnp.ones_like(node.gate_up_lora_b[...])
                    node.down_lora_b[...] = 0.05 * jnp.ones_like(node.down_lora_b[...])
            return m
        return gpt_oss.GptOss(gpt_oss.GptOssConfig.tiny(), rngs=nnx.Rngs(0))  # expert biases

    def loss(model, ids):
        return model(ids).astype(jnp.float32).var()

    ids = jnp.asarray(np.random.default_rng(0).integers(3, 200, (8, 16)), jnp.int32)
    for kind in ("qwen3_moe_lora", "gpt_oss"):
        ref = build(kind)
        want, want_g = nnx.jit(nnx.value_and_grad(loss))(ref, ids)  # one device (eager: 14 s more)
        for mesh_kw in (dict(fsdp=2, expert=4), dict(data=2, expert=2, tensor=2), dict(expert=8)):
            model = build(kind)
            mesh = make_mesh(**mesh_kw)
            shard_model(model, mesh)
            set_activation_sharding(model, mesh)
            ep = [n.expert_parallel for _, n in nnx.iter_graph(model) if isinstance(n, Experts)][0]
            assert ep.usable(8 * 16) and ep.expert_size == mesh_kw["expert"], (kind, mesh_kw, ep)
            got, got_g = nnx.jit(nnx.value_and_grad(loss))(model, ids)
            np.testing.assert_allclose(got, want, rtol=2e-5, err_msg=f"{kind} {mesh_kw}")
            for (p, a), (_, b) in zip(nnx.to_flat_state(want_g), nnx.to_flat_state(got_g), strict=True):
                np.testing.assert_allclose(np.asarray(b.get_value()), np.asarray(a.get_value()), rtol=1e-3,
                                           atol=1e-6, err_msg=f"{kind} {mesh_kw} {p}")
        # a capacity factor of 1 drops what overflows a device's average share: finite, and not the dropless value
        model = build(kind)
        mesh = make_mesh(expert=8)
        shard_model(model, mesh)
        set_activation_sharding(model, mesh, capacity_factor=1.0)
        dropped = float(nnx.jit(loss)(model, ids))
        assert np.isfinite(dropped) and dropped != float(want), (dropped, float(want))
    print("OK")
""")


def test_expert_parallel_dispatch_equals_one_device():
    """Experts under shard_map (each device its own experts, tokens gathered over the expert axis and results
    reduce-scattered back) give the single-device loss and gradients: LoRA'd Qwen3-MoE experts and GPT-OSS's
    biased experts, on fsdp x expert, data x expert x tensor and expert-only meshes of 8 fake devices."""
    env = cpu_devices_env(8)
    proc = subprocess.run([sys.executable, "-c", EXPERT_PARALLEL], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
