"""The P-EAGLE draft's checkpoint layout (vLLM speculators `PEagleSpeculator`), written and read.

config.json is the EAGLE-3 speculators config (models/eagle3/config.py `speculators_config`) with
`speculators_model_type: "peagle"`, `architectures: ["PEagleSpeculator"]`, `mask_token_id`,
`embed_requires_grad: false` (the target's embedding is reused, so it is not written) and the proposal's
`speculative_tokens` = the parallel depths trained; model.safetensors holds the EAGLE-3 tensors (`fc`,
`layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d`) plus `mask_hidden` [1, 1, num_aux·D_t].

Field and tensor names: vllm-project/speculators 0.9.0 `models/peagle/config.py` (`PEagleSpeculatorConfig`)
and `models/peagle/core.py` (`PEagleDraftModel.mask_hidden`). vLLM serves it with
`speculative_config={"method": "eagle3", "model": <dir>, "num_speculative_tokens": k,
"parallel_drafting": true}`. See docs/formats/peagle.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.draft_base import DTYPES, check_target, write_folder
from models.eagle3.config import Eagle3Config, speculators_config
from models.eagle3.export import draft_tensors, read_tensors
from models.hf import load_config, readable_dir, writable_dir
from models.peagle.model import PEagleConfig, PEagleDraft

ARCHITECTURE = "PEagleSpeculator"
MODEL_TYPE = "peagle"


def peagle_config(config: PEagleConfig, *, target_config: Mapping[str, Any], verifier_name_or_path: str,
                  dtype: str = "bfloat16") -> dict[str, Any]:
    """The speculators `PEagleSpeculatorConfig` config.json."""
    d = speculators_config(config, target_config=target_config, verifier_name_or_path=verifier_name_or_path,
                           num_speculative_tokens=config.num_depths, dtype=dtype)
    d["architectures"] = [ARCHITECTURE]
    d["speculators_model_type"] = MODEL_TYPE
    d["speculators_config"]["algorithm"] = MODEL_TYPE
    d["mask_token_id"] = config.mask_token_id
    d["embed_requires_grad"] = False  # trained frozen: the engine's shared target embedding is the one we used
    return d


def save_peagle(draft: PEagleDraft, path_or_url: str, *, target_config: Mapping[str, Any],
                verifier_name_or_path: str, dtype: str = "bfloat16") -> None:
    """Write the speculators P-EAGLE layout (config.json + model.safetensors) to a folder or URL."""
    check_target(draft, target_config)
    tensors = draft_tensors(draft, dtype, prefix="layers.0.")
    mask = np.asarray(jnp.asarray(draft.mask_hidden[...], jnp.float32)).astype(DTYPES[dtype])
    tensors["mask_hidden"] = np.ascontiguousarray(mask.reshape(1, 1, -1))
    config = peagle_config(draft.config, target_config=target_config, verifier_name_or_path=verifier_name_or_path,
                           dtype=dtype)
    with writable_dir(path_or_url) as folder:
        write_folder(folder, config, tensors)


def load_peagle(path_or_url: str, embed_tokens: jax.Array | np.ndarray, *, dtype: Any = jnp.float32,
                param_dtype: Any = jnp.float32) -> PEagleDraft:
    """Read a speculators P-EAGLE folder (ours or speculators' own `save_pretrained`) and install the
    target's embedding [V, D]; one ValueError names every missing, unexpected or mis-shaped tensor."""
    with readable_dir(path_or_url) as folder:
        d = load_config(folder)
        source = os.path.join(folder, "config.json")
        if d.get("speculators_model_type") != MODEL_TYPE:
            raise ValueError(f"{source}: speculators_model_type {d.get('speculators_model_type')!r} is not "
                             f"{MODEL_TYPE!r}")
        if d.get("mask_token_id") is None:
            raise ValueError(f"{source}: no mask_token_id (the placeholder token of the parallel depths)")
        base = Eagle3Config.from_hf({**d, "speculators_model_type": "eagle3"}, source=source)
        proposals = (d.get("speculators_config") or {}).get("proposal_methods") or [{}]
        config = PEagleConfig.from_eagle3(base, mask_token_id=d["mask_token_id"],
                                          num_depths=proposals[0].get("speculative_tokens", 8))
        draft = nnx.eval_shape(lambda: PEagleDraft(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype))
        mask = nnx.Param(jnp.zeros((1, 1, config.num_aux * config.target_hidden_size), param_dtype))
        read_tensors(folder, draft, "layers.0.", param_dtype=param_dtype, extra={"mask_hidden": mask})
        draft.mask_hidden.set_value(mask.get_value().reshape(-1))
    draft.load_embedding(embed_tokens)
    return draft
