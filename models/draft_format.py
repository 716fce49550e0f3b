"""Where a draft sits in a folder and which kind it is, read from its config.json alone (no model code:
the export stage and the layout helpers use it without depending on the drafts' implementations).

    <draft folder>/speculators/config.json   vLLM speculators layout, every kind (`speculators_model_type`)
    <draft folder>/sglang/config.json        SGLang / EAGLE-official layout, EAGLE-3 only
    <draft folder>/mtp/model.safetensors     a fine-tuned MTP head: the target's `model.layers.{L+m}.*` tensors
    <draft folder>/draft_config.json         what the draft stage recorded
"""

from __future__ import annotations

import json
from pathlib import Path

KINDS = ("eagle3", "peagle", "dflash", "mtp")
SPECULATORS_DIR, SGLANG_DIR, MTP_DIR = "speculators", "sglang", "mtp"


def folder_kind(folder: str | Path) -> str:
    """The kind of an exported draft: a fine-tuned MTP head (`mtp/`), else `speculators_model_type` of
    speculators/config.json, else the SGLang layout's EAGLE-3. ValueError naming the folder when it holds none."""
    folder = Path(folder)
    if (folder / MTP_DIR / "model.safetensors").exists():
        return "mtp"
    spec = folder / SPECULATORS_DIR / "config.json"
    if spec.exists():
        kind = json.loads(spec.read_text()).get("speculators_model_type")
        if kind not in KINDS:
            raise ValueError(f"{spec}: speculators_model_type {kind!r} is not one of {', '.join(KINDS)}")
        return kind
    if (folder / SGLANG_DIR / "config.json").exists():
        return "eagle3"
    raise ValueError(f"{folder}: no draft (neither {SPECULATORS_DIR}/config.json nor {SGLANG_DIR}/config.json)")
