"""Streamed, sharded loading (models/hf.py `from_pretrained(..., mesh=...)`, models/views.py): every variable
lands with the sharding its logical axes' rule gives it, holding the values an unsharded load gives, in the
checkpoint's dtype, reading each byte of the checkpoint once -- for dense, per-expert MoE and GPT-OSS
(interleaved, stacked) layouts, on 8 fake CPU devices."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from models import views
from tests.devices import cpu_devices_env

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import os, sys, tempfile
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from models import from_pretrained, save_pretrained
    from models.llama import Llama, LlamaConfig
    from models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig
    from models.gpt_oss import GptOss, GptOssConfig
    from models.sharding import make_mesh, state_shardings

    assert len(jax.devices()) == 8
    mesh = make_mesh(fsdp=2, tensor=2, expert=2)
    cases = {
        "llama": Llama(LlamaConfig.tiny(256, num_hidden_layers=2), rngs=nnx.Rngs(0)),
        "qwen3_moe": Qwen3Moe(Qwen3MoeConfig.tiny(256, num_hidden_layers=2), rngs=nnx.Rngs(1)),
        "gpt_oss": GptOss(GptOssConfig.tiny(256, num_hidden_layers=2), rngs=nnx.Rngs(2)),
    }
    for family, model in cases.items():
        folder = tempfile.mkdtemp()
        save_pretrained(model, folder, dtype=jnp.bfloat16, max_shard_bytes=200_000)
        size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))
        whole = from_pretrained(folder, dtype=jnp.bfloat16)
        stats = {}
        sharded = from_pretrained(folder, dtype=jnp.bfloat16, mesh=mesh, stats=stats)
        want = state_shardings(nnx.state(sharded), mesh)
        split = bf16 = 0
        for (path, a), (_, b), (_, s) in zip(nnx.to_flat_state(nnx.state(whole)), nnx.to_flat_state(nnx.state(sharded)),
                                             nnx.to_flat_state(want), strict=True):
            b = b.get_value()
            assert b.dtype == a.get_value().dtype, (family, path, b.dtype)  # what the family keeps in fp32 stays
            bf16 += b.nbytes if b.dtype == jnp.bfloat16 else 0
            assert b.sharding.is_equivalent_to(s, b.ndim), (family, path, b.sharding, s)
            np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b), err_msg=f"{family} {path}")
            split += not b.sharding.is_fully_replicated
        # one process holds every device here: every byte is read once (headers included), none twice
        assert stats["bytes_read"] == size, (family, stats["bytes_read"], size)
        print(family, "variables sharded:", split, "bytes read:", stats["bytes_read"], "of", size)
        assert split > 0 and bf16 > 0.9 * size, (split, bf16, size)  # the weights stay bf16, never widened
    print("OK")
""")


def test_sharded_load_on_8_fake_devices_places_every_variable_by_its_rule():
    env = cpu_devices_env(8)
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (proc.stdout[-2000:], proc.stderr[-3000:])
    print(proc.stdout)


def test_views_compose_like_numpy():
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((3, 8, 6)), rng.standard_normal((3, 8, 4))
    gu = rng.standard_normal((3, 5, 12))
    cases = [
        (views.Concat([views.Array(a), views.Array(b)]), np.concatenate([a, b], -1)),
        (views.Stacked([views.Array(a[i]).T for i in range(3)]), np.stack([a[i].T for i in range(3)])),
        (views.Deinterleaved(views.Array(gu)), np.concatenate([gu[..., 0::2], gu[..., 1::2]], -1)),
    ]
    for view, want in cases:
        assert view.shape == want.shape
        np.testing.assert_array_equal(view.full(), want)
        for index in (tuple((1, n) for n in want.shape), tuple((0, max(1, n // 2)) for n in want.shape),
                      tuple((n // 3, n - n // 3) for n in want.shape)):
            np.testing.assert_array_equal(view.read(index), want[tuple(slice(lo, hi) for lo, hi in index)])
