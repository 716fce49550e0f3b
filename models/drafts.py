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

Each kind with a draft module has one `DraftModel` here, the JAX side of its record in
models/draft_format.py (which every stage may read without JAX): how it is written and read. Each entry
imports its package when first used, so loading an EAGLE-3 draft imports no DFlash code.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from models.draft_format import SGLANG_DIR, SPECULATORS_DIR, draft_kind, folder_kind


def target_head(target: nnx.Module) -> jax.Array:
    """The target's LM head [V, D] in HF layout (its embedding when tied): what a draft with the target's
    own output head (DFlash) or a full-vocabulary DFlash checkpoint without `lm_head` reads."""
    return target.embed_tokens.weight[...] if target.lm_head is None else target.lm_head.weight().T


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """The files side of a draft kind (its JAX-free record: models/draft_format.py; how the draft stage
    builds and trains one: tasks/draft.py `TRAINING`, kept there so that what only training uses never enters
    the fingerprint of a stage that only reads drafts, such as evaluate).

    - `module`: the nnx.Module class name of its drafts (`kind_of` reads it);
    - `save(draft, folder, target_config, verifier_name_or_path, num_speculative_tokens, dtype)`: every
      layout of the kind under `folder`, returning {layout: description};
    - `load(folder, embed_tokens, lm_head)`: the draft a folder holds."""

    kind: str
    module: str
    save: Callable[..., dict[str, str]]
    load: Callable[[Path, Any, Any], nnx.Module]


def _eagle3_save(draft: nnx.Module, folder: str, *, target_config: Mapping[str, Any], verifier_name_or_path: str,
                 num_speculative_tokens: int, dtype: str) -> dict[str, str]:
    from models.eagle3 import save_sglang, save_speculators

    save_sglang(draft, os.path.join(folder, SGLANG_DIR), target_config=target_config, dtype=dtype)
    save_speculators(draft, os.path.join(folder, SPECULATORS_DIR), target_config=target_config,
                     verifier_name_or_path=verifier_name_or_path, num_speculative_tokens=num_speculative_tokens,
                     dtype=dtype)
    return {SGLANG_DIR: "sglang/ (LlamaForCausalLMEagle3)", SPECULATORS_DIR: "speculators/ (Eagle3Speculator)"}


def _eagle3_load(folder: Path, embed_tokens: Any, lm_head: Any) -> nnx.Module:
    from models.eagle3 import load_eagle3

    sub = SGLANG_DIR if (folder / SGLANG_DIR / "config.json").exists() else SPECULATORS_DIR
    return load_eagle3(str(folder / sub), embed_tokens=embed_tokens)


def _peagle_save(draft: nnx.Module, folder: str, *, target_config: Mapping[str, Any], verifier_name_or_path: str,
                 num_speculative_tokens: int, dtype: str) -> dict[str, str]:
    from models.peagle import save_peagle

    save_peagle(draft, os.path.join(folder, SPECULATORS_DIR), target_config=target_config,
                verifier_name_or_path=verifier_name_or_path, dtype=dtype)
    return {SPECULATORS_DIR: "speculators/ (PEagleSpeculator; vLLM parallel_drafting)"}


def _peagle_load(folder: Path, embed_tokens: Any, lm_head: Any) -> nnx.Module:
    from models.peagle import load_peagle

    return load_peagle(str(folder / SPECULATORS_DIR), embed_tokens)


def _dflash_save(draft: nnx.Module, folder: str, *, target_config: Mapping[str, Any], verifier_name_or_path: str,
                 num_speculative_tokens: int, dtype: str) -> dict[str, str]:
    from models.dflash import save_dflash

    save_dflash(draft, os.path.join(folder, SPECULATORS_DIR), target_config=target_config,
                verifier_name_or_path=verifier_name_or_path, dtype=dtype)
    return {SPECULATORS_DIR: "speculators/ (DFlashSpeculator)"}


def _dflash_load(folder: Path, embed_tokens: Any, lm_head: Any) -> nnx.Module:
    from models.dflash import load_dflash

    return load_dflash(str(folder / SPECULATORS_DIR), embed_tokens, lm_head=lm_head)


# One entry per kind that has a draft module (mtp fine-tunes the target's own layers: tasks/draft.py train_mtp).
# A subclass before its base (PEagleDraft subclasses Eagle3Draft): `kind_of` matches the exact class name.
DRAFT_MODELS: dict[str, DraftModel] = {m.kind: m for m in (
    DraftModel("eagle3", "Eagle3Draft", _eagle3_save, _eagle3_load),
    DraftModel("peagle", "PEagleDraft", _peagle_save, _peagle_load),
    DraftModel("dflash", "DFlashDraft", _dflash_save, _dflash_load),
)}


def draft_model(kind: str) -> DraftModel:
    """The JAX side of `kind`; ValueError naming the kinds that have a draft module otherwise."""
    draft_kind(kind)  # an unknown kind: the JAX-free registry's message
    if kind not in DRAFT_MODELS:
        raise ValueError(f"draft kind {kind!r} has no draft module (those that do: {', '.join(DRAFT_MODELS)})")
    return DRAFT_MODELS[kind]


def kind_of(draft: nnx.Module) -> str:
    """The kind of a draft module, by its class."""
    name = type(draft).__name__
    for m in DRAFT_MODELS.values():
        if m.module == name:
            return m.kind
    raise ValueError(f"{name} is not a draft kind forgeline exports ({', '.join(DRAFT_MODELS)})")


def load_draft(folder: str | Path, embed_tokens: jax.Array | np.ndarray,
               lm_head: jax.Array | np.ndarray | None = None) -> nnx.Module:
    """The draft in `folder` (a draft-stage candidate or a bundle's `draft/`) with the target's embedding
    (and, for a full-vocabulary DFlash draft, which does not store one, the target's LM head [V, D])."""
    folder = Path(folder)
    return draft_model(folder_kind(folder)).load(folder, embed_tokens, lm_head)


def save_draft(draft: nnx.Module, folder: str | Path, *, target_config: Mapping[str, Any], verifier_name_or_path: str,
               num_speculative_tokens: int, dtype: str = "bfloat16") -> dict[str, str]:
    """Write every layout of `draft`'s kind under `folder`; returns {layout: description} for the report."""
    return draft_model(kind_of(draft)).save(draft, str(folder), target_config=target_config,
                                            verifier_name_or_path=verifier_name_or_path,
                                            num_speculative_tokens=num_speculative_tokens, dtype=dtype)
