"""The speculative-decoding draft kinds, written and read through one surface.

A draft folder (what the draft stage writes per candidate, and what a release bundle ships as `draft/`)
holds the draft in the layouts engines load:

    speculators/         vLLM speculators layout (every kind): config.json + model.safetensors
    sglang/              SGLang / EAGLE-official layout (EAGLE-3 only: SGLang has no P-EAGLE / DFlash layout)
    draft_config.json    what the draft stage recorded (kind, objective, selection, measured accuracy)

    kind      module          decoding                                      speculators model type
    eagle3    models/eagle3   k sequential draft forwards (chain or tree)   eagle3
    peagle    models/peagle   one forward for k tokens (parallel drafting)  peagle
    dflash    models/dflash   one forward for a block of k + 1 slots        dflash

`load_draft(folder, embed_tokens)` tells the kind from the folder's config.json and returns the draft
module `models.speculative.speculative_generate` runs. See docs/speculative-decoding.md (which drafter
is which, and which engine serves it).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from models.draft_format import KINDS, SGLANG_DIR, SPECULATORS_DIR, folder_kind


def kind_of(draft: nnx.Module) -> str:
    """The kind of a draft module (PEagleDraft subclasses Eagle3Draft, so it is checked first)."""
    name = type(draft).__name__
    for kind, cls in (("peagle", "PEagleDraft"), ("dflash", "DFlashDraft"), ("eagle3", "Eagle3Draft")):
        if name == cls:
            return kind
    raise ValueError(f"{name} is not a draft kind forgeline exports ({', '.join(KINDS)})")


def target_head(target: nnx.Module) -> jax.Array:
    """The target's LM head [V, D] in HF layout (its embedding when tied): what a draft with the target's
    own output head (DFlash) or a full-vocabulary DFlash checkpoint without `lm_head` reads."""
    return target.embed_tokens.weight[...] if target.lm_head is None else target.lm_head.weight().T


def load_draft(folder: str | Path, embed_tokens: jax.Array | np.ndarray,
               lm_head: jax.Array | np.ndarray | None = None) -> nnx.Module:
    """The draft in `folder` (a draft-stage candidate or a bundle's `draft/`) with the target's embedding
    (and, for a full-vocabulary DFlash draft, which does not store one, the target's LM head [V, D])."""
    folder = Path(folder)
    kind = folder_kind(folder)
    if kind == "eagle3":
        from models.eagle3 import load_eagle3
        sub = SGLANG_DIR if (folder / SGLANG_DIR / "config.json").exists() else SPECULATORS_DIR
        return load_eagle3(str(folder / sub), embed_tokens=embed_tokens)
    if kind == "peagle":
        from models.peagle import load_peagle
        return load_peagle(str(folder / SPECULATORS_DIR), embed_tokens)
    from models.dflash import load_dflash
    return load_dflash(str(folder / SPECULATORS_DIR), embed_tokens, lm_head=lm_head)


def save_draft(draft: nnx.Module, folder: str | Path, *, target_config: Mapping[str, Any], verifier_name_or_path: str,
               num_speculative_tokens: int, dtype: str = "bfloat16") -> dict[str, str]:
    """Write every layout of `draft`'s kind under `folder`; returns {layout: description} for the report."""
    kind = kind_of(draft)
    spec = os.path.join(str(folder), SPECULATORS_DIR)
    if kind == "eagle3":
        from models.eagle3 import save_sglang, save_speculators
        save_sglang(draft, os.path.join(str(folder), SGLANG_DIR), target_config=target_config, dtype=dtype)
        save_speculators(draft, spec, target_config=target_config, verifier_name_or_path=verifier_name_or_path,
                         num_speculative_tokens=num_speculative_tokens, dtype=dtype)
        return {SGLANG_DIR: "sglang/ (LlamaForCausalLMEagle3)", SPECULATORS_DIR: "speculators/ (Eagle3Speculator)"}
    if kind == "peagle":
        from models.peagle import save_peagle
        save_peagle(draft, spec, target_config=target_config, verifier_name_or_path=verifier_name_or_path,
                    dtype=dtype)
        return {SPECULATORS_DIR: "speculators/ (PEagleSpeculator; vLLM parallel_drafting)"}
    from models.dflash import save_dflash
    save_dflash(draft, spec, target_config=target_config, verifier_name_or_path=verifier_name_or_path, dtype=dtype)
    return {SPECULATORS_DIR: "speculators/ (DFlashSpeculator)"}
