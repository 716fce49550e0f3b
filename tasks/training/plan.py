"""The capacity planner: will a fine-tune of this model fit on these devices, and with which mesh?

    python -m tasks.training.plan MODEL --mode lora|full --seq-len T --global-batch B --devices N \\
        --device-memory GIB --hosts H [--json]            (also `forgeline plan ...`)

MODEL is a preset (models/presets: deepseek-v3, kimi-k2, glm-4.5, deepseek-v3.2, glm-5, ...) or a config.json (a
file, a folder or a URL holding one). Nothing is allocated: the model is built with `nnx.eval_shape`, and the *real*
train step (`tasks.training.trainer.make_train_step`, the function the Trainer jits) is compiled ahead of time on
abstract arrays (`jax.ShapeDtypeStruct` with their shardings) over a mesh of N fake CPU devices
(`--xla_force_host_platform_device_count`, set by `run_in_subprocess` before JAX starts), in the spirit of
MaxText's `train_compile.py`. Per device it reports:

- params, grads, optimizer: exact, from the shapes and the shardings the rule table (models/sharding.py) gives
  each variable — the trainable parameters, their gradients (same dtype), the optimizer state; `frozen` is the
  rest of the model (LoRA's base) and `batch` the step's input rows;
- temp: what XLA's buffer assignment reserves beyond the arguments (`compiled.memory_analysis()`: activations
  kept for the backward pass, the gathered FSDP weights, the gradients, collectives' buffers), minus the
  gradients reported on their own line;
- total = params + frozen + optimizer + batch + grads + temp, against `--device-memory`.

Compiling 61 layers of a 671B model on one CPU takes long, so the step is compiled at two small depths that
keep the family's layer pattern (DeepSeek-V3's 3 dense layers, GPT-OSS's alternating sliding/full attention)
and the temporaries are extrapolated linearly in the number of layers (every layer of the repeating part is
the same program, so XLA's per-layer buffers repeat); parameters and optimizer state are never extrapolated.
tests/unit/test_plan.py checks the extrapolation against full-depth compiles and the totals against what
training on 8 CPU devices really uses (peak RSS).

Meshes: every (data, fsdp, tensor, expert) factorisation of N that the model divides (tensor within a host,
expert dividing the routed experts, the batch rows dividing the batch axes) is scored by its exact
per-device state bytes and an estimated step time (compute at `--peak-tflops` × `--mfu`, plus collective
traffic over NVLink-class links inside a host and network links across hosts, not overlapped: a
conservative model, see `_comm_seconds`); the `--compile` best are compiled and ranked by fit, then time.
FLOPs per step follow PaLM's accounting (tasks/training/flops.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

GIB = 2**30
# Published per-GPU figures used as defaults: H100/H200 SXM dense bf16 989 TFLOP/s (NVIDIA H100 and H200
# datasheets); NVLink 4 at 900 GB/s per GPU, 450 GB/s each way; one 400 Gb/s NIC per GPU (50 GB/s).
DEFAULT_PEAK_TFLOPS = 989.0
DEFAULT_MFU = 0.40
INTRA_HOST_GBPS = 450.0
INTER_HOST_GBPS = 50.0


@dataclasses.dataclass(frozen=True)
class Request:
    """What to plan: the model (a config.json dict), the fine-tune and the cluster."""

    config: dict[str, Any]
    name: str
    mode: str = "lora"  # lora | full
    seq_len: int = 4096
    global_batch: int = 64
    devices: int = 8
    hosts: int = 1
    device_memory_gib: float = 80.0
    param_dtype: str | None = None  # None: bfloat16 for lora (frozen base), float32 for full (master weights)
    compute_dtype: str = "bfloat16"
    remat: str = "full"
    grad_accum: int = 1
    optimizer: str = "adamw"
    lora_rank: int = 16
    lora_targets: tuple[str, ...] | None = None
    mesh: dict[str, int] | None = None  # fixed (data, fsdp, tensor, expert); None: search
    compile_top: int = 3
    full_depth: bool = False  # compile every layer instead of extrapolating from two depths
    moe_capacity_factor: float | None = None  # None: dropless expert parallelism
    peak_tflops: float = DEFAULT_PEAK_TFLOPS
    mfu: float = DEFAULT_MFU

    @property
    def dtype(self) -> str:
        return self.param_dtype or ("bfloat16" if self.mode == "lora" else "float32")

    def train_config(self) -> Any:
        from tasks.training.config import TrainConfig

        return TrainConfig(batch_size=self.global_batch, grad_accum=self.grad_accum, optimizer=self.optimizer,
                           compute_dtype=self.compute_dtype, remat=self.remat,
                           moe_capacity_factor=self.moe_capacity_factor)


# ------------------------------------------------------------------------------------------------
# The model, abstractly
# ------------------------------------------------------------------------------------------------


def family_config(config: Mapping[str, Any], source: str = "config.json") -> tuple[Any, type]:
    from models import families

    config_cls, model_cls = families.resolve(config, source)
    return config_cls.from_hf(dict(config)), model_cls


def abstract_model(cfg: Any, model_cls: type, req: Request) -> Any:
    """The model (LoRA factors attached for `lora`) with ShapeDtypeStruct values: nothing allocated."""
    import jax.numpy as jnp
    from flax import nnx

    from models import abstract, lora
    from models.lora_targets import ALL_LINEAR

    dtype = jnp.dtype(req.dtype)

    def build():
        model = model_cls(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
        if req.mode == "lora":
            lora.apply_lora(model, rank=req.lora_rank, alpha=2.0 * req.lora_rank,
                            targets=req.lora_targets or ALL_LINEAR, rngs=nnx.Rngs(1))
        return model

    return abstract.eval_shape(build)


def with_depth(cfg: Any, n: int) -> Any:
    """`cfg` with its first `n` main-stack layers (per-layer fields cut to match)."""
    changes: dict[str, Any] = {"num_hidden_layers": n}
    if getattr(cfg, "layer_types", None) is not None:
        changes["layer_types"] = tuple(cfg.layer_types[:n])
    if getattr(cfg, "mlp_layer_types", None) is not None:  # DeepSeek-V4's hash / learned routing per layer
        changes["mlp_layer_types"] = tuple(cfg.mlp_layer_types[:n])
    if getattr(cfg, "mlp_only_layers", None):
        changes["mlp_only_layers"] = tuple(i for i in cfg.mlp_only_layers if i < n)
    return dataclasses.replace(cfg, **changes)


def depth_pattern(cfg: Any) -> tuple[int, int]:
    """(k0, p): the main stack is k0 leading layers, then a pattern that repeats every p layers (layers alike
    when their FLOPs accounting — width of the MLP or MoE, attention window — is alike)."""
    sig = [(lf.matmul_params, lf.window) for lf in cfg.layer_flops()]
    L = len(sig)
    for k0, p in sorted(itertools.product(range(min(L, 9)), range(1, 5)), key=lambda kp: (kp[0] + kp[1], kp[1])):
        if all(sig[i] == sig[i - p] for i in range(k0 + p, L)):
            return k0, p
    return L, 1  # no pattern: compile it whole


def parameter_count(model: Any) -> dict[str, int]:
    from flax import nnx

    count = lambda f: sum(math.prod(v.get_value().shape) for _, v in nnx.to_flat_state(nnx.state(model, f)))
    return {"total": count(nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))), "lora": count(nnx.LoRAParam)}


# ------------------------------------------------------------------------------------------------
# Meshes: candidates, exact per-device state bytes, a communication estimate
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeshShape:
    data: int
    fsdp: int
    tensor: int
    expert: int

    @property
    def shape(self) -> dict[str, int]:  # what models.sharding.logical_to_spec reads of a mesh
        return dataclasses.asdict(self)

    def label(self) -> str:
        return f"data {self.data} x fsdp {self.fsdp} x tensor {self.tensor} x expert {self.expert}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_meshes(req: Request, cfg: Any) -> list[MeshShape]:
    """Every factorisation of the devices that this model and batch can use: tensor a power of two within one
    host that divides the heads, expert dividing the routed experts (1 for a dense model), and the rows of
    one micro-batch divisible by data x fsdp x expert (the batch axes)."""
    N, per_host = req.devices, req.devices // req.hosts
    heads = cfg.num_attention_heads
    experts = next((getattr(cfg, k) for k in ("n_routed_experts", "num_experts", "num_local_experts")
                    if getattr(cfg, k, None)), 0)
    rows = req.global_batch // req.grad_accum
    out = []
    for tensor in (1, 2, 4, 8):
        for expert in _divisors(N // tensor) if N % tensor == 0 else []:
            if tensor > per_host or heads % tensor or (expert > 1 and (not experts or experts % expert)):
                continue
            for data in _divisors(N // (tensor * expert)):
                fsdp = N // (tensor * expert * data)
                if rows % (data * fsdp * expert) == 0:
                    out.append(MeshShape(data, fsdp, tensor, expert))
    return out


def _shard_bytes(shape: Sequence[int], dtype: Any, names: Sequence[str | None] | None, mesh: MeshShape,
                 rules: Mapping[str, Any]) -> int:
    """Bytes one device holds of an array laid out by its logical axes on `mesh` (the rule table's choices,
    indivisible dimensions replicated: models.sharding.logical_to_spec)."""
    import numpy as np

    from models.sharding import logical_to_spec

    spec = logical_to_spec(names or (None,) * len(shape), rules, shape, mesh)  # type: ignore[arg-type]
    n = math.prod(shape)
    for axes in spec:
        for a in (axes,) if isinstance(axes, str) else axes or ():
            n //= mesh.shape[a]
    return n * np.dtype(dtype).itemsize


def _var_bytes(state: Any, mesh: MeshShape, rules: Mapping[str, Any]) -> int:
    from flax import nnx

    total = 0
    for _, var in nnx.to_flat_state(state):
        value = var.get_value()
        names = var.get_metadata().get("out_sharding")
        total += _shard_bytes(value.shape, value.dtype, tuple(names) if names else None, mesh, rules)
    return total


def state_bytes(params: Any, frozen: Any, opt_state: Any, mesh: MeshShape, rules: Mapping[str, Any],
                req: Request) -> dict[str, int]:
    """Per-device bytes of the step's arguments, exactly: trainable params, their gradients, the optimizer
    state (a leaf shaped like a parameter is sharded like it, the rest replicated: as the Trainer places
    it), the frozen rest and the batch (input ids, targets, positions, segment ids int32; the loss mask int8)."""
    import jax
    import numpy as np
    from flax import nnx

    p = _var_bytes(params, mesh, rules)
    is_var = lambda x: isinstance(x, nnx.Variable)
    by_path = {jax.tree_util.keystr(path): var
               for path, var in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)[0]}
    opt = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state):
        var = next((by_path[k] for i in range(len(path)) for j in range(len(path), i, -1)
                    if (k := jax.tree_util.keystr(path[i:j])) in by_path), None)
        if var is not None and tuple(var.get_value().shape) == tuple(leaf.shape):
            names = var.get_metadata().get("out_sharding")
            opt += _shard_bytes(leaf.shape, leaf.dtype, tuple(names) if names else None, mesh, rules)
        else:  # counts, scalars: replicated
            opt += math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    rows = req.global_batch // (mesh.data * mesh.fsdp * mesh.expert)
    batch = rows * req.seq_len * (4 * 4 + 1)
    return {"params": p, "grads": p, "optimizer": opt, "frozen": _var_bytes(frozen, mesh, rules), "batch": batch}


def _comm_seconds(req: Request, cfg: Any, mesh: MeshShape, n_params: int, n_trainable: int) -> float:
    """A deliberately simple, conservative estimate of one step's collective time per device (no overlap with
    compute), for ranking meshes. Ring collectives move (n-1)/n of the buffer; the mesh's axes are laid out
    innermost-last (models.sharding.make_mesh), so an axis whose span stays inside one host gets NVLink-class
    bandwidth and one that crosses hosts a network link's:
    - fsdp: all-gather of the weights (the device's tensor x expert slice, in the compute dtype) in the
      forward and in the backward (once more with remat), reduce-scatter of the trainable gradients;
    - data: all-reduce (2x a reduce-scatter) of the gradients a data replica holds;
    - tensor: 2 all-reduces of the [rows, T, D] activations per layer forward, 2 backward;
    - expert: all-to-all of the routed tokens (top-k copies of [rows, T, D]) in and out, forward and backward.
    """
    per_host = req.devices // req.hosts
    span, inner = {}, 1
    for axis in ("expert", "tensor", "fsdp", "data"):
        inner *= getattr(mesh, axis)
        span[axis] = inner
    bw = {a: (INTRA_HOST_GBPS if span[a] <= per_host else INTER_HOST_GBPS) * 1e9 for a in span}
    cdt = 2 if req.compute_dtype == "bfloat16" else 4
    gdt = 2 if req.dtype == "bfloat16" else 4
    ring = lambda n: (n - 1) / n if n > 1 else 0.0
    L = cfg.num_hidden_layers
    rows = req.global_batch / (mesh.data * mesh.fsdp * mesh.expert)
    act = rows * req.seq_len * cfg.hidden_size * cdt  # one [rows, T, D] activation
    slice_ = mesh.tensor * mesh.expert
    gathers = 3 if req.remat != "none" else 2
    t = ring(mesh.fsdp) * n_params * cdt / slice_ * gathers / bw["fsdp"]
    t += ring(mesh.fsdp) * n_trainable * gdt / slice_ / bw["fsdp"]
    t += 2 * ring(mesh.data) * n_trainable * gdt / (mesh.fsdp * slice_) / bw["data"]
    t += 4 * L * 2 * ring(mesh.tensor) * act / bw["tensor"]
    t += 4 * L * ring(mesh.expert) * act * getattr(cfg, "num_experts_per_tok", 0) / bw["expert"]
    return t


# ------------------------------------------------------------------------------------------------
# Compiling the step
# ------------------------------------------------------------------------------------------------


def _abstract(state: Any, shardings: Any) -> Any:
    """`state` with every value replaced by a ShapeDtypeStruct carrying its sharding."""
    import jax

    leaves, treedef = jax.tree_util.tree_flatten(state)
    shard_leaves = jax.tree.leaves(shardings)
    assert len(leaves) == len(shard_leaves), (len(leaves), len(shard_leaves))
    return jax.tree_util.tree_unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                                                  for x, s in zip(leaves, shard_leaves, strict=True)])


def compile_step(cfg: Any, model_cls: type, req: Request, mesh_shape: MeshShape) -> dict[str, Any]:
    """Compile the real train step for `cfg` on abstract arrays over a mesh of fake devices; returns the
    memory analysis, the exact state bytes and the compile time."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from models.sharding import RULES, make_mesh, named_sharding, set_activation_sharding, state_shardings
    from tasks.training.losses import xent_sum_and_aux
    from tasks.training.optimizers import make_optimizer
    from tasks.training.trainer import _state_shardings_like, make_train_step, prepare_for_training

    t0 = time.perf_counter()
    tcfg = req.train_config()
    mesh = make_mesh(data=mesh_shape.data, fsdp=mesh_shape.fsdp, tensor=mesh_shape.tensor, expert=mesh_shape.expert,
                     devices=jax.devices()[: req.devices])
    model = abstract_model(cfg, model_cls, req)
    set_activation_sharding(model, mesh, RULES, req.moe_capacity_factor)
    prepare_for_training(model, tcfg)
    trainable = nnx.LoRAParam if req.mode == "lora" else nnx.Param
    graphdef, params, rng_state, frozen = nnx.split(model, trainable, nnx.RngState, ...)
    params_a, rng_a, frozen_a = (_abstract(s, state_shardings(s, mesh, RULES)) for s in (params, rng_state, frozen))
    tx = make_optimizer(tcfg)
    replicated = NamedSharding(mesh, PartitionSpec())
    opt_shape = jax.eval_shape(tx.init, params_a)
    opt_sh = _state_shardings_like(opt_shape, params_a, replicated)
    opt_a = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), opt_shape, opt_sh)
    batch_sh = named_sharding(mesh, ("batch", "length"), RULES)
    B, T = req.global_batch, req.seq_len
    batch = {c: jax.ShapeDtypeStruct((B, T), jnp.int8 if c == "loss_mask" else jnp.int32, sharding=batch_sh)
             for c in ("input_ids", "target_ids", "positions", "segment_ids", "loss_mask")}
    step = make_train_step(graphdef, tx, tcfg, xent_sum_and_aux)
    out_sh = (jax.tree.map(lambda x: x.sharding, params_a), opt_sh, jax.tree.map(lambda x: x.sharding, rng_a),
              replicated)
    lowered = jax.jit(step, donate_argnums=(0, 1, 2), out_shardings=out_sh).lower(params_a, opt_a, rng_a, frozen_a,
                                                                                 batch)
    compiled = lowered.compile()
    ma = compiled.memory_analysis()
    exact = state_bytes(params, frozen, opt_shape, mesh_shape, RULES, req)
    return {"temp": int(ma.temp_size_in_bytes), "argument": int(ma.argument_size_in_bytes),
            "output": int(ma.output_size_in_bytes), "alias": int(ma.alias_size_in_bytes),
            "exact": exact, "seconds": time.perf_counter() - t0}


