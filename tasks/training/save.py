"""A trained model written out: HF layout (models/hf.py) plus the tokenizer files every checkpoint carries."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
from flax import nnx

from models.hf import save_pretrained
from tasks.layout import TOKENIZER_FILES


def save_model_dir(model: nnx.Module, out: Path, tokenizer_dir: Path) -> None:
    """HF layout plus the tokenizer files that travel with every checkpoint we write.

    Multi-process: every process calls it with the same (sharded) model, because `save_pretrained` is a
    collective (each tensor is computed and gathered by all processes, written by one; docs/formats/
    hf-checkpoint.md, "Streamed saving"); process 0 copies the tokenizer files, as it writes the configs."""
    save_pretrained(model, str(out))
    if jax.process_index() == 0:
        for name in TOKENIZER_FILES:
            if (tokenizer_dir / name).exists():
                shutil.copyfile(tokenizer_dir / name, out / name)
