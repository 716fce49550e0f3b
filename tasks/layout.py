"""Where things sit inside a committed artifact, for every stage that reads another stage's output.

    <store>/<kind>/<fingerprint>/           a committed artifact (storage/artifacts.py: files, then manifest.json)
        model/                              finetune: the merged weights in HF layout + TOKENIZER_FILES
        adapter/                            finetune (LoRA): the PEFT adapter
        <scheme>/                           quantize: one HF-layout folder per scheme (compressed-tensors)
        draft/drafts.json                   draft: the candidates the stage trained, in order
        draft/<name>/speculators/           ... each in vLLM's speculators layout (every kind),
        draft/<name>/sglang/                ... and SGLang's (EAGLE-3 only), with draft_config.json
    <store>/checkpoints/<kind>/<fingerprint>/   a training stage's resumable checkpoints (removed on commit)

A stage reads an input through these helpers, never through another stage's module.
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "special_tokens.json", "tokenizer_config.json")  # travel with every checkpoint


def checkpoint_prefix(kind: str, fingerprint: str) -> str:
    """The store key under which a training stage keeps its resumable checkpoints."""
    return f"checkpoints/{kind}/{fingerprint}"


def model_dir(artifact_dir: Path, variant: str = "finetuned") -> Path:
    """The HF checkpoint in an artifact (`model/`, or `draft/` for a draft artifact) or a bare HF folder;
    `variant` other than "finetuned" names a quantized scheme inside a quantize artifact (`<scheme>/`)."""
    if variant != "finetuned":
        if not (artifact_dir / variant / "config.json").exists():
            have = sorted(p.name for p in artifact_dir.iterdir() if (p / "config.json").exists())
            raise ValueError(f"{artifact_dir}: no quantized variant {variant!r} (have: {have})")
        return artifact_dir / variant
    for sub in ("model", "draft"):
        if (artifact_dir / sub / "config.json").exists():
            return artifact_dir / sub
    return artifact_dir


DRAFTS_FILE = "drafts.json"


def is_draft_folder(path: Path) -> bool:
    """A folder holding one draft in its serving layouts (`speculators/` and/or `sglang/`)."""
    return any((path / sub / "config.json").exists() for sub in ("speculators", "sglang"))


def draft_candidates(path: Path) -> dict[str, Path]:
    """name -> draft folder for every draft in `path`: a draft artifact (`draft/drafts.json` lists its
    candidates), a release bundle (`draft/`: the one shipped), or a draft folder itself. ValueError when
    there is none."""
    listing = path / "draft" / DRAFTS_FILE
    if listing.exists():
        names = json.loads(listing.read_text())["candidates"]
        return {name: path / "draft" / name for name in names}
    for folder in (path / "draft", path):
        if is_draft_folder(folder):
            meta = folder / "draft_config.json"
            name = json.loads(meta.read_text()).get("name", "draft") if meta.exists() else "draft"
            return {name: folder}
    raise ValueError(f"{path}: no draft (neither draft/{DRAFTS_FILE}, a draft/ folder nor speculators/ or sglang/)")


def draft_dir(path: Path, name: str | None = None) -> Path:
    """One draft folder in `path` (see draft_candidates): the one named `name`, else the first."""
    found = draft_candidates(path)
    if name is None:
        return next(iter(found.values()))
    if name not in found:
        raise ValueError(f"{path}: no draft named {name!r} (have: {sorted(found)})")
    return found[name]