def plan_mesh(cfg: Any, model_cls: type, req: Request, mesh: MeshShape, state: tuple[Any, Any, Any],
              full_depth: bool = False) -> dict[str, Any]:
    """Per-device bytes of the step on `mesh`: the exact state bytes of the full model's `state` (trainable
    params, frozen rest, abstract optimizer state), and the temporaries of the step.

    XLA:CPU does not keep rematerialisation: it drops `jax.checkpoint`'s optimisation barriers and merges the
    recomputation with the forward (a chain of 40 checkpointed matmuls compiles to the same program and the
    same temporaries as without them), so a CPU compile of a remat'd step reports the memory of keeping every
    activation. Hence, with `remat: full` the step is compiled without remat at depths 1, a and b of the
    layer pattern (b - a gives one repeating layer's activations) and the plan keeps what full remat keeps on
    a GPU: the one-layer step's temporaries plus one repeating layer's activations (the layer being
    recomputed; conservative, as if both were live), every other layer's input [rows, T, D] in the compute
    dtype, and the exact gradient bytes of all layers. Without remat (and for `dots`, an upper
    bound) the temporaries at depths a and b are extrapolated linearly.
    `full_depth=True` compiles every layer (without remat's saving, on CPU)."""
    from models.sharding import RULES

    L = cfg.num_hidden_layers
    k0, p = depth_pattern(cfg)
    a, b = k0 + p, k0 + 2 * p
    exact = state_bytes(*state, mesh, RULES, req)
    if full_depth or b >= L:
        run = compile_step(cfg, model_cls, req, mesh)
        temp, seconds, depths = run["temp"], run["seconds"], [L]
    elif req.remat == "full":
        plain = dataclasses.replace(req, remat="none")
        runs = {n: compile_step(with_depth(cfg, n), model_cls, plain, mesh) for n in sorted({1, a, b})}
        grads = lambda n: runs[n]["exact"]["grads"]
        # one repeating layer's activations without remat: its temporaries less its gradients
        layer = max((runs[b]["temp"] - runs[a]["temp"] - (grads(b) - grads(a))) / (b - a), 0.0)
        rows = req.global_batch // req.grad_accum // (mesh.data * mesh.fsdp * mesh.expert)
        saved = rows * req.seq_len * cfg.hidden_size * (2 if req.compute_dtype == "bfloat16" else 4)
        # full remat keeps one layer's activations (the layer being recomputed) and every other layer's input:
        # the one-layer step's temporaries (the embedding, logits and loss, and the first layer) plus one
        # repeating layer's activations (conservative: as if both were live), the inputs, all gradients
        temp = runs[1]["temp"] - grads(1) + layer + (L - 1) * saved + exact["grads"]
        seconds, depths = sum(r["seconds"] for r in runs.values()), sorted(runs)
    else:
        ra = compile_step(with_depth(cfg, a), model_cls, req, mesh)
        rb = compile_step(with_depth(cfg, b), model_cls, req, mesh)
        temp = rb["temp"] + (rb["temp"] - ra["temp"]) * (L - b) / (b - a)
        seconds, depths = ra["seconds"] + rb["seconds"], [a, b]
    per_device = {"params": exact["params"], "frozen": exact["frozen"], "grads": exact["grads"],
                  "optimizer": exact["optimizer"], "batch": exact["batch"],
                  "temp": max(int(temp) - exact["grads"], 0)}  # XLA's temporaries hold the gradients
    per_device["total"] = sum(per_device.values())
    return {"bytes_per_device": per_device, "compiled_depths": depths, "compile_seconds": round(seconds, 1)}


