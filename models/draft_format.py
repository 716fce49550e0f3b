"""The speculative-decoding draft kinds, listed once, and where a draft sits in a folder: one `DraftKind`
record per kind, read from config.json alone (no model code, no JAX: tasks/configs.py validates the draft
stage's candidates against these records, and the export stage tells a shipped draft's kind with them).

    <draft folder>/speculators/config.json   vLLM speculators layout, every kind (`speculators_model_type`)
    <draft folder>/sglang/config.json        SGLang / EAGLE-official layout, EAGLE-3 only
    <draft folder>/mtp/model.safetensors     a fine-tuned MTP head: the target's `model.layers.{L+m}.*` tensors
    <draft folder>/draft_config.json         what the draft stage recorded

The speculators field names follow vllm-project/speculators 0.9.0 (`src/speculators/config.py`,
https://github.com/vllm-project/speculators). Adding a kind: docs/speculative-decoding.md ("Adding a draft kind").
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

SPECULATORS_DIR, SGLANG_DIR, MTP_DIR = "speculators", "sglang", "mtp"


@dataclasses.dataclass(frozen=True)
class DraftKind:
    """One draft kind: what every stage may know of it without its model code.

    `check(candidate, k)` returns what is wrong with a draft-stage candidate of this kind for `k` draft tokens
    per verify (None: nothing), `candidate` being a tasks.configs.DraftCandidate."""

    name: str  # the candidate's `kind`, draft_config.json's `method`
    summary: str  # how it drafts (one line, for docs and reports)
    speculators_type: str | None = None  # speculators_model_type of its speculators/config.json; None: no such layout
    marker: str | None = None  # a file under the draft folder that tells this kind apart without speculators/
    uses_target_head: bool = False  # predicts through the target's own LM head rows (loaded, frozen, not exported)
    trains_target: bool = False  # fine-tunes the target's own layers rather than a separate draft module
    equal_step_weights: bool = False  # its training steps weigh the same (no ttt_decay)
    check: Callable[[Any, int], str | None] = lambda candidate, k: None


def _peagle_check(c: Any, k: int) -> str | None:
    return f"num_depths {c.num_depths} < k {k}" if (c.num_depths or k) < k else None


def _dflash_check(c: Any, k: int) -> str | None:
    return f"block_size {c.block_size} < k + 1 = {k + 1}" if (c.block_size or k + 1) < k + 1 else None


_REGISTRY: dict[str, DraftKind] = {}


def register(kind: DraftKind) -> DraftKind:
    """Add `kind` to the registry (ValueError if its name is taken); returns it."""
    if kind.name in _REGISTRY:
        raise ValueError(f"draft kind {kind.name!r} is already registered")
    _REGISTRY[kind.name] = kind
    return kind


def unregister(name: str) -> None:
    """Remove a kind registered at run time (a test's toy kind)."""
    del _REGISTRY[name]


register(DraftKind("eagle3", "k sequential draft forwards (chain or tree)", speculators_type="eagle3",
                   marker=f"{SGLANG_DIR}/config.json"))
register(DraftKind("peagle", "one forward for k tokens (parallel drafting)", speculators_type="peagle",
                   equal_step_weights=True, check=_peagle_check))  # speculators weighs P-EAGLE's depths equally
register(DraftKind("dflash", "one forward for a block of k + 1 slots", speculators_type="dflash",
                   uses_target_head=True, check=_dflash_check))
register(DraftKind("mtp", "the target's own MTP layers, fine-tuned", marker=f"{MTP_DIR}/model.safetensors",
                   trains_target=True))

KINDS = tuple(_REGISTRY)  # the built-in kinds, in the order docs and schemas list them


def kinds() -> tuple[str, ...]:
    """Every registered kind's name (the built-in ones and any registered since)."""
    return tuple(_REGISTRY)


def draft_kind(name: str) -> DraftKind:
    """The record of kind `name`; ValueError naming the known kinds otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"draft kind {name!r} is not one of {', '.join(_REGISTRY)}")
    return _REGISTRY[name]


def folder_kind(folder: str | Path) -> str:
    """The kind of an exported draft: a kind without a speculators layout by its marker file (a fine-tuned MTP
    head: `mtp/`), else `speculators_model_type` of speculators/config.json, else by another layout's marker
    (SGLang's: EAGLE-3). ValueError naming the folder when it holds none."""
    folder = Path(folder)
    for k in _REGISTRY.values():
        if k.speculators_type is None and k.marker is not None and (folder / k.marker).exists():
            return k.name
    spec = folder / SPECULATORS_DIR / "config.json"
    if spec.exists():
        model_type = json.loads(spec.read_text()).get("speculators_model_type")
        for k in _REGISTRY.values():
            if k.speculators_type is not None and k.speculators_type == model_type:
                return k.name
        raise ValueError(f"{spec}: speculators_model_type {model_type!r} is not one of {', '.join(_REGISTRY)}")
    for k in _REGISTRY.values():
        if k.speculators_type is not None and k.marker is not None and (folder / k.marker).exists():
            return k.name
    raise ValueError(f"{folder}: no draft (neither {SPECULATORS_DIR}/config.json nor {SGLANG_DIR}/config.json)")
