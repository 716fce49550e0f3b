"""Streamed, sharded loading at a size where it matters: a multi-GB bf16 Qwen3-MoE checkpoint with many
experts, built here, placed on 8 fake CPU devices with FSDP x expert sharding.

- one process: every variable has its rule's sharding and the values safetensors' own reader gives (stacked,
  transposed: an independent path), bf16 stays bf16, and peak RSS grows by less than 1.3x the checkpoint;
- two processes on 127.0.0.1 (4 devices each): each reads at most 60% of the checkpoint's bytes (counted);
- from the SeaweedFS S3 server: the same values through ranged reads, never a full local copy;
- the load benchmark (forgeline vs safetensors + torch on the same file) at a small size.

Every measurement runs in a fresh process (`/proc/self/status`: VmHWM is the peak, VmRSS the baseline)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import users_xla_flags
from tests.devices import cpu_devices_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]

# 10 layers of 64 experts of width 512 on D=1024: 2.1 GB in bf16, one safetensors file per layer
BIG = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=10,
           num_attention_heads=8, num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=4,
           mlp_only_layers=(), max_position_embeddings=4096)


def write_moe_checkpoint(folder: Path, **config) -> int:
    """A Qwen3-MoE checkpoint in the transformers layout, written one layer (one file) at a time so that
    building it never holds more than a layer: the names and shapes of a concrete one-layer model, renamed
    per layer, filled with seeded bf16 noise. Returns the bytes of its safetensors files."""
    import jax.numpy as jnp
    import ml_dtypes
    import safetensors.numpy
    from flax import nnx

    from models.hf import state_to_hf
    from models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(**config)
    one = Qwen3Moe(Qwen3MoeConfig(**{**config, "num_hidden_layers": 1}), rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                   param_dtype=jnp.bfloat16)
    template = {k: (v.shape, v.dtype) for k, v in state_to_hf(one, dtype=jnp.bfloat16).items()}
    del one
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    weight_map, total = {}, 0

    def fill(shape, dtype):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)

    files = [("model-globals.safetensors", {k: v for k, v in template.items() if ".layers." not in k})]
    files += [(f"model-layer{i:03d}.safetensors",
               {k.replace("model.layers.0.", f"model.layers.{i}."): v for k, v in template.items()
                if k.startswith("model.layers.0.")}) for i in range(cfg.num_hidden_layers)]
    for fn, names in files:
        tensors = {k: fill(shape, dtype if dtype != np.float32 else np.float32) for k, (shape, dtype) in names.items()}
        safetensors.numpy.save_file(tensors, str(folder / fn), metadata={"format": "pt"})
        weight_map.update({k: fn for k in tensors})
        total += (folder / fn).stat().st_size
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(cfg.to_hf("bfloat16")))
    assert ml_dtypes  # bf16 numpy arrays come from ml_dtypes
    return total


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory) -> tuple[Path, int]:
    folder = tmp_path_factory.mktemp("big-moe")
    return folder, write_moe_checkpoint(folder, **BIG)


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory) -> tuple[Path, int]:
    """4 of BIG's layers (0.85 GB): a checkpoint whose largest variable (a layer's stacked gate/up experts, 134 MB)
    is a sixth of it, where a loader's constant overhead shows (it grew peak RSS 1.39x once)."""
    folder = tmp_path_factory.mktemp("small-moe")
    return folder, write_moe_checkpoint(folder, **{**BIG, "num_hidden_layers": 4})