# ------------------------------------------------------------------------------------------------
# The plan
# ------------------------------------------------------------------------------------------------


def plan(req: Request) -> dict[str, Any]:
    """The whole plan as one JSON-ready object (see the module docstring)."""
    from flax import nnx

    from models.sharding import RULES
    from tasks.training.flops import matmul_params_per_token, train_flops_per_token
    from tasks.training.optimizers import make_optimizer
    from tasks.training.trainer import adapter_params_per_token, prepare_for_training

    cfg, model_cls = family_config(req.config, req.name)
    model = abstract_model(cfg, model_cls, req)
    counts = parameter_count(model)
    prepare_for_training(model, req.train_config())
    trainable = nnx.LoRAParam if req.mode == "lora" else nnx.Param
    _, params, _, frozen = nnx.split(model, trainable, nnx.RngState, ...)
    import jax

    opt_shape = jax.eval_shape(make_optimizer(req.train_config()).init, params)
    n_trainable = counts["lora"] if req.mode == "lora" else counts["total"]
    tokens = req.global_batch * req.seq_len
    adapter = adapter_params_per_token(params, cfg) if req.mode == "lora" else 0
    flops_per_token = train_flops_per_token(cfg, req.seq_len, trainable_only=req.mode == "lora",
                                            adapter_params=adapter, causal=True)
    flops = flops_per_token * tokens
    compute_s = flops / (req.devices * req.peak_tflops * 1e12 * req.mfu)
    memory = req.device_memory_gib * GIB

    if req.mesh is not None:
        meshes = [MeshShape(**{"data": 1, "tensor": 1, "expert": 1, **req.mesh,
                               "fsdp": req.mesh.get("fsdp") or req.devices // (
                                   req.mesh.get("data", 1) * req.mesh.get("tensor", 1) * req.mesh.get("expert", 1))})]
        if math.prod(dataclasses.astuple(meshes[0])) != req.devices:
            raise ValueError(f"mesh: {meshes[0].label()} is not {req.devices} devices")
    else:
        meshes = candidate_meshes(req, cfg)
        if not meshes:
            raise ValueError(f"no mesh of {req.devices} devices divides this model and a batch of "
                             f"{req.global_batch // req.grad_accum} rows per micro-batch")
    scored = []
    for m in meshes:
        ex = state_bytes(params, frozen, opt_shape, m, RULES, req)
        state = ex["params"] + ex["frozen"] + ex["optimizer"] + ex["grads"]
        comm = _comm_seconds(req, cfg, m, counts["total"], n_trainable)
        scored.append((state > memory, compute_s + comm, state, m, comm))  # (does not fit, time, state, ...)
    # compile the fastest meshes whose state leaves at least 40% of the memory to activations, and the mesh
    # with the least state (the most likely to fit when activations are large)
    scored.sort(key=lambda s: (s[2] > 0.6 * memory, s[1], s[2]))
    chosen = scored[: max(req.compile_top, 1)]
    least = min(scored, key=lambda s: (s[2], s[1]))
    if least not in chosen and req.compile_top > 1:
        chosen = [*chosen[:-1], least]
    rows = []
    for _, est, _, m, comm in chosen:
        one = plan_mesh(cfg, model_cls, req, m, (params, frozen, opt_shape), full_depth=req.full_depth)
        b = one["bytes_per_device"]
        rows.append({"mesh": m.shape, "bytes_per_device": b, "fits": b["total"] <= memory,
                     "headroom_gib": round((memory - b["total"]) / GIB, 2), "comm_seconds_est": comm,
                     "step_seconds_est": est, **{k: one[k] for k in ("compiled_depths", "compile_seconds")}})
    rows.sort(key=lambda r: (not r["fits"], r["step_seconds_est"], r["bytes_per_device"]["total"]))
    best = rows[0]
    return {
        "model": req.name, "architecture": type(cfg).__name__.removesuffix("Config"),
        "mode": req.mode, "param_dtype": req.dtype, "compute_dtype": req.compute_dtype, "remat": req.remat,
        "seq_len": req.seq_len, "global_batch": req.global_batch, "grad_accum": req.grad_accum,
        "devices": req.devices, "hosts": req.hosts, "device_memory_gib": req.device_memory_gib,
        "parameters": {"total": counts["total"], "trainable": n_trainable,
                       "active_per_token": int(matmul_params_per_token(cfg))},
        "mesh": best["mesh"], "bytes_per_device": best["bytes_per_device"], "fits": best["fits"],
        "flops_per_step": flops, "peak_tflops": req.peak_tflops, "mfu": req.mfu,
        "step_seconds": best["step_seconds_est"], "tokens_per_second": tokens / best["step_seconds_est"],
        "candidates": rows, "meshes_considered": len(meshes),
    }


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------


