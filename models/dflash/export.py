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

import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import draft_base
from models.dflash.config import DFlashConfig, speculators_config
from models.dflash.model import DFlashDraft
from models.draft_base import check_target, write_folder
from models.hf import load_config, readable_dir, writable_dir


def _reduced(config: DFlashConfig) -> bool:
    return config.draft_vocab_size != config.vocab_size


def _skipped(config: DFlashConfig) -> tuple[str, ...]:
    """A full-vocabulary draft's `lm_head` is the verifier's: neither written nor read."""
    return () if _reduced(config) else ("lm_head",)


def draft_tensors(draft: DFlashDraft, dtype: str = "bfloat16") -> dict[str, np.ndarray]:
    """The exported tensors: HF [out, in] weights in `dtype` (LoRA folded in); with a reduced draft
    vocabulary `lm_head`, d2t int64 and t2d bool, else none of the three."""
    return draft_base.draft_tensors(draft, dtype, skip=_skipped(draft.config), vocab_maps=_reduced(draft.config))


def save_dflash(draft: DFlashDraft, path_or_url: str, *, target_config: Mapping[str, Any], verifier_name_or_path: str,
                dtype: str = "bfloat16") -> None:
    """vLLM speculators layout (`DFlashSpeculator`): config.json + model.safetensors (see the module
    docstring). `target_config` is the target's config.json dict."""
    c = draft.config
    check_target(draft, target_config)
    if c.train_lm_head and not _reduced(c):
        raise ValueError("a trained full-vocabulary lm_head cannot be exported: speculators and the engines "
                         "replace it with the verifier's LM head (use a reduced draft vocabulary)")
    config = speculators_config(c, target_config=target_config, verifier_name_or_path=verifier_name_or_path,
                                dtype=dtype)
    tensors = draft_tensors(draft, dtype)
    with writable_dir(path_or_url) as folder:
        write_folder(folder, config, tensors)


def load_dflash(path_or_url: str, embed_tokens: jax.Array | np.ndarray, *,
                lm_head: jax.Array | np.ndarray | None = None, dtype: Any = jnp.float32,
                param_dtype: Any = jnp.float32) -> DFlashDraft:
    """Load a `DFlashSpeculator` checkpoint and install the target's embedding [V, D]. A full-vocabulary
    checkpoint carries no `lm_head`: pass the target's LM head [V, D] as `lm_head` (a tied target: its
    embedding). Every missing, unexpected or mis-shaped tensor is reported in one ValueError."""
    with readable_dir(path_or_url) as folder:
        config = DFlashConfig.from_hf(load_config(folder), source=os.path.join(folder, "config.json"))
        draft = nnx.eval_shape(lambda: DFlashDraft(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype))
        reduced = _reduced(config)
        lm_head_missing = [] if reduced or lm_head is not None else [
            "lm_head.weight (a full-vocabulary draft: pass the target's LM head as lm_head=)"]
        draft_base.read_tensors(folder, draft, skip=_skipped(config), param_dtype=param_dtype,
                                maps_when_present=False, also_missing=lm_head_missing, label="DFlash draft")
    draft.load_embedding(embed_tokens)
    if not reduced:
        draft.load_lm_head(lm_head)
    return draft