CHECK = textwrap.dedent("""
    def check_values(model, folder, layers=(0, 9)):
        '''Sampled variables against safetensors' own reader, assembled with numpy (stack, transpose).'''
        import numpy as np
        from safetensors import safe_open
        index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))["weight_map"]
        def tensor(name):
            with safe_open(os.path.join(folder, index[name]), "np") as f:
                return f.get_tensor(name)
        def local(arr):  # this process's shards of `arr`, as (index, values)
            return [(s.index, np.asarray(s.data)) for s in arr.addressable_shards]
        for i in layers:
            ex = model.layers[i].mlp.experts
            E = ex.num_experts
            p = f"model.layers.{i}.mlp.experts"
            for idx, got in local(ex.down[...]):
                e0, e1, _ = idx[0].indices(E)
                want = np.stack([tensor(f"{p}.{e}.down_proj.weight").T for e in range(e0, e1)])
                np.testing.assert_array_equal(got, want[(slice(None),) + tuple(idx[1:])])
            for idx, got in local(ex.gate_up[...]):
                e0, e1, _ = idx[0].indices(E)
                want = np.stack([np.concatenate([tensor(f"{p}.{e}.gate_proj.weight").T,
                                                 tensor(f"{p}.{e}.up_proj.weight").T], -1) for e in range(e0, e1)])
                np.testing.assert_array_equal(got, want[(slice(None),) + tuple(idx[1:])])
            q = model.layers[i].self_attn.q_proj.kernel[...]
            for idx, got in local(q):
                np.testing.assert_array_equal(got, tensor(f"model.layers.{i}.self_attn.q_proj.weight").T[idx])
        for idx, got in local(model.embed_tokens.weight[...]):
            np.testing.assert_array_equal(got, tensor("model.embed_tokens.weight")[idx])

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
""")

ONE_PROCESS = "import json, os, sys\n" + CHECK + textwrap.dedent("""
    import jax, jax.numpy as jnp
    from flax import nnx
    from models import from_pretrained
    from models.sharding import make_mesh, state_shardings
    folder, size, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    mesh = make_mesh(fsdp=4, expert=2)
    jax.block_until_ready(jnp.ones((8,)) + 1)  # the runtime up before the baseline
    base = status("VmRSS")
    stats = {}
    model = from_pretrained(folder, dtype=jnp.bfloat16, mesh=mesh, stats=stats)
    peak = status("VmHWM") - base
    state = nnx.state(model)
    for (path, var), (_, want) in zip(nnx.to_flat_state(state), nnx.to_flat_state(state_shardings(state, mesh)),
                                      strict=True):
        value = var.get_value()
        assert value.sharding.is_equivalent_to(want, value.ndim), (path, value.sharding, want)
        assert value.dtype == jnp.bfloat16 or "router" in str(path), (path, value.dtype)
    ex = model.layers[0].mlp.experts.gate_up[...]
    assert len({str(s.index) for s in ex.addressable_shards}) == 8  # expert x fsdp: 8 distinct slices
    check_values(model, folder, layers=(0, last))
    print(json.dumps({"peak_over_baseline": peak, "bytes_read": stats["bytes_read"], "size": size}))
""")


def _run(code: str, *args: str, devices: int | None = None, timeout: float = 900) -> dict:
    """Run `code` in a child process on `devices` fake CPU devices (None: one); the JSON its last line prints."""
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=cpu_devices_env(devices),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("which", ["big", "small"])
def test_a_moe_checkpoint_streams_onto_8_devices_within_its_own_size(which, request, measured):
    """2.1 GB and 0.85 GB: the bound holds where the largest variable is a sixth of the checkpoint too."""
    folder, size = request.getfixturevalue(f"{which}_checkpoint")
    layers = BIG["num_hidden_layers"] if which == "big" else 4
    assert size > (2e9 if which == "big" else 0.8e9)
    out = _run(ONE_PROCESS, str(folder), str(size), str(layers - 1), devices=8)
    ratio = out["peak_over_baseline"] / size
    assert out["bytes_read"] == size  # every byte once: the headers and each tensor's slices
    assert ratio < 1.3, out
    measured(f"  sharded load, 1 process x 8 CPU devices (fsdp 4 x expert 2): {size / 1e9:.2f} GB bf16 MoE "
             f"checkpoint, peak RSS +{out['peak_over_baseline'] / 1e9:.2f} GB = {ratio:.2f}x its size, "
             f"{out['bytes_read'] / 1e9:.2f} GB read")


TWO_PROCESSES = "import json, os, sys\n" + CHECK + textwrap.dedent("""
    import jax
    from tasks.training.distributed import initialize_from_env
    initialize_from_env()
    import jax.numpy as jnp
    from models import from_pretrained
    from models.sharding import make_mesh
    folder, size = sys.argv[1], int(sys.argv[2])
    assert jax.process_count() == 2 and len(jax.devices()) == 8 and len(jax.local_devices()) == 4
    mesh = make_mesh(fsdp=4, expert=2)
    stats = {}
    model = from_pretrained(folder, dtype=jnp.bfloat16, mesh=mesh, stats=stats)
    check_values(model, folder, layers=(0,))
    print(json.dumps({"process": jax.process_index(), "bytes_read": stats["bytes_read"], "size": size}))
""")