def _g(n: float) -> str:
    return f"{n / GIB:.1f}"


def format_plan(p: Mapping[str, Any]) -> str:
    """The plan as a short report and a table of the compiled meshes."""
    par = p["parameters"]
    lines = [
        f"{p['model']} ({p['architecture']}): {par['total'] / 1e9:.1f}B parameters, "
        f"{par['active_per_token'] / 1e9:.1f}B matmul weights per token; {p['mode']} fine-tune trains "
        f"{par['trainable'] / 1e9:.3f}B",
        f"{p['devices']} devices on {p['hosts']} hosts, {p['device_memory_gib']:g} GiB each; batch "
        f"{p['global_batch']} x {p['seq_len']} tokens; params {p['param_dtype']}, compute {p['compute_dtype']}, "
        f"remat {p['remat']}",
        f"FLOPs per step {p['flops_per_step']:.3e}; at {p['peak_tflops']:g} TFLOP/s x MFU {p['mfu']:.0%} plus "
        f"estimated communication: {p['step_seconds']:.2f} s per step, {p['tokens_per_second']:,.0f} tokens/s",
        "",
        "| mesh (data x fsdp x tensor x expert) | params | frozen | grads | optimizer | batch | temp | total GiB "
        "| fits | est. step s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in p["candidates"]:
        m, b = r["mesh"], r["bytes_per_device"]
        lines.append(f"| {m['data']} x {m['fsdp']} x {m['tensor']} x {m['expert']} | {_g(b['params'])} | "
                     f"{_g(b['frozen'])} | {_g(b['grads'])} | {_g(b['optimizer'])} | {_g(b['batch'])} | "
                     f"{_g(b['temp'])} | {_g(b['total'])} | {'yes' if r['fits'] else 'NO'} | "
                     f"{r['step_seconds_est']:.2f} |")
    verdict = "fits" if p["fits"] else "does NOT fit"
    lines += ["", f"best: {MeshShape(**p['mesh']).label()}: {_g(p['bytes_per_device']['total'])} GiB per device of "
                  f"{p['device_memory_gib']:g}: {verdict} ({p['meshes_considered']} meshes considered, "
                  f"{len(p['candidates'])} compiled)"]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------


def resolve_model(model: str) -> tuple[dict[str, Any], str]:
    """A preset name, a config.json file or a folder/URL holding one -> (config dict, display name)."""
    from models import presets

    if model in presets.PRESETS:
        return presets.load_preset(model), model
    from models.hf import load_config

    if model.endswith(".json"):
        import storage

        try:
            return json.loads(storage.read_bytes(model) if "://" in model else open(model, "rb").read()), model
        except FileNotFoundError:
            raise ValueError(f"MODEL: no such file: {model}") from None
        except (OSError, ValueError) as e:
            raise ValueError(f"MODEL: {model}: cannot read config ({type(e).__name__}: {e})") from None
    if "://" not in model and not os.path.isdir(model):
        raise ValueError(f"MODEL: {model!r} is neither a preset ({', '.join(presets.PRESETS)}) nor a config.json "
                         f"or a folder holding one")
    return load_config(model), model


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error contract: one `error:` line, exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="forgeline plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a preset or an HF config.json (file, folder or URL)")
    ap.add_argument("--mode", choices=("lora", "full"), default="lora")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--global-batch", type=int, default=64)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--hosts", type=int, default=1)
    ap.add_argument("--device-memory", type=float, default=80.0, help="GiB per device")
    ap.add_argument("--param-dtype", choices=("float32", "bfloat16"), default=None,
                    help="default: bfloat16 for lora (frozen base), float32 for full (master weights)")
    ap.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default="bfloat16")
    ap.add_argument("--remat", choices=("none", "full", "dots"), default="full")
    ap.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-targets", default=None, help="comma-separated module regexes (default: every projection)")
    ap.add_argument("--mesh", default=None, help="fixed mesh, e.g. data=1,fsdp=8,tensor=8,expert=4 (default: search)")
    ap.add_argument("--compile", type=int, default=3, dest="compile_top", help="meshes to compile (best estimates)")
    ap.add_argument("--full-depth", action="store_true", help="compile every layer (slow) instead of extrapolating")
    ap.add_argument("--moe-capacity-factor", type=float, default=None,
                    help="expert parallelism: rows a device computes, x the average (default: dropless)")
    ap.add_argument("--peak-tflops", type=float, default=DEFAULT_PEAK_TFLOPS, help="per device (bf16 dense)")
    ap.add_argument("--mfu", type=float, default=DEFAULT_MFU)
    ap.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    return ap


