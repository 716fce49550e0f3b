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
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]
