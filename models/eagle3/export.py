"""The EAGLE-3 draft's two checkpoint layouts, written and read: config.json + model.safetensors
(`fc`, the decoder layer, `norm`, `lm_head`, `d2t`, `t2d`; no `embed_tokens`: engines reuse the
target's).

* SGLang / EAGLE-official (also loaded by vLLM): the layer as `midlayer.*`, config
  `LlamaForCausalLMEagle3` (SGLang `python/sglang/srt/models/llama_eagle3.py`).
* vLLM speculators (`Eagle3Speculator`): the layer as `layers.0.*` (vllm-project/speculators 0.9.0
  `models/eagle3/`, vLLM `vllm/model_executor/models/llama_eagle3.py`).

`load_eagle3` reads either, told apart by `speculators_model_type` in config.json. See
docs/formats/eagle3.md.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import safetensors.numpy
from flax import nnx

from models.eagle3.config import Eagle3Config, speculators_config
from models.eagle3.model import Eagle3Draft
from models.hf import SafetensorsCheckpoint, load_config, readable_dir, writable_dir
from models.layers import Linear, RMSNorm

log = logging.getLogger(__name__)
WEIGHTS_FILE = "model.safetensors"

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float16": np.float16}


def _weight_modules(draft: Eagle3Draft) -> dict[str, nnx.Module]:
    """SGLang tensor prefix -> Linear / RMSNorm of every exported weight (not the target embedding)."""
    out = {}
    for path, node in nnx.iter_graph(draft):
        if isinstance(node, (Linear, RMSNorm)):
            out[".".join(str(p) for p in path)] = node
    return dict(sorted(out.items()))


def draft_tensors(draft: Eagle3Draft, dtype: str = "bfloat16", prefix: str = "midlayer.") -> dict[str, np.ndarray]:
    """The exported tensors: HF [out, in] weights in `dtype` (LoRA folded in), d2t int64, t2d bool.
    `prefix` renames the decoder layer (speculators: "layers.0.")."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    np_dtype = DTYPES[dtype]
    out: dict[str, np.ndarray] = {}
    for name, mod in _weight_modules(draft).items():
        w = mod.weight().T if isinstance(mod, Linear) else mod.weight[...]  # [out, in] / [D]
        name = prefix + name[len("midlayer."):] if name.startswith("midlayer.") else name
        out[f"{name}.weight"] = np.ascontiguousarray(np.asarray(jnp.asarray(w, jnp.float32)).astype(np_dtype))
    out["d2t"] = np.asarray(draft.d2t[...]).astype(np.int64)
    out["t2d"] = np.asarray(draft.t2d[...]).astype(bool)
    return out


def _check_target(draft: Eagle3Draft, target_config: Mapping[str, Any]) -> None:
    V = target_config.get("vocab_size")
    if V is not None and V != draft.config.vocab_size:
        raise ValueError(f"target vocab_size {V} != the draft's vocab_size {draft.config.vocab_size} "
                         "(the draft must be built for this target)")