def request_from_args(args: argparse.Namespace) -> Request:
    checks = (("--seq-len", args.seq_len), ("--global-batch", args.global_batch), ("--devices", args.devices),
              ("--hosts", args.hosts), ("--grad-accum", args.grad_accum), ("--lora-rank", args.lora_rank),
              ("--compile", args.compile_top))
    for flag, v in checks:
        if v < 1:
            raise ValueError(f"{flag}: must be >= 1 (got {v})")
    if args.devices % args.hosts:
        raise ValueError(f"--devices: {args.devices} devices do not spread evenly over {args.hosts} hosts")
    if args.global_batch % args.grad_accum:
        raise ValueError(f"--global-batch: {args.global_batch} is not a multiple of --grad-accum {args.grad_accum}")
    if args.device_memory <= 0 or args.peak_tflops <= 0 or not 0 < args.mfu <= 1:
        raise ValueError("--device-memory and --peak-tflops must be > 0, --mfu in (0, 1]")
    mesh = None
    if args.mesh:
        try:
            mesh = {k.strip(): int(v) for k, v in (kv.split("=") for kv in args.mesh.split(","))}
        except ValueError:
            raise ValueError(f"--mesh: expected axis=N,... (data, fsdp, tensor, expert), got {args.mesh!r}") from None
        if bad := set(mesh) - {"data", "fsdp", "tensor", "expert"}:
            raise ValueError(f"--mesh: unknown axes {sorted(bad)} (data, fsdp, tensor, expert)")
    config, name = resolve_model(args.model)
    return Request(config=config, name=name, mode=args.mode, seq_len=args.seq_len, global_batch=args.global_batch,
                   devices=args.devices, hosts=args.hosts, device_memory_gib=args.device_memory,
                   param_dtype=args.param_dtype, compute_dtype=args.compute_dtype, remat=args.remat,
                   grad_accum=args.grad_accum, optimizer=args.optimizer, lora_rank=args.lora_rank, mesh=mesh,
                   lora_targets=tuple(args.lora_targets.split(",")) if args.lora_targets else None,
                   compile_top=args.compile_top, full_depth=args.full_depth,
                   moe_capacity_factor=args.moe_capacity_factor, peak_tflops=args.peak_tflops, mfu=args.mfu)


