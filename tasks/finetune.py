"""Stage `finetune`: full-parameter or LoRA fine-tuning of an HF-layout checkpoint on packed data.

    python -m tasks.finetune --base DIR --data DIR --out DIR [--set mode=lora train.steps=100 ...]

Inputs: `base` (an HF checkpoint folder: config.json, safetensors, tokenizer.json) and `data` (the
output of data_prep). Outputs: `model/` (merged weights in HF layout, tokenizer.json,
generation_config.json), for LoRA `adapter/` (PEFT layout), for GRPO `rl.json` (held-out accuracy at the start
of RL and at its end, which evaluate reports and gates), `training.json` (the run's curves: `training_record`;
a resumed run's begin where it resumed, so the file is volatile) and `curves.png`, the curves drawn (loss; DPO's rewards
and margins; GRPO's reward, KL, clip fraction, length and held-out accuracy), which the release bundle and the
Prefect UI show (tasks/plots.py). Training resumes from the newest
checkpoint under `<store>/checkpoints/finetune/<fingerprint>/` after a crash or a kill.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import models
from models import lora
from tasks import plots
from tasks.cli import stage_cli
from tasks.configs import FinetuneConfig
from tasks.layout import model_dir
from tasks.methods.run import Run
from tasks.stage import StageContext
from tasks.training import indexer, methods
from tasks.training.checkpoints import Checkpoints
from tasks.training.distributed import is_primary
from tasks.training.loop import Progress
from tasks.training.save import save_model_dir
from tasks.training.trainer import mesh_from_config, mesh_rules

log = logging.getLogger("forgeline.finetune")


def finetune(
    cfg: FinetuneConfig,
    base_dir: Path,
    data_dir: Path,
    out_dir: Path,
    *,
    traces_dir: Path | None = None,
    checkpoints: Checkpoints | None = None,
    sft_checkpoints: Checkpoints | None = None,
    progress: Progress | None = None,
    base_name: str = "base",
) -> dict[str, Any]:
    """Fine-tune the base with the method `cfg.method` names (registered in tasks/training/methods.py; the
    built-in ones are tasks/methods/): the same steps for every method, the method's hooks where they differ."""
    run = Run(cfg, base_dir, data_dir, out_dir, mesh_from_config(cfg.train.mesh),
              inputs={} if traces_dir is None else {"traces": traces_dir}, checkpoints=checkpoints,
              sft_checkpoints=sft_checkpoints, progress=progress)
    method = methods.get(cfg.method)(run)  # its inputs are checked before the model loads and any training
    # streamed onto the mesh: each process reads only the slices its devices hold (models/hf.py)
    model = models.from_pretrained(str(base_dir), dtype=jnp.float32, mesh=run.mesh, rules=mesh_rules(cfg.train.mesh),
                                   layers=method.layers)
    if cfg.mode == "lora":
        lora.apply_lora(model, rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=cfg.lora_targets,
                        dropout=cfg.lora_dropout, rngs=nnx.Rngs(cfg.train.seed))
    # a DSA model's indexer: frozen, or trained by its KL objective (tasks/training/indexer.py)
    trainable = indexer.trainable(model, cfg.mode, cfg.indexer)
    extra: dict[str, Any] = {}
    if cfg.sft_steps:  # SFT first: the method (and its reference) start from the SFT model
        model, extra["sft"] = run.sft(model, cfg.sft_config, trainable, label=f"finetune[sft,{cfg.mode}]")
    trainer = method.trainer(model, trainable)
    n_trainable = sum(x.size for x in jax.tree.leaves(trainer.params))
    log.info("finetune[%s, %s]: %d trainable parameters", cfg.method, cfg.mode, n_trainable)
    metrics, more = method.fit(trainer)
    extra |= more
    model = trainer.model()
    # multi-host: every process takes part in writing (the tensors of a sharded model are gathered by all of
    # them, written by one: models/hf.py, save_pretrained); `save_pretrained` folds the LoRA factors into the
    # weights it writes, so the model needs no merge_lora (op by op, outside the save's one-program-at-a-time
    # order) first
    if cfg.mode == "lora":
        with tempfile.TemporaryDirectory(prefix="finetune-adapter-") as scratch:
            # the factors are gathered by every process; process 0's copy is the output
            dest = out_dir / "adapter" if is_primary() else Path(scratch) / "adapter"
            lora.save_peft_adapter(model, str(dest), base_model_name_or_path=base_name)
    save_model_dir(model, out_dir / "model", data_dir)
    result = {**metrics, **extra, "method": cfg.method, "mode": cfg.mode, "trainable_params": int(n_trainable)}
    if is_primary():
        (out_dir / "training.json").write_text(json.dumps(training_record(cfg, result), indent=1) + "\n")
        method.write(result)  # the method's files that later stages read (GRPO's rl.json, distill.json)
        panels = plots.finetune_panels(result)
        if panels:
            png = plots.curves_png(panels, title=f"finetune[{cfg.method}, {cfg.mode}]")
            (out_dir / "curves.png").write_bytes(png)
    return result


def training_record(cfg: FinetuneConfig, result: dict[str, Any]) -> dict[str, Any]:
    """What `training.json` keeps of a run: the method, its curves (GRPO's: with the held-out accuracy before,
    after any SFT phase, and after), what the method adds (`Method.record`: GRPO's checker) and the SFT phase's.
    Only what the run computed, none of its wall-clock numbers."""
    keep = ("steps", "train_losses", "train_metrics", "valid_loss_before", "valid_loss_after", "accuracy_before",
            "accuracy_after", "curves")
    record = {"method": cfg.method, "mode": cfg.mode, **{k: result[k] for k in keep if k in result}}
    record |= methods.get(cfg.method).record(cfg)
    if "sft" in result:
        record["sft"] = {k: result["sft"][k] for k in ("steps", "valid_loss_before", "valid_loss_after",
                                                       "train_losses")}
    return record


def run(config: FinetuneConfig, inputs: Mapping[str, Path], output: Path, *, progress: Progress | None = None,
        context: StageContext | None = None) -> dict[str, Any]:
    """The stage: inputs `base` (a checkpoint artifact or HF folder) and `data`. With a `context`, training
    resumes from the store's checkpoints and the adapter names its base by the base's key in the store (the
    HF folder inside the artifact), not its URL: the same bytes wherever the store lives."""
    base = model_dir(inputs["base"])
    traces = inputs.get("traces")
    if context is None:
        return finetune(config, base, inputs["data"], output, traces_dir=traces, progress=progress,
                        base_name=str(base.resolve()))
    # two trainings (sft_steps, or distill's SFT student): two sibling checkpoint folders, each resumed on its own
    keep = config.train.keep_checkpoints
    two = methods.get(config.method).trains_twice(config)
    ckpt = Checkpoints.for_stage(context, keep, sub=config.method if two else None)
    sft = Checkpoints.for_stage(context, keep, sub="sft") if two else None
    try:
        return finetune(config, base, inputs["data"], output, traces_dir=traces, checkpoints=ckpt,
                        sft_checkpoints=sft, progress=progress,
                        base_name=context.key_of("base", base.relative_to(inputs["base"]).as_posix()))
    finally:
        ckpt.close()
        if sft is not None:
            sft.close()


main = stage_cli(__name__)  # `python -m tasks.finetune`: the command line its declaration implies (tasks/cli.py)


if __name__ == "__main__":
    main()