def _write(folder: str, config: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
    safetensors.numpy.save_file(tensors, os.path.join(folder, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def save_sglang(draft: Eagle3Draft, path_or_url: str, *, target_config: Mapping[str, Any],
                dtype: str = "bfloat16") -> None:
    """SGLang / EAGLE-official layout (also loaded by vLLM): config.json (`LlamaForCausalLMEagle3`,
    vocab_size = the target's) + model.safetensors (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`;
    no `embed_tokens`: engines reuse the target's). `target_config` is the target's config.json dict."""
    _check_target(draft, target_config)
    aux = draft.config.aux_layer_ids
    if aux[0] != 1:
        log.warning("aux_layer_ids %s do not start at 1: SGLang (>= sgl-project/sglang#25454) reads such ids as "
                    "hidden-state boundaries (one layer earlier) and vLLM ignores eagle_config ids in this layout; "
                    "prefer the speculators layout", list(aux))
    tensors = draft_tensors(draft, dtype, prefix="midlayer.")
    with writable_dir(path_or_url) as folder:
        _write(folder, draft.config.to_hf(dtype, target_config=target_config), tensors)


def save_speculators(draft: Eagle3Draft, path_or_url: str, *, target_config: Mapping[str, Any],
                     verifier_name_or_path: str, num_speculative_tokens: int, dtype: str = "bfloat16") -> None:
    """vLLM speculators layout (`Eagle3Speculator`): config.json + model.safetensors with `fc`,
    `layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d` (no `embed_tokens`)."""
    _check_target(draft, target_config)
    if len(set(draft.config.aux_layer_ids)) != len(draft.config.aux_layer_ids):
        log.warning("aux_layer_ids %s repeat a layer (a target shallower than 8 layers): speculators refuses to "
                    "load such a config", list(draft.config.aux_layer_ids))
    config = speculators_config(draft.config, target_config=target_config, verifier_name_or_path=verifier_name_or_path,
                                num_speculative_tokens=num_speculative_tokens, dtype=dtype)
    tensors = draft_tensors(draft, dtype, prefix="layers.0.")
    with writable_dir(path_or_url) as folder:
        _write(folder, config, tensors)


def load_eagle3(path_or_url: str, embed_tokens: jax.Array | np.ndarray, *, dtype: Any = jnp.float32,
                param_dtype: Any = jnp.float32) -> Eagle3Draft:
    """Load either layout (told apart by `speculators_model_type` in config.json) and install the
    target's embedding [V, D]. Every missing, unexpected or mis-shaped tensor is reported in one
    ValueError. Without `d2t`/`t2d` (a full-vocabulary draft) the mapping is the identity."""
    with readable_dir(path_or_url) as folder:
        d = load_config(folder)
        config = Eagle3Config.from_hf(d, source=os.path.join(folder, "config.json"))
        draft = nnx.eval_shape(lambda: Eagle3Draft(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype))
        prefix = "layers.0." if d.get("speculators_model_type") is not None else "midlayer."
        read_tensors(folder, draft, prefix, param_dtype=param_dtype)
    draft.load_embedding(embed_tokens)
    return draft


def read_tensors(folder: str, draft: Eagle3Draft, prefix: str, *, param_dtype: Any = jnp.float32,
                 extra: Mapping[str, nnx.Variable] | None = None) -> None:
    """Fill an (abstract) EAGLE-3-style draft from `folder`'s safetensors: every exported weight (the
    decoder layer under `prefix`), `d2t`/`t2d`, and `extra` (file name -> Variable of the same shape,
    e.g. P-EAGLE's `mask_hidden`). One ValueError lists every missing, unexpected or mis-shaped tensor."""
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

    for name, mod in _weight_modules(draft).items():
        file_name = prefix + name[len("midlayer."):] if name.startswith("midlayer.") else name
        if isinstance(mod, Linear):
            w = get(f"{file_name}.weight", (mod.out_features, mod.in_features))
            if w is not None:
                mod.kernel.set_value(jnp.asarray(w.astype(np.float32).T, param_dtype))
        else:
            w = get(f"{file_name}.weight", tuple(mod.weight.get_value().shape))
            if w is not None:
                mod.weight.set_value(jnp.asarray(w.astype(np.float32), param_dtype))
    for name, var in (extra or {}).items():
        w = get(name, tuple(var.get_value().shape))
        if w is not None:
            var.set_value(jnp.asarray(w.astype(np.float32), param_dtype))
    Vd, V = config.draft_vocab_size, config.vocab_size
    if "d2t" in tensors or "t2d" in tensors or Vd != V:
        d2t, t2d = get("d2t", (Vd,)), get("t2d", (V,))
    else:  # full-vocabulary draft: no mapping (speculators #200)
        d2t, t2d = np.zeros((Vd,), np.int64), np.ones((V,), bool)
    unexpected = sorted(set(tensors) - used - {"embed_tokens.weight"})
    if missing or unexpected or misshaped:
        parts = [f"{len(n)} {label}: {', '.join(n)}" for label, n in
                 (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)) if n]
        raise ValueError(f"{os.path.join(folder, WEIGHTS_FILE)}: tensors do not match the "
                         f"{type(draft).__name__}: " + "; ".join(parts))
    draft.set_vocab(d2t, t2d)