def main(argv: Sequence[str] | None = None) -> int:
    """Run in a process whose JAX sees the planned number of devices (`run_in_subprocess` arranges it)."""
    args = parser().parse_args(argv)
    try:
        req = request_from_args(args)
        import jax

        if jax.device_count() < req.devices:
            raise ValueError(f"--devices: this process has {jax.device_count()} devices; run through "
                             f"`forgeline plan` (which starts one with {req.devices} fake CPU devices)")
        result = plan(req)
    except (ValueError, KeyError, TypeError, NotImplementedError) as e:
        msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        print(f"error: {msg.splitlines()[0] if msg else type(e).__name__}", file=sys.stderr)
        return 2
    except Exception as e:  # a compiler failure: one line, not a traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"error: planning failed: {type(e).__name__}: {first}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=1) if args.json else format_plan(result))
    return 0 if result["fits"] else 1


def plan_env(devices: int) -> dict[str, str]:
    """The environment of a planning process: JAX on CPU with `devices` fake devices."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    return {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(devices),
            "XLA_FLAGS": " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])}


def run_in_subprocess(argv: Sequence[str], timeout: float | None = None, capture: bool = False
                      ) -> subprocess.CompletedProcess:
    """`python -m tasks.training.plan ARGV` in a fresh process with as many fake CPU devices as --devices asks
    (the device count is fixed when JAX starts, so the planner cannot run in an already-started process)."""
    args = parser().parse_args(list(argv))  # exits 2 with argparse's message on a bad command line
    return subprocess.run([sys.executable, "-m", "tasks.training.plan", *argv], env=plan_env(max(args.devices, 1)),
                          timeout=timeout, capture_output=capture, text=True, check=False)


if __name__ == "__main__":
    sys.exit(main())
