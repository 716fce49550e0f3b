"""The DFlash draft's checkpoint layout, written and read: vLLM speculators' `DFlashSpeculator`
(config.json + model.safetensors).

Tensors (HF [out, in] layout): `fc`, `hidden_norm`, `layers.{i}.{input_layernorm, self_attn.{q,k,v,o}_proj,
self_attn.{q,k}_norm, post_attention_layernorm, mlp.{gate,up,down}_proj}`, `norm`; with a reduced draft
vocabulary (Vd < V) also `lm_head` [Vd, D], `d2t` int64 [Vd] and `t2d` bool [V]. Never `embed_tokens`
(the engine reuses the target's); with the full vocabulary no `lm_head`, `d2t`, `t2d` either
(speculators reloads the full-vocabulary head from the verifier and registers no vocabulary maps).
These are the keys vllm-project/speculators 0.9.0 `src/speculators/models/dflash/core.py`
(`DFlashDraftModel._keys_to_ignore_on_save`, set per instance in `__init__`) and `src/speculators/model.py`
(`DraftVocabMixin._init_vocab`) save.

See docs/formats/dflash.md; DFlash: arXiv 2602.06036.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from models.dflash.config import DFlashConfig, speculators_config
from models.dflash.model import DFlashDraft
from models.eagle3.export import DTYPES
from models.hf import SafetensorsCheckpoint, load_config, readable_dir, writable_dir
from models.layers import Linear, RMSNorm

WEIGHTS_FILE = "model.safetensors"


def _weight_modules(draft: DFlashDraft) -> dict[str, nnx.Module]:
    """Tensor prefix -> Linear / RMSNorm of every weight the layout can hold (not the embedding)."""
    out = {}
    for path, node in nnx.iter_graph(draft):
        if isinstance(node, (Linear, RMSNorm)):
            out[".".join(str(p) for p in path)] = node
    return dict(sorted(out.items()))


def _reduced(config: DFlashConfig) -> bool:
    return config.draft_vocab_size != config.vocab_size


def draft_tensors(draft: DFlashDraft, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """The exported tensors: HF [out, in] weights in `dtype` (LoRA folded in); with a reduced draft
    vocabulary `lm_head`, d2t int64 and t2d bool, else none of the three."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    np_dtype = DTYPES[dtype]
    reduced = _reduced(draft.config)
    out: dict[str, np.ndarray] = {}
    for name, mod in _weight_modules(draft).items():
        if name == "lm_head" and not reduced:
            continue
        w = mod.weight().T if isinstance(mod, Linear) else mod.weight[...]  # [out, in] / [D]
        out[f"{name}.weight"] = np.ascontiguousarray(np.asarray(jnp.asarray(w, jnp.float32)).astype(np_dtype))
    if reduced:
        out["d2t"] = np.asarray(draft.d2t[...]).astype(np.int64)
        out["t2d"] = np.asarray(draft.t2d[...]).astype(bool)
    return out


def save_dflash(draft: DFlashDraft, path_or_url: str, *, target_config: Mapping[str, Any], verifier_name_or_path: str,
                dtype: str = "bfloat16") -> None:
    """vLLM speculators layout (`DFlashSpeculator`): config.json + model.safetensors (see the module
    docstring). `target_config` is the target's config.json dict."""
    c = draft.config
    V = target_config.get("vocab_size")
    if V is not None and V != c.vocab_size:
        raise ValueError(f"target vocab_size {V} != the draft's vocab_size {c.vocab_size} "
                         "(the draft must be built for this target)")
    if c.train_lm_head and not _reduced(c):
        raise ValueError("a trained full-vocabulary lm_head cannot be exported: speculators and the engines "
                         "replace it with the verifier's LM head (use a reduced draft vocabulary)")
    config = speculators_config(c, target_config=target_config, verifier_name_or_path=verifier_name_or_path,
                                dtype=dtype)
    tensors = draft_tensors(draft, dtype)
    with writable_dir(path_or_url) as folder:
        safetensors.numpy.save_file(tensors, os.path.join(folder, WEIGHTS_FILE), metadata={"format": "pt"})
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")


def load_dflash(path_or_url: str, embed_tokens: jax.Array | np.ndarray, *,
                lm_head: jax.Array | np.ndarray | None = None, dtype: Any = jnp.float32,
                param_dtype: Any = jnp.float32) -> DFlashDraft:
    """Load a `DFlashSpeculator` checkpoint and install the target's embedding [V, D]. A full-vocabulary
    checkpoint carries no `lm_head`: pass the target's LM head [V, D] as `lm_head` (a tied target: its
    embedding). Every missing, unexpected or mis-shaped tensor is reported in one ValueError."""
    with readable_dir(path_or_url) as folder:
        config = DFlashConfig.from_hf(load_config(folder), source=os.path.join(folder, "config.json"))
        tensors = SafetensorsCheckpoint(folder)
        draft = nnx.eval_shape(lambda: DFlashDraft(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype))
        reduced = _reduced(config)
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
            if name == "lm_head" and not reduced:
                continue
            if isinstance(mod, Linear):
                w = get(f"{name}.weight", (mod.out_features, mod.in_features))
                if w is not None:
                    mod.kernel.set_value(jnp.asarray(w.astype(np.float32).T, param_dtype))
            else:
                w = get(f"{name}.weight", tuple(mod.weight.get_value().shape))
                if w is not None:
                    mod.weight.set_value(jnp.asarray(w.astype(np.float32), param_dtype))
        Vd, V = config.draft_vocab_size, config.vocab_size
        if reduced:
            d2t, t2d = get("d2t", (Vd,)), get("t2d", (V,))
        else:  # full vocabulary: identity maps (speculators registers none)
            d2t, t2d = np.zeros((Vd,), np.int64), np.ones((V,), bool)
        unexpected = sorted(set(tensors) - used - {"embed_tokens.weight"})
        if not reduced and lm_head is None:
            missing.append("lm_head.weight (a full-vocabulary draft: pass the target's LM head as lm_head=)")
        if missing or unexpected or misshaped:
            parts = [f"{len(n)} {label}: {', '.join(n)}" for label, n in
                     (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)) if n]
            raise ValueError(f"{os.path.join(folder, WEIGHTS_FILE)}: tensors do not match the DFlash draft: "
                             + "; ".join(parts))
    draft.set_vocab(d2t, t2d)
    draft.load_embedding(embed_tokens)
    if not reduced:
        draft.load_lm_head(lm_head)
    return draft
