"""Stage `finetune`: full-parameter or LoRA fine-tuning of an HF-layout checkpoint on packed data.

    python -m tasks.finetune --base DIR --data DIR --out DIR [--set mode=lora train.steps=100 ...]

Inputs: `base` (an HF checkpoint folder: config.json, safetensors, tokenizer.json) and `data` (the
output of data_prep). Outputs: `model/` (merged weights in HF layout, tokenizer.json,
generation_config.json) and, for LoRA, `adapter/` (PEFT layout). Training resumes from the newest
checkpoint under `<store>/checkpoints/finetune/<fingerprint>/` after a crash or a kill.
"""

from __future__ import annotations

import functools
import json
import logging
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import models
from models import lora
from storage import Store
from tasks.cli import OPTIONAL_PATH, PATH, stage_main
from tasks.configs import FinetuneConfig
from tasks.layout import model_dir
from tasks.stage import StageContext
from tasks.training import preference as pm
from tasks.training.checkpoints import Checkpoints
from tasks.training.distributed import is_primary
from tasks.training.loop import Progress, fit
from tasks.training.save import save_model_dir
from tasks.training.trainer import Trainer, mesh_from_config, mesh_rules

log = logging.getLogger("forgeline.finetune")


def finetune(
    cfg: FinetuneConfig,
    base_dir: Path,
    data_dir: Path,
    out_dir: Path,
    *,
    checkpoints: Checkpoints | None = None,
    progress: Progress | None = None,
    base_name: str = "base",
) -> dict[str, Any]:
    mesh = mesh_from_config(cfg.train.mesh)
    # streamed onto the mesh: each process reads only the slices its devices hold (models/hf.py)
    model = models.from_pretrained(str(base_dir), dtype=jnp.float32, mesh=mesh, rules=mesh_rules(cfg.train.mesh))
    if cfg.mode == "lora":
        lora.apply_lora(model, rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=cfg.lora_targets,
                        dropout=cfg.lora_dropout, rngs=nnx.Rngs(cfg.train.seed))
    trainable = nnx.LoRAParam if cfg.mode == "lora" else nnx.Param
    if cfg.method == "dpo":
        objective, loader, preference = _preference(cfg, data_dir)
        trainer = Trainer(model, cfg.train, trainable=trainable, mesh=mesh, **objective)
    else:
        trainer = Trainer(model, cfg.train, trainable=trainable, mesh=mesh)
    n_trainable = sum(x.size for x in jax.tree.leaves(trainer.params))
    log.info("finetune[%s, %s]: %d trainable parameters", cfg.method, cfg.mode, n_trainable)
    extra: dict[str, Any] = {}
    if cfg.method == "dpo":
        loader, extra = _before_preference(cfg, trainer, data_dir, out_dir, loader, preference)
        metrics = fit(trainer, data_dir, checkpoints=checkpoints, progress=progress,
                      label=f"finetune[{cfg.method},{cfg.mode}]", logdir=out_dir / "tensorboard", loader=loader)
        valid = loader(data_dir, "valid", cfg.preference.eval_batch_size, shuffle=False)
        extra["preference_after"] = pm.preference_metrics(trainer.model(), valid, trainer.put, **preference)
        log.info("finetune[dpo]: held-out %s", json.dumps(extra["preference_after"]))
    else:
        metrics = fit(trainer, data_dir, checkpoints=checkpoints, progress=progress, label=f"finetune[{cfg.mode}]",
                      logdir=out_dir / "tensorboard")
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
    return {**metrics, **extra, "method": cfg.method, "mode": cfg.mode, "trainable_params": int(n_trainable)}


def _preference(cfg: FinetuneConfig, data_dir: Path) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """The Trainer's objective for `method: dpo`, the pair loader and the loss's settings; a data folder
    without preference pairs is an error naming it."""
    for split in ("train", "valid"):
        if pm.count_pairs(data_dir, split) == 0:
            raise ValueError(f"finetune.method: dpo needs preference pairs, and {data_dir} has no {split} pairs "
                             f"(pairs-{split}-*.parquet: data_prep writes them for a corpus of chosen/rejected "
                             "records, e.g. builtin://python-stdlib-preferences)")
    p = cfg.preference
    settings = {"loss": p.loss, "beta": p.effective_beta, "gamma": p.gamma}
    objective = pm.preference_objective(p.loss, p.effective_beta, p.label_smoothing, p.gamma)
    return ({"loss_fn": objective, "eval_fn": pm.preference_eval(objective), "count_fn": pm.pair_count},
            pm.PairBatches, settings)


def _before_preference(cfg: FinetuneConfig, trainer: Trainer, data_dir: Path, out_dir: Path, loader: Any,
                       settings: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """DPO: the starting model's log-probabilities of every pair, written once under `out_dir/reference/`
    (the model before any step: the base, or the base with its zero-initialised LoRA adapters, i.e. with
    them off), and the held-out preference numbers before training."""
    extra: dict[str, Any] = {}
    start = trainer.model()
    if settings["loss"] == "dpo":
        t = time.perf_counter()
        ref = pm.write_reference(start, data_dir, out_dir / "reference", trainer.put, cfg.preference.eval_batch_size)
        extra["reference"] = {**ref, "seconds": round(time.perf_counter() - t, 2)}
        log.info("finetune[dpo]: reference log-probabilities of %d pairs in %.1fs", ref["pairs"],
                 extra["reference"]["seconds"])
        loader = functools.partial(pm.PairBatches, reference_dir=out_dir / "reference")
    valid = loader(data_dir, "valid", cfg.preference.eval_batch_size, shuffle=False)
    extra["preference_before"] = pm.preference_metrics(start, valid, trainer.put, **settings)
    log.info("finetune[dpo]: held-out before training %s", json.dumps(extra["preference_before"]))
    return loader, extra


def run(config: FinetuneConfig, inputs: Mapping[str, Path], output: Path, *, progress: Progress | None = None,
        context: StageContext | None = None) -> dict[str, Any]:
    """The stage: inputs `base` (a checkpoint artifact or HF folder) and `data`. With a `context`, training
    resumes from the store's checkpoints and the adapter names its base by the base's key in the store (the
    HF folder inside the artifact), not its URL: the same bytes wherever the store lives."""
    base = model_dir(inputs["base"])
    if context is None:
        return finetune(config, base, inputs["data"], output, progress=progress, base_name=str(base.resolve()))
    ckpt = Checkpoints.for_stage(context, config.train.keep_checkpoints)
    try:
        return finetune(config, base, inputs["data"], output, checkpoints=ckpt, progress=progress,
                        base_name=context.key_of("base", base.relative_to(inputs["base"]).as_posix()))
    finally:
        ckpt.close()


def main(argv: list[str] | None = None) -> None:
    def run(cfg: FinetuneConfig, a) -> dict[str, Any]:
        store = Store(a.store) if a.store else None
        ckpt = Checkpoints(a.checkpoints, store, "finetune/cli", keep=cfg.train.keep_checkpoints) \
            if a.checkpoints else None
        try:
            base = model_dir(a.base)
            return finetune(cfg, base, a.data, a.out, checkpoints=ckpt, base_name=str(base.resolve()))
        finally:
            if ckpt:
                ckpt.close()

    stage_main(__doc__, FinetuneConfig, {
        "--base": PATH, "--data": PATH,
        "--checkpoints": {**OPTIONAL_PATH, "help": "local checkpoint folder (enables resume)"},
        "--store": {"help": "also upload checkpoints to this store URL and resume from there"},
    }, run, argv)

if __name__ == "__main__":
    main()
