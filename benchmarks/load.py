"""Checkpoint load throughput: a local safetensors file to sharded JAX arrays, against safetensors + torch
reading the same file, in the same run.

    python -m benchmarks.load [--gb 1.0] [--devices 8] [--repeats 3]

Writes one bf16 Qwen3-MoE checkpoint of about `--gb` GB (64 experts per layer, as test_loading builds) in a
single `model.safetensors`, then times, each the best of `--repeats` after a warm-up read (so both read from
the page cache; the first read from disk is the disk's, not the loader's):

- forgeline: `models.from_pretrained(folder, dtype=bfloat16, mesh=...)`: every tensor read slice by slice
  (only the bytes each device holds) into arrays sharded FSDP x expert over `--devices` devices (fake CPU
  devices here), including building the model's structure;
- peer: `safetensors.torch.load_file(path)`, the way a torch user loads a checkpoint (whole tensors on the
  CPU, no sharding, no model), each tensor copied once (`clone()`, as `load_state_dict` copies into the
  model: `load_file` alone only maps the file).

Prints GB/s for both and their ratio (forgeline / peer), then where forgeline's best load spent its time
(`from_pretrained(stats=...)`: building the model's structure, reading slices into the devices' buffers on a
thread pool -- a bf16 checkpoint has nothing to dequantize --, placing them, and the part of the on-device
layout change -- [out, in] weights to [in, out] kernels, experts stacked -- that the reads did not hide),
and the rate of a plain copy of the file from the page cache into fresh memory: the bound both loaders share.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def _prepare_devices(n: int) -> None:
    if "jax" not in sys.modules:  # fake CPU devices: only before jax starts
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def write_checkpoint(folder: Path, gb: float) -> int:
    """A bf16 Qwen3-MoE checkpoint of about `gb` GB in one file; returns its size in bytes."""
    import jax.numpy as jnp
    import numpy as np
    import safetensors.numpy
    from flax import nnx

    from models.hf import state_to_hf
    from models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig

    per_layer = 64 * 3 * 1024 * 512 * 2  # experts dominate: 201 MB a layer
    layers = max(1, round(gb * 1e9 / per_layer))
    config = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
                  num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
                  num_experts=64, num_experts_per_tok=4, mlp_only_layers=(), max_position_embeddings=4096)
    one = Qwen3Moe(Qwen3MoeConfig(**{**config, "num_hidden_layers": 1}), rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                   param_dtype=jnp.bfloat16)
    template = {k: (v.shape, v.dtype) for k, v in state_to_hf(one, dtype=jnp.bfloat16).items()}
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(layers):
        for k, (shape, dtype) in template.items():
            if k.startswith("model.layers.0.") or (i == 0 and ".layers." not in k):
                name = k.replace("model.layers.0.", f"model.layers.{i}.")
                tensors[name] = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(dtype)
    folder.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(Qwen3MoeConfig(**config).to_hf("bfloat16")))
    return (folder / "model.safetensors").stat().st_size


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load", description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=1.0, help="checkpoint size (GB)")
    p.add_argument("--devices", type=int, default=8, help="fake CPU devices to shard over (CPU only)")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    _prepare_devices(a.devices)
    import jax
    import jax.numpy as jnp

    import models
    from benchmarks.run import _best
    from models.sharding import make_mesh

    devices = jax.devices()
    expert = 2 if len(devices) % 2 == 0 else 1
    mesh = make_mesh(fsdp=len(devices) // expert, expert=expert)
    with tempfile.TemporaryDirectory(prefix="forgeline-bench-load-") as tmp:
        folder = Path(tmp)
        size = write_checkpoint(folder, a.gb)

        splits: list[dict[str, float]] = []

        def ours() -> None:
            stats: dict = {}
            model = models.from_pretrained(str(folder), dtype=jnp.bfloat16, mesh=mesh, stats=stats)
            jax.block_until_ready([v.get_value() for v in _variables(model)])
            splits.append(stats["seconds"])

        def copy() -> None:  # the file's bytes into fresh memory: what any loader must at least do
            import numpy as np

            out = np.empty(size, np.uint8)
            with open(folder / "model.safetensors", "rb", buffering=0) as f:
                f.readinto(memoryview(out))

        def peer() -> None:  # load_file maps the file; clone() reads it, as load_state_dict's copy would
            import safetensors.torch

            for t in safetensors.torch.load_file(str(folder / "model.safetensors")).values():
                t.clone()

        t_ours, t_peer, t_copy = _best(ours, a.repeats), _best(peer, a.repeats), _best(copy, a.repeats)
    gbs_ours, gbs_peer = size / t_ours / 1e9, size / t_peer / 1e9
    split = min(splits[1:], key=lambda sp: sp["total"])  # the best timed run (not the warm-up)
    print(f"checkpoint: {size / 1e9:.2f} GB bf16 (Qwen3-MoE, 64 experts/layer), one file, page cache warm; "
          f"mesh {dict(mesh.shape)} on {len(devices)} {devices[0].platform} devices")
    print("| loader | seconds | GB/s | ratio |")
    print("|---|---|---|---|")
    print(f"| forgeline from_pretrained(mesh=...) -> sharded jax.Arrays | {t_ours:.2f} | {gbs_ours:.2f} | "
          f"{gbs_ours / gbs_peer:.2f} |")
    print(f"| safetensors.torch.load_file -> torch CPU tensors (peer) | {t_peer:.2f} | {gbs_peer:.2f} | 1.00 |")
    print(f"| one read() of the file into fresh memory (bound) | {t_copy:.2f} | {size / t_copy / 1e9:.2f} | "
          f"{t_peer / t_copy:.2f} |")
    print()
    print("| forgeline's best load | seconds | share |")
    print("|---|---|---|")
    for key in ("structure", "read", "place", "layout"):
        print(f"| {key} | {split.get(key, 0.0):.3f} | {split.get(key, 0.0) / split['total']:.0%} |")
    print(f"| total | {split['total']:.3f} | 100% |")


def _variables(model):
    from flax import nnx

    return [v for _, v in nnx.to_flat_state(nnx.state(model))]


if __name__ == "__main__":
    from tasks.host_memory import reexec_tuned

    reexec_tuned()  # the host-memory setting `forgeline` runs under (both sides of the comparison share it)
    main()
