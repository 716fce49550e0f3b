"""What every speculators-style draft kind (EAGLE-3, P-EAGLE, DFlash, and any added one) shares: the
validation of its config's geometry, the greedy-proposal envelope of its speculators config.json, and its
checkpoint folder (config.json + model.safetensors) written and read.

    validate_geometry(config)                        defaults filled in, the shared checks (in __post_init__)
    speculators_envelope(...)                        the speculators config.json's common fields
    tensors = draft_tensors(draft, "bfloat16", rename=...)   HF [out, in] weights, d2t / t2d
    write_folder(folder, config_dict, tensors)
    read_tensors(folder, abstract_draft, rename=...)         fills it; one ValueError lists every mismatch

A draft module here holds `Linear` / `RMSNorm` weights (models/layers.py), `d2t` / `t2d` vocabulary maps
(`set_vocab`) and the target's embedding (never exported). Field and tensor names follow
vllm-project/speculators 0.9.0 (https://github.com/vllm-project/speculators: `src/speculators/config.py`,
`src/speculators/proposals/greedy.py`, `src/speculators/model.py`). See docs/speculative-decoding.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection, Mapping
from typing import Any

import flax.core
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors.numpy
from flax import nnx

from models.hf import SafetensorsCheckpoint
from models.layers import Linear, RMSNorm

WEIGHTS_FILE = "model.safetensors"
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}
SPECULATORS_VERSION = "0.9.0"  # the vllm-project/speculators release whose config schema is written


def _same(name: str) -> str:
    return name


# -- config ----------------------------------------------------------------------------------------


def validate_geometry(config: Any) -> None:
    """The checks every draft config dataclass shares, run from its `__post_init__`: fills in
    `num_key_value_heads` (N), `head_dim` (D // N), `target_hidden_size` (D); freezes `rope_scaling` (so the
    config can live in a graphdef); ValueError on heads not a multiple of kv heads, an odd head_dim, a draft
    vocabulary outside [1, vocab_size] or no target layer to read."""
    set_ = lambda k, v: object.__setattr__(config, k, v)
    if config.num_key_value_heads is None:
        set_("num_key_value_heads", config.num_attention_heads)
    if config.head_dim is None:
        set_("head_dim", config.hidden_size // config.num_attention_heads)
    if config.target_hidden_size is None:
        set_("target_hidden_size", config.hidden_size)
    set_("aux_layer_ids", tuple(int(i) for i in config.aux_layer_ids))
    if config.rope_scaling is not None:
        set_("rope_scaling", flax.core.FrozenDict(config.rope_scaling))
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if config.head_dim % 2:
        raise ValueError("head_dim must be even for rotary embeddings")
    if not 1 <= config.draft_vocab_size <= config.vocab_size:
        raise ValueError(f"draft_vocab_size {config.draft_vocab_size} must be in [1, vocab_size={config.vocab_size}]")
    if not config.aux_layer_ids:
        raise ValueError("aux_layer_ids must name at least one target layer")


def speculators_layer_ids(aux_layer_ids: Collection[int]) -> list[int]:
    """Our output-of-layer ids -> the hidden-state boundary ids speculators and vLLM use (id i = the residual
    stream entering layer i, 0 = the embedding output): one higher."""
    return [int(i) + 1 for i in aux_layer_ids]


def speculators_envelope(*, architecture: str, model_type: str, layer_config: Mapping[str, Any],
                         draft_vocab_size: int, speculative_tokens: int, target_config: Mapping[str, Any],
                         verifier_name_or_path: str, dtype: str) -> dict[str, Any]:
    """The speculators config.json fields every kind writes: architecture, model type, version, the draft
    layers' `transformer_layer_config`, the greedy proposal of `speculative_tokens` and the verifier."""
    return {
        "architectures": [architecture],
        "speculators_model_type": model_type,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": dict(layer_config),
        "draft_vocab_size": draft_vocab_size,
        "speculators_config": {
            "algorithm": model_type,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier_name_or_path,
                         "architectures": list(target_config.get("architectures") or [])},
        },
        "torch_dtype": dtype,
        "dtype": dtype,
    }


# -- tensors written -------------------------------------------------------------------------------


def weight_modules(draft: nnx.Module) -> dict[str, nnx.Module]:
    """Module path ("midlayer.self_attn.q_proj") -> Linear / RMSNorm of every weight (not the embedding,
    a Buffer of the target's), sorted by path."""
    out = {}
    for path, node in nnx.iter_graph(draft):
        if isinstance(node, (Linear, RMSNorm)):
            out[".".join(str(p) for p in path)] = node
    return dict(sorted(out.items()))