def test_two_processes_each_read_only_their_share(small_checkpoint, tmp_path, measured):
    """4 layers (0.85 GB) are enough: the share is a ratio."""
    from flows.gang import run_gang

    folder, size = small_checkpoint
    script = tmp_path / "member.py"
    script.write_text(TWO_PROCESSES)
    lines: dict[int, list[str]] = {0: [], 1: []}
    run_gang([sys.executable, str(script), str(folder), str(size)], 2, on_line=lambda i, s: lines[i].append(s),
             env={**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4"}, timeout=900)
    outs = [json.loads(lines[i][-1]) for i in (0, 1)]
    shares = [o["bytes_read"] / size for o in outs]
    assert all(s <= 0.6 for s in shares), shares
    assert sum(shares) >= 1.0  # together they read it all (replicated norms and routers twice)
    measured(f"  sharded load, 2 processes x 4 CPU devices: each read {shares[0]:.1%} / {shares[1]:.1%} of a "
             f"{size / 1e9:.2f} GB checkpoint")


S3_LOAD = "import json, os, sys\n" + CHECK + textwrap.dedent("""
    import jax.numpy as jnp
    import storage
    from models import from_pretrained
    from models.sharding import make_mesh
    def refuse(*a, **k):
        raise AssertionError("the checkpoint was copied whole")
    storage.download_dir = storage.download_file = refuse
    url, folder, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    stats = {}
    import time
    t0 = time.perf_counter()
    model = from_pretrained(url, dtype=jnp.bfloat16, mesh=make_mesh(fsdp=4, expert=2), stats=stats)
    seconds = time.perf_counter() - t0
    check_values(model, folder, layers=(0, 1))
    print(json.dumps({"bytes_read": stats["bytes_read"], "size": size, "seconds": seconds}))
""")


def test_from_the_s3_server_without_a_local_copy(tmp_path, s3_env, measured):
    import storage

    folder = tmp_path / "ckpt"
    size = write_moe_checkpoint(folder, **{**BIG, "num_hidden_layers": 2})
    url = "s3://forgeline/test-loading/moe-2l"
    storage.upload_dir(folder, url)
    out = _run(S3_LOAD, url, str(folder), str(size), devices=8)
    # one ranged GET per span a slice lies in, reused by the other devices' slices inside it: one process
    # holding every device fetches each byte once
    assert out["bytes_read"] == size, out
    measured(f"  sharded load from S3 (SeaweedFS, ranged reads): {size / 1e9:.2f} GB checkpoint in "
             f"{out['seconds']:.1f}s, {out['bytes_read'] / size:.2f}x its bytes transferred, no local copy")


def test_the_load_benchmark_runs_and_prints_its_ratio(measured):
    """benchmarks/load.py at a small size: the table (forgeline vs safetensors + torch on the same file)."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.load", "--gb", "0.4", "--repeats", "2"], cwd=REPO,
                          env={**users_xla_flags(dict(os.environ)), "JAX_PLATFORMS": "cpu"}, capture_output=True,
                          text=True, timeout=900)  # XLA at its default level: the transposes' speed is measured
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "GB/s" not in line]
    ours, peer, bound = (float(r.split("|")[3]) for r in rows[:3])  # the loaders' table: GB/s
    assert ours > 0 and peer > 0 and bound > 0
    split = {r.split("|")[1].strip(): float(r.split("|")[2]) for r in rows[4:]}  # where forgeline's load went
    assert set(split) == {"structure", "read", "place", "layout", "total"}, rows
    assert split["read"] > 0 and split["layout"] > 0  # a MoE checkpoint's experts are read and transposed
    assert abs(sum(v for k, v in split.items() if k != "total") - split["total"]) < 0.5 * split["total"]
    for line in proc.stdout.splitlines():
        measured(f"  {line}")
