"""Stage `draft`: a small draft model for speculative decoding, trained on the target's own traces.

    python -m tasks.draft --target DIR --traces DIR --out DIR [--set layers=1 train.steps=200 ...]

The draft shares the target's tokenizer and is initialised from the target itself -- its token
embeddings, its first `layers` decoder layers, its final norm and LM head (a "layer-skip" draft) --
then trained with next-token cross entropy on the target's regenerated answers, i.e. sequence-level
distillation. It runs with its own KV cache and any speculative decoder that takes two causal LMs
with one vocabulary (vLLM/SGLang "draft model" mode, transformers assisted generation). Issue #5
replaces it with an EAGLE-3 head on target features; the stage contract stays.
Output: `draft/` (HF layout) with `draft_config.json` naming the target and the speculation length.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx
from pydantic import BaseModel, ConfigDict, Field
from safetensors.numpy import load_file, save_file

import models
from tasks.cli import PATH, stage_main
from tasks.finetune import model_dir, save_model_dir
from tasks.stage import StageContext
from tasks.train import Progress, TrainConfig, Trainer, fit

log = logging.getLogger("forgeline.draft")


class DraftConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    layers: int = Field(1, ge=1)
    k: int = Field(4, ge=1)  # tokens proposed per verification step (recorded for serving)
    train: TrainConfig = TrainConfig(steps=150, batch_size=16, learning_rate=2e-3, warmup_steps=10,
                                     checkpoint_every=50)


def truncate_checkpoint(target_dir: Path, layers: int, out: Path) -> None:
    """An HF checkpoint of the target's embeddings + first `layers` layers + norm + head."""
    config = json.loads((target_dir / "config.json").read_text())
    if layers > config["num_hidden_layers"]:
        raise ValueError(f"draft.layers: {layers} > the target's {config['num_hidden_layers']} layers")
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(target_dir.glob("*.safetensors")):
        for name, value in load_file(f).items():
            parts = name.split(".")
            if parts[:2] == ["model", "layers"] and int(parts[2]) >= layers:
                continue
            tensors[name] = value
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2))


def train_draft(cfg: DraftConfig, target_dir: Path, traces_dir: Path, out_dir: Path, *,
                progress: Progress | None = None, init_dir: Path | None = None) -> dict[str, Any]:
    """Train a draft; `init_dir` (a previous draft) warm-starts it instead of the truncated target."""
    with tempfile.TemporaryDirectory() as tmp:
        if init_dir is None:
            truncate_checkpoint(target_dir, cfg.layers, Path(tmp))
            init_dir = Path(tmp)
        draft = models.from_pretrained(str(init_dir))
    trainer = Trainer(draft, cfg.train, trainable=nnx.Param)
    metrics = fit(trainer, traces_dir, progress=progress, label="draft", logdir=out_dir / "tensorboard")
    dest = out_dir / "draft"
    save_model_dir(trainer.model(), dest, traces_dir)
    target_cfg = json.loads((target_dir / "config.json").read_text())
    (dest / "draft_config.json").write_text(json.dumps({
        "method": "draft_model", "num_speculative_tokens": cfg.k, "layers": draft.config.num_hidden_layers,
        "target_architecture": target_cfg.get("architectures", ["?"])[0],
        "target_num_hidden_layers": target_cfg["num_hidden_layers"],
    }, indent=2))
    return {**metrics, "layers": draft.config.num_hidden_layers}


def compute(cfg: DraftConfig, progress: Progress | None = None, init_input: str | None = None):
    """Inputs `target` (finetune artifact), `traces`, and optionally `init_input` (a previous draft)."""

    def _compute(ctx: StageContext) -> dict[str, Any]:
        init = ctx.inputs[init_input] / "draft" if init_input and init_input in ctx.inputs else None
        return train_draft(cfg, model_dir(ctx.inputs["target"]), ctx.inputs["traces"], ctx.out_dir,
                           progress=progress, init_dir=init)

    return _compute


def main(argv: list[str] | None = None) -> None:
    stage_main(__doc__, DraftConfig, {"--target": PATH, "--traces": PATH},
               lambda cfg, a: train_draft(cfg, model_dir(a.target), a.traces, a.out), argv)

if __name__ == "__main__":
    main()
