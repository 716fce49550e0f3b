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

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import draft_base
from models.draft_base import check_target, write_folder
from models.eagle3.config import Eagle3Config, speculators_config
from models.eagle3.model import Eagle3Draft
from models.hf import load_config, readable_dir, writable_dir

log = logging.getLogger(__name__)


def _layer_prefix(prefix: str) -> Callable[[str], str]:
    """Module path -> tensor name: the decoder layer (`midlayer.*`) under `prefix` (speculators: "layers.0.")."""
    return lambda name: prefix + name[len("midlayer."):] if name.startswith("midlayer.") else name


def draft_tensors(draft: Eagle3Draft, dtype: str = "bfloat16", prefix: str = "midlayer.") -> dict[str, np.ndarray]:
    """The exported tensors: HF [out, in] weights in `dtype` (LoRA folded in), d2t int64, t2d bool.
    `prefix` renames the decoder layer (speculators: "layers.0.")."""
    return draft_base.draft_tensors(draft, dtype, rename=_layer_prefix(prefix))


def save_sglang(draft: Eagle3Draft, path_or_url: str, *, target_config: Mapping[str, Any],
                dtype: str = "bfloat16") -> None:
    """SGLang / EAGLE-official layout (also loaded by vLLM): config.json (`LlamaForCausalLMEagle3`,
    vocab_size = the target's) + model.safetensors (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`;
    no `embed_tokens`: engines reuse the target's). `target_config` is the target's config.json dict."""
    check_target(draft, target_config)
    aux = draft.config.aux_layer_ids
    if aux[0] != 1:
        log.warning("aux_layer_ids %s do not start at 1: SGLang (>= sgl-project/sglang#25454) reads such ids as "
                    "hidden-state boundaries (one layer earlier) and vLLM ignores eagle_config ids in this layout; "
                    "prefer the speculators layout", list(aux))
    tensors = draft_tensors(draft, dtype, prefix="midlayer.")
    with writable_dir(path_or_url) as folder:
        write_folder(folder, draft.config.to_hf(dtype, target_config=target_config), tensors)


def save_speculators(draft: Eagle3Draft, path_or_url: str, *, target_config: Mapping[str, Any],
                     verifier_name_or_path: str, num_speculative_tokens: int, dtype: str = "bfloat16") -> None:
    """vLLM speculators layout (`Eagle3Speculator`): config.json + model.safetensors with `fc`,
    `layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d` (no `embed_tokens`)."""
    check_target(draft, target_config)
    if len(set(draft.config.aux_layer_ids)) != len(draft.config.aux_layer_ids):
        log.warning("aux_layer_ids %s repeat a layer (a target shallower than 8 layers): speculators refuses to "
                    "load such a config", list(draft.config.aux_layer_ids))
    config = speculators_config(draft.config, target_config=target_config, verifier_name_or_path=verifier_name_or_path,
                                num_speculative_tokens=num_speculative_tokens, dtype=dtype)
    tensors = draft_tensors(draft, dtype, prefix="layers.0.")
    with writable_dir(path_or_url) as folder:
        write_folder(folder, config, tensors)


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
    draft_base.read_tensors(folder, draft, rename=_layer_prefix(prefix), param_dtype=param_dtype, extra=extra)
