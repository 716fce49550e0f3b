"""Every family through the same checkpoint paths: sharded safetensors with an index, bf16 on disk,
transformers loading what we write, and a forward on 8 fake CPU devices (data, fsdp, tensor,
expert mesh axes) equal to the single-device forward.

The per-family parity files test the math; this file tests that the I/O and the sharding rules hold
for every registered architecture (docs/formats/hf-checkpoint.md; docs/models/decoder.md, "Logical
sharding axes").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from parity_helpers import build_from_config, hf_logits, rel_err, set_expert_impl, tiny_configs

from models import check_pretrained, from_pretrained, jit_forward, save_pretrained
from models.config_schema import NONNEGATIVE_INT, POSITIVE_FLOAT, POSITIVE_INT
from models.families import ARCHITECTURES
from tests.devices import cpu_devices_env

pytestmark = pytest.mark.parity
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
def test_every_registered_architecture_has_a_tiny_config():
    assert set(tiny_configs()) == set(ARCHITECTURES)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{architecture: (transformers model, saved folder)}."""
    out = {}
    for arch, config in tiny_configs().items():
        model = build_from_config(config, seed=1)
        path = tmp_path_factory.mktemp(arch)
        model.save_pretrained(path)
        out[arch] = (model, str(path))
    return out


IDS = np.random.default_rng(0).integers(0, 128, (2, 20)).astype(np.int32)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_sharded_save_loads_in_transformers(checkpoints, tmp_path, arch):
    hf, path = checkpoints[arch]
    ours = from_pretrained(path)
    out = tmp_path / "sharded"
    save_pretrained(ours, str(out), max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 3 and all((out / s).exists() for s in shards)
    back = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    assert rel_err(hf_logits(back.eval(), IDS), hf_logits(hf, IDS)) <= 1e-4
    assert rel_err(from_pretrained(str(out))(jnp.asarray(IDS)), hf_logits(hf, IDS)) <= 1e-4


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_transformers_checkpoints_pass_the_header_check_without_a_tensor_read(checkpoints, monkeypatch, arch):
    """`check_pretrained` (the command line's preflight of base.url) accepts what transformers saves, for every
    family (stacked experts, MTP layers, sinks), from the headers alone."""
    from tests.unit.test_models_hf import refuse_tensor_reads

    hf, path = checkpoints[arch]
    refuse_tensor_reads(monkeypatch)
    assert check_pretrained(path).config.vocab_size == hf.config.vocab_size


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_an_impossible_size_in_config_json_is_refused_naming_the_key(checkpoints, tmp_path, monkeypatch, arch):
    """Every sizing field the family's config.json holds, made negative, zero, fractional, a string or a bool,
    is refused by name before a model is built (JAX once failed on such shapes with a traceback); so is a
    top-k above the expert count. The untouched config still passes."""
    from tests.unit.test_models_hf import refuse_tensor_reads

    hf, path = checkpoints[arch]
    refuse_tensor_reads(monkeypatch)
    raw = json.loads(open(os.path.join(path, "config.json")).read())
    folder = tmp_path / "edited"
    folder.mkdir()
    for name in os.listdir(path):
        if name != "config.json":
            os.symlink(os.path.join(path, name), folder / name)

    def refused(**changes) -> str:
        (folder / "config.json").write_text(json.dumps({**raw, **changes}))
        with pytest.raises(ValueError) as e:
            check_pretrained(str(folder))
        return str(e.value)

    keys = [k for k in (*POSITIVE_INT, *NONNEGATIVE_INT) if isinstance(raw.get(k), int)]
    assert {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"} <= set(keys)
    for key in keys:
        for bad in ([-1, 2.5, "8", True] + ([0] if key in POSITIVE_INT else [])):
            assert refused(**{key: bad}).startswith(f"{folder}/config.json: {key} {bad!r}: must be"), (key, bad)
    for key in (k for k in POSITIVE_FLOAT if k in raw):
        assert refused(**{key: -1.0}).startswith(f"{folder}/config.json: {key} -1.0: must be a positive number")
    experts = next((k for k in ("num_experts", "n_routed_experts", "num_local_experts") if raw.get(k)), None)
    if experts is not None:
        assert "more than the" in refused(num_experts_per_tok=raw[experts] + 1)
    (folder / "config.json").write_text(json.dumps(raw))
    assert check_pretrained(str(folder)).config.vocab_size == hf.config.vocab_size


def header(path) -> dict[str, dict]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return {k: v for k, v in json.loads(raw[8:8 + n]).items() if k != "__metadata__"}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_bf16_checkpoint_both_ways(checkpoints, tmp_path, arch):
    """Saved in bf16: the same tensor names, shapes and dtypes as transformers' own bf16 save (the
    sigmoid routers stay fp32), and we and transformers (upcast to fp32) agree on the logits."""
    _, path = checkpoints[arch]
    out = tmp_path / "bf16"
    save_pretrained(from_pretrained(path), str(out), dtype=jnp.bfloat16)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    theirs = tmp_path / "theirs"
    transformers.AutoModelForCausalLM.from_config(tiny_configs()[arch], dtype=torch.bfloat16).save_pretrained(theirs)
    ours_h, theirs_h = header(out / "model.safetensors"), header(theirs / "model.safetensors")
    assert {k: (v["dtype"], v["shape"]) for k, v in ours_h.items()} == \
        {k: (v["dtype"], v["shape"]) for k, v in theirs_h.items()}
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    assert rel_err(from_pretrained(str(out))(jnp.asarray(IDS)), hf_logits(hf.eval(), IDS)) <= 1e-4


MOE = sorted(set(ARCHITECTURES) - {"LlamaForCausalLM", "Qwen3ForCausalLM"})


@pytest.mark.parametrize("arch", MOE)
def test_grouped_expert_dispatch_equals_dense_reference(checkpoints, arch):
    """The block-sparse grouped dispatch gives the every-expert dense reference's logits."""
    model = from_pretrained(checkpoints[arch][1])
    grouped = np.asarray(jit_forward(model)(jnp.asarray(IDS)))
    assert set_expert_impl(model, "dense") >= 1
    dense = np.asarray(jit_forward(model)(jnp.asarray(IDS)))
    assert rel_err(grouped, dense) <= 1e-5


CHILD = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    from models import from_pretrained, jit_forward
    from models.sharding import make_mesh, shard_model

    jax.config.update("jax_default_matmul_precision", "highest")
    assert jax.device_count() == 8, jax.devices()
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, (4, 16)), jnp.int32)
    report = {}
    for arch, path in json.loads(sys.argv[1]).items():
        model = from_pretrained(path)
        ref = np.asarray(jit_forward(model)(ids))
        shard_model(model, make_mesh(data=1, fsdp=2, tensor=2, expert=2))
        specs = {str(v[...].sharding.spec) for v in jax.tree.leaves(
            __import__("flax").nnx.state(model), is_leaf=lambda x: hasattr(x, "get_value"))}
        out = np.asarray(jit_forward(model)(ids))
        report[arch] = {"err": float(np.max(np.abs(out - ref)) / np.max(np.abs(ref))),
                        "expert_sharded": any("expert" in s for s in specs),
                        "tensor_sharded": any("tensor" in s for s in specs)}
    print("REPORT" + json.dumps(report))
""")


# in `pytest -m slow` (keeps the default run near 15 min on 2 cores)
@pytest.mark.slow
def test_forward_on_8_fake_devices_equals_single_device(checkpoints):
    paths = {arch: path for arch, (_, path) in checkpoints.items()}
    env = cpu_devices_env(8)
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(paths)], env=env, capture_output=True,
                          text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.split("REPORT", 1)[1])
    for arch, r in report.items():
        assert r["err"] <= 1e-5, (arch, r)
        assert r["tensor_sharded"], arch
        assert r["expert_sharded"] == (arch in MOE), (arch, r)
