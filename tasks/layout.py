"""Where things sit inside a committed artifact, for every stage that reads another stage's output.

    <store>/<kind>/<fingerprint>/           a committed artifact (storage/artifacts.py: files, then manifest.json)
        model/                              finetune: the merged weights in HF layout + TOKENIZER_FILES
        adapter/                            finetune (LoRA): the PEFT adapter
        <scheme>/                           quantize: one HF-layout folder per scheme (compressed-tensors)
        draft/speculators/, draft/sglang/   draft: the EAGLE-3 draft in both layouts
    <store>/checkpoints/<kind>/<fingerprint>/   a training stage's resumable checkpoints (removed on commit)

A stage reads an input through these helpers, never through another stage's module.
"""

from __future__ import annotations

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


def draft_dir(path: Path) -> Path:
    """The SGLang-layout folder inside a draft artifact (`draft/sglang`), a bundle's `draft/`, or `path`."""
    for cand in (path / "draft" / "sglang", path / "sglang"):
        if (cand / "config.json").exists():
            return cand
    return path
