"""Logical-axis sharding: a rule table from logical names to mesh axes, and model placement on a mesh.

Every parameter carries logical axis names in its `out_sharding` metadata (models/layers.py):
"vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "norm", "expert" (the stacked-experts
axis of MoE weights), "q_lora" / "kv_lora" (MLA's low-rank widths); activations use "batch" and
"length". RULES maps each to a mesh axis of ("data", "fsdp", "tensor", "expert") or None (replicated), in
the style of MaxText's logical_axis_rules. A dimension that the mapped mesh axes do not divide is
replicated instead (logged), so tiny test models place on any mesh.

    mesh = make_mesh(fsdp=2, tensor=2, expert=2)
    shard_model(model, mesh)                       # in place
    batch = jax.device_put(ids, named_sharding(mesh, ("batch", "length")))
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor", "expert")
MeshAxes = str | tuple[str, ...] | None

RULES: dict[str, MeshAxes] = {
    "batch": ("data", "fsdp", "expert"),  # expert-parallel devices also split the batch (as MaxText)
    "length": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
    "expert": "expert",
    "q_lora": None,
    "kv_lora": None,
}


def make_mesh(
    data: int = 1, fsdp: int | None = None, tensor: int = 1, devices: Sequence | None = None, expert: int = 1
) -> Mesh:
    """A (data, fsdp, tensor, expert) mesh; fsdp defaults to whatever devices remain."""
    devices = list(devices if devices is not None else jax.devices())
    fixed = data * tensor * expert
    if fsdp is None and len(devices) % fixed:
        raise ValueError(f"mesh data {data} x tensor {tensor} x expert {expert} needs a multiple of {fixed} devices, "
                         f"have {len(devices)}")
    fsdp = fsdp if fsdp is not None else len(devices) // fixed
    n = data * fsdp * tensor * expert
    if n != len(devices):
        raise ValueError(f"mesh {data}x{fsdp}x{tensor}x{expert} needs {n} devices, have {len(devices)}")
    return Mesh(np.asarray(devices).reshape(data, fsdp, tensor, expert), MESH_AXES)


def logical_to_spec(names: Sequence[str | None], rules: Mapping[str, MeshAxes] = RULES,
                    shape: Sequence[int] | None = None, mesh: Mesh | None = None) -> PartitionSpec:
    """Map logical axis names to a PartitionSpec; with `shape` and `mesh`, replicate indivisible dims
    and never use one mesh axis twice."""
    spec: list[MeshAxes] = []
    used: set[str] = set()
    for i, name in enumerate(names):
        axes = rules.get(name) if name is not None else None
        if name is not None and name not in rules:
            raise KeyError(f"no sharding rule for logical axis {name!r}")
        axes_t = (axes,) if isinstance(axes, str) else tuple(axes or ())
        # a mesh axis of size 1 shards nothing: leave it out so specs say what is really split
        axes_t = tuple(a for a in axes_t if a not in used and (mesh is None or mesh.shape.get(a, 1) > 1))
        if shape is not None and mesh is not None and axes_t:
            size = math.prod(mesh.shape[a] for a in axes_t)
            if shape[i] % size:
                log.debug("replicating dim %d (%s, size %d): not divisible by %s", i, name, shape[i], axes_t)
                axes_t = ()
        used.update(axes_t)
        spec.append(None if not axes_t else axes_t[0] if len(axes_t) == 1 else axes_t)
    return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, names: Sequence[str | None], rules: Mapping[str, MeshAxes] = RULES,
                   shape: Sequence[int] | None = None) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, rules, shape, mesh))


def state_shardings(state: nnx.State, mesh: Mesh, rules: Mapping[str, MeshAxes] = RULES):
    """A pytree of NamedSharding matching `state` (variables without axis names are replicated)."""

    def one(var):
        names = var.get_metadata().get("out_sharding") if isinstance(var, nnx.Variable) else None
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        names = tuple(names) if names else (None,) * np.ndim(value)
        return named_sharding(mesh, names, rules, np.shape(value))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh, rules: Mapping[str, MeshAxes] = RULES) -> nnx.Module:
    """Place every variable of `model` on `mesh` according to its logical axes (in place); returns model."""
    state = nnx.state(model)
    shardings = state_shardings(state, mesh, rules)
    values = jax.tree.map(lambda v: v.get_value() if isinstance(v, nnx.Variable) else v, state,
                          is_leaf=lambda x: isinstance(x, nnx.Variable))
    nnx.update(model, jax.device_put(values, shardings))
    return model


def set_activation_sharding(model: nnx.Module, mesh: Mesh, rules: Mapping[str, MeshAxes] = RULES,
                            capacity_factor: float | None = None) -> None:
    """Pin a decoder's residual stream [B, T, D] and logits to rows over the batch axes (the other dims left to
    XLA), as MaxText constrains its activations, and give its MoE expert stacks their expert-parallel layout
    (models/moe.py `ExpertParallel`; `capacity_factor` None: dropless). Without them XLA's propagation gives up
    the batch split at a gather (the embedding lookup) and at the experts' sort, and replicates every token of
    the global batch, its logits and its routed rows on every device, as the capacity planner
    (tasks/training/plan.py) found. In place; modules without these attributes are left alone."""
    from models.moe import EP_VARIABLES, ExpertParallel, Experts

    rows = named_sharding(mesh, ("batch",), rules)
    batch_axes = rows.spec[0] if len(rows.spec) else None
    batch_axes = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes or ())
    for _, node in nnx.iter_graph(model):
        if hasattr(node, "activation_sharding"):
            node.activation_sharding = rows
        if isinstance(node, Experts):
            specs = []
            for name in EP_VARIABLES:
                var = getattr(node, name, None)
                if isinstance(var, nnx.Variable):
                    names = var.get_metadata().get("out_sharding") or (None,) * var.get_value().ndim
                    specs.append((name, logical_to_spec(names, rules, var.get_value().shape, mesh)))
            lead = dict(specs)["gate_up"][0] if specs else None
            expert_axes = (lead,) if isinstance(lead, str) else tuple(lead or ())
            node.expert_parallel = ExpertParallel(mesh, batch_axes, expert_axes, tuple(specs), capacity_factor)