def check_target(draft: nnx.Module, target_config: Mapping[str, Any]) -> None:
    """ValueError when the target's config.json has another vocabulary than the one the draft was built for."""
    V = target_config.get("vocab_size")
    if V is not None and V != draft.config.vocab_size:
        raise ValueError(f"target vocab_size {V} != the draft's vocab_size {draft.config.vocab_size} "
                         "(the draft must be built for this target)")


def draft_tensors(draft: nnx.Module, dtype: str = "bfloat16", *, rename: Callable[[str], str] = _same,
                  skip: Collection[str] = (), vocab_maps: bool = True) -> dict[str, np.ndarray]:
    """The exported tensors: `{rename(path)}.weight` in HF [out, in] layout (LoRA folded in) cast to `dtype`
    for every weight module but those whose path is in `skip`; with `vocab_maps` also d2t int64 [Vd] and
    t2d bool [V]."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    np_dtype = DTYPES[dtype]
    out: dict[str, np.ndarray] = {}
    for name, mod in weight_modules(draft).items():
        if name in skip:
            continue
        w = mod.weight().T if isinstance(mod, Linear) else mod.weight[...]  # [out, in] / [D]
        out[f"{rename(name)}.weight"] = np.ascontiguousarray(np.asarray(jnp.asarray(w, jnp.float32)).astype(np_dtype))
    if vocab_maps:
        out["d2t"] = np.asarray(draft.d2t[...]).astype(np.int64)
        out["t2d"] = np.asarray(draft.t2d[...]).astype(bool)
    return out


def write_folder(folder: str, config: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
    """`folder`/model.safetensors (PyTorch-tagged) and `folder`/config.json (sorted keys, indent 2)."""
    safetensors.numpy.save_file(dict(tensors), os.path.join(folder, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


# -- tensors read ----------------------------------------------------------------------------------


def read_tensors(folder: str, draft: nnx.Module, *, rename: Callable[[str], str] = _same,
                 skip: Collection[str] = (), param_dtype: Any = jnp.float32,
                 extra: Mapping[str, nnx.Variable] | None = None, maps_when_present: bool = True,
                 also_missing: Collection[str] = (), label: str | None = None) -> None:
    """Fill an (abstract) draft from `folder`'s model.safetensors: every weight module but `skip` (file name
    `{rename(path)}.weight`), `extra` (file name -> Variable of the same shape, e.g. P-EAGLE's `mask_hidden`)
    and the vocabulary maps, which a reduced vocabulary (Vd < V) requires and a full one may omit (identity
    maps; with `maps_when_present` false a full-vocabulary file must not hold them). One ValueError lists every
    missing (plus `also_missing`), unexpected or mis-shaped tensor, naming the draft (`label`, default its
    class)."""
    config = draft.config
    tensors = SafetensorsCheckpoint(folder)
    used: set[str] = set()
    missing: list[str] = []
    misshaped: list[str] = []

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        if name not in tensors:
            missing.append(name)
            return None
        used.add(name)
        if tuple(tensors.shape(name)) != shape:
            misshaped.append(f"{name} {list(tensors.shape(name))} (expected {list(shape)})")
            return None
        return np.asarray(tensors[name])

    for name, mod in weight_modules(draft).items():
        if name in skip:
            continue
        if isinstance(mod, Linear):
            w = get(f"{rename(name)}.weight", (mod.out_features, mod.in_features))
            if w is not None:
                mod.kernel.set_value(jnp.asarray(w.astype(np.float32).T, param_dtype))
        else:
            w = get(f"{rename(name)}.weight", tuple(mod.weight.get_value().shape))
            if w is not None:
                mod.weight.set_value(jnp.asarray(w.astype(np.float32), param_dtype))
    for name, var in (extra or {}).items():
        w = get(name, tuple(var.get_value().shape))
        if w is not None:
            var.set_value(jnp.asarray(w.astype(np.float32), param_dtype))
    Vd, V = config.draft_vocab_size, config.vocab_size
    if Vd != V or (maps_when_present and ("d2t" in tensors or "t2d" in tensors)):
        d2t, t2d = get("d2t", (Vd,)), get("t2d", (V,))
    else:  # full-vocabulary draft: identity maps (speculators registers none, speculators #200)
        d2t, t2d = np.zeros((Vd,), np.int64), np.ones((V,), bool)
    unexpected = sorted(set(tensors) - used - {"embed_tokens.weight"})
    missing += list(also_missing)
    if missing or unexpected or misshaped:
        parts = [f"{len(n)} {what}: {', '.join(n)}" for what, n in
                 (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)) if n]
        raise ValueError(f"{os.path.join(folder, WEIGHTS_FILE)}: tensors do not match the "
                         f"{label or type(draft).__name__}: " + "; ".join(parts))
    draft.set_vocab(d2t, t2d)
