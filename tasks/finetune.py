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
from tokenizers import Tokenizer

import models
from models import lora
from tasks import checkers, plots
from tasks.cli import stage_cli
from tasks.configs import FinetuneConfig
from tasks.layout import model_dir
from tasks.stage import StageContext
from tasks.training import distill, grpo
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
    traces_dir: Path | None = None,
    checkpoints: Checkpoints | None = None,
    sft_checkpoints: Checkpoints | None = None,
    progress: Progress | None = None,
    base_name: str = "base",
) -> dict[str, Any]:
    mesh = mesh_from_config(cfg.train.mesh)
    layers = None  # distill: the student is these layers of the base (the teacher)
    if cfg.method == "distill":
        traces_dir = _distill_inputs(traces_dir)
        teacher_layers = int(models.load_config(str(base_dir))["num_hidden_layers"])
        layers = distill.student_layers(cfg.distill.student_layers, teacher_layers)
        log.info("finetune[distill]: student = layers %s of the teacher's %d", list(layers), teacher_layers)
    # streamed onto the mesh: each process reads only the slices its devices hold (models/hf.py)
    model = models.from_pretrained(str(base_dir), dtype=jnp.float32, mesh=mesh, rules=mesh_rules(cfg.train.mesh),
                                   layers=layers)
    if cfg.mode == "lora":
        lora.apply_lora(model, rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=cfg.lora_targets,
                        dropout=cfg.lora_dropout, rngs=nnx.Rngs(cfg.train.seed))
    trainable = nnx.LoRAParam if cfg.mode == "lora" else nnx.Param
    # the method's inputs are checked before any training (an SFT phase included)
    if cfg.method == "dpo":
        objective, loader, preference = _preference(cfg, data_dir)
    elif cfg.method == "grpo":
        rl = _grpo_inputs(cfg, data_dir)
    extra: dict[str, Any] = {}
    if cfg.sft_steps:  # SFT first: the method (and its reference) start from the SFT model
        sft = Trainer(model, cfg.sft_config, trainable=trainable, mesh=mesh)
        m = fit(sft, data_dir, checkpoints=sft_checkpoints, progress=progress, label=f"finetune[sft,{cfg.mode}]",
                logdir=out_dir / "tensorboard" / "sft")
        extra["sft"] = {k: m[k] for k in ("steps", "valid_loss_before", "valid_loss_after", "final_train_loss",
                                          "train_losses")}
        model = sft.model()
    if cfg.method == "dpo":
        trainer = Trainer(model, cfg.train, trainable=trainable, mesh=mesh, **objective)
    elif cfg.method == "grpo":
        g = cfg.grpo
        trainer = Trainer(model, cfg.train, trainable=trainable, mesh=mesh,
                          loss_fn=grpo.grpo_objective(clip_eps=g.clip_eps, beta=g.beta, loss_agg=g.loss_agg,
                                                      temperature=g.temperature, width=g.max_new_tokens),
                          count_fn=grpo.grpo_count(g.loss_agg))
    elif cfg.method == "distill":
        d = cfg.distill
        trainer = Trainer(model, cfg.train, trainable=trainable, mesh=mesh,
                          loss_fn=distill.distill_objective(d.temperature, d.alpha),
                          eval_fn=distill.distill_eval(d.temperature, d.alpha))
    else:
        trainer = Trainer(model, cfg.train, trainable=trainable, mesh=mesh)
    n_trainable = sum(x.size for x in jax.tree.leaves(trainer.params))
    log.info("finetune[%s, %s]: %d trainable parameters", cfg.method, cfg.mode, n_trainable)
    if cfg.method == "dpo":
        loader, before = _before_preference(cfg, trainer, data_dir, out_dir, loader, preference)
        extra |= before
        metrics = fit(trainer, data_dir, checkpoints=checkpoints, progress=progress,
                      label=f"finetune[{cfg.method},{cfg.mode}]", logdir=out_dir / "tensorboard", loader=loader)
        valid = loader(data_dir, "valid", cfg.preference.eval_batch_size, shuffle=False)
        extra["preference_after"] = pm.preference_metrics(trainer.model(), valid, trainer.put, **preference)
        log.info("finetune[dpo]: held-out %s", json.dumps(extra["preference_after"]))
    elif cfg.method == "grpo":
        # the KL reference: the model RL starts from (the SFT model, or the base; LoRA: its adapters as they
        # start, the base weights shared with the trainer)
        reference = trainer.snapshot() if cfg.grpo.needs_reference else None
        metrics = grpo.fit_grpo(trainer, reference, cfg.grpo, *rl, checkpoints=checkpoints, progress=progress,
                                logdir=out_dir / "tensorboard", label=f"finetune[grpo,{cfg.mode}]")
    elif cfg.method == "distill":
        metrics = fit(trainer, traces_dir, checkpoints=checkpoints, progress=progress, label="finetune[distill]",
                      logdir=out_dir / "tensorboard", loader=distill.TopkBatches)
        extra |= _distill_report(cfg, trainer, base_dir, data_dir, traces_dir, layers, mesh,
                                 sft_checkpoints=sft_checkpoints, progress=progress, out_dir=out_dir)
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
    result = {**metrics, **extra, "method": cfg.method, "mode": cfg.mode, "trainable_params": int(n_trainable)}
    if is_primary():
        (out_dir / "training.json").write_text(json.dumps(training_record(cfg, result), indent=1) + "\n")
        if cfg.method == "grpo":  # what evaluate reports and gates: deterministic, so hashed with the model
            rl = {"checker": cfg.grpo.checker, "steps": result["steps"], "sft_steps": cfg.sft_steps,
                  "accuracy_before": result["accuracy_before"], "accuracy_after": result["accuracy_after"]}
            (out_dir / "rl.json").write_text(json.dumps(rl, indent=1, sort_keys=True) + "\n")
        if cfg.method == "distill":  # likewise: evaluate reports teacher vs student vs the SFT student
            (out_dir / "distill.json").write_text(json.dumps(result["distill"], indent=1, sort_keys=True) + "\n")
        panels = plots.finetune_panels(result)
        if panels:
            png = plots.curves_png(panels, title=f"finetune[{cfg.method}, {cfg.mode}]")
            (out_dir / "curves.png").write_bytes(png)
    return result


def training_record(cfg: FinetuneConfig, result: dict[str, Any]) -> dict[str, Any]:
    """What `training.json` keeps of a run: the method, its curves and, for GRPO, the checker and held-out
    accuracy before (after any SFT phase) and after. Only what the run computed, none of its wall-clock
    numbers."""
    keep = ("steps", "train_losses", "train_metrics", "valid_loss_before", "valid_loss_after", "accuracy_before",
            "accuracy_after", "curves")
    record = {"method": cfg.method, "mode": cfg.mode, **{k: result[k] for k in keep if k in result}}
    if cfg.method == "grpo":
        record["checker"] = cfg.grpo.checker
    if "sft" in result:
        record["sft"] = {k: result["sft"][k] for k in ("steps", "valid_loss_before", "valid_loss_after",
                                                       "train_losses")}
    return record


def _grpo_inputs(cfg: FinetuneConfig, data_dir: Path) -> tuple[Any, ...]:
    """`method: grpo`'s data: (train prompts, held-out prompts, the checker's score, decode) and eos/pad as
    `fit_grpo` takes them. The checker must judge every held-out prompt (an error naming the checker and the
    data otherwise); train prompts it does not judge are dropped."""
    g = cfg.grpo
    tok = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    special = json.loads((data_dir / "special_tokens.json").read_text())

    def decode(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    heldout = grpo.heldout_prompts(data_dir, g.eval_prompts)
    checker = checkers.get(g.checker)
    judged = [t for t in heldout.text if checker.applies(t)]
    if not heldout or len(judged) < len(heldout):
        raise ValueError(f"finetune.grpo.checker: {g.checker!r} judges {len(judged)} of the {len(heldout)} held-out "
                         f"prompts of {data_dir} ({checker.description}); pick a checker for this data")
    train = grpo.train_prompts(data_dir, decode, special["bos"])
    keep = [i for i, t in enumerate(train.text) if checker.applies(t)]
    train = grpo.PromptSet([train.ids[i] for i in keep], [train.text[i] for i in keep])
    if not len(train):
        raise ValueError(f"finetune.grpo: no train prompt of {data_dir} is one {g.checker!r} judges")
    log.info("finetune[grpo]: %d train prompts, %d held-out, checker %s, %d completions per step in groups of %d",
             len(train), len(heldout), g.checker, cfg.train.batch_size, g.group_size)
    return train, heldout, checker.score, decode, special["eos"], special["pad"]


def _distill_inputs(traces_dir: Path | None) -> Path:
    """`method: distill`'s teacher traces: a traces folder with top-k logits; an error naming what is missing."""
    if traces_dir is None:
        raise ValueError("finetune.method: distill needs the teacher's traces with top-k logits (input `traces`: the "
                         "release runs traces on the base with finetune.distill.traces; `--traces DIR` by hand)")
    meta = traces_dir / "traces.json"
    if not meta.exists() or not json.loads(meta.read_text()).get("top_k_logits"):
        raise ValueError(f"finetune.method: distill: {traces_dir} holds no top-k logits (traces.json top_k_logits; "
                         "run traces with top_k_logits > 0)")
    return traces_dir


def _distill_report(cfg: FinetuneConfig, trainer: Trainer, base_dir: Path, data_dir: Path, traces_dir: Path,
                    layers: tuple[int, ...], mesh: Any, *, sft_checkpoints: Checkpoints | None,
                    progress: Progress | None, out_dir: Path) -> dict[str, Any]:
    """Teacher, the pruned student before training, the distilled student and (`compare_sft`) the same student
    trained as long with plain SFT on the data's rows, side by side on held-out data: the data's answers (cross
    entropy), the teacher's held-out answers (KL to its top-k, agreement with its top-1) and, with a `checker`,
    pass@1 at T = 0 on held-out prompts."""
    d, t, rules = cfg.distill, cfg.train, mesh_rules(cfg.train.mesh)
    if d.checker:
        tok = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
        special = json.loads((data_dir / "special_tokens.json").read_text())
        checker = checkers.get(d.checker)
        heldout = grpo.heldout_prompts(data_dir, d.eval_prompts)
        keep = [i for i, text in enumerate(heldout.text) if checker.applies(text)]
        if not keep:
            raise ValueError(f"finetune.distill.checker: {d.checker!r} judges none of the held-out prompts of "
                             f"{data_dir}")
        heldout = grpo.PromptSet([heldout.ids[i] for i in keep], [heldout.text[i] for i in keep])
    rows: dict[str, dict[str, Any]] = {}

    def measure(name: str, model: nnx.Module) -> None:
        row: dict[str, Any] = {
            "layers": int(model.config.num_hidden_layers),
            "params": int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))),
            "data_loss": distill.data_loss(model, data_dir, trainer.put, batch_size=t.batch_size,
                                           max_batches=t.eval_batches)}
        if name != "teacher":  # the teacher against its own top-k says nothing
            row |= distill.teacher_match(model, traces_dir, trainer.put, batch_size=t.batch_size,
                                         max_batches=t.eval_batches)  # at T = 1: the distribution served
        if d.checker:
            row["accuracy_t0"] = grpo.accuracy(
                model, heldout, checker.score, lambda ids: tok.decode(ids, skip_special_tokens=True),
                temperature=0.0, max_new_tokens=d.max_new_tokens, eos=special["eos"], pad=special["pad"],
                prompt_len=max(len(p) for p in heldout.ids), batch_size=min(64, len(heldout)))
        rows[name] = {k: round(v, 6) if isinstance(v, float) else v for k, v in row.items()}
        log.info("finetune[distill]: %s %s", name, json.dumps(rows[name]))

    # one model loaded at a time beside the student; the pruned start, once measured, is the SFT student's start
    measure("teacher", models.from_pretrained(str(base_dir), dtype=jnp.float32, mesh=mesh, rules=rules))
    pruned = models.from_pretrained(str(base_dir), dtype=jnp.float32, mesh=mesh, rules=rules, layers=layers)
    measure("pruned", pruned)
    measure("student", trainer.model())
    extra: dict[str, Any] = {}
    if d.compare_sft:
        sft = Trainer(pruned, t, trainable=nnx.Param, mesh=mesh)
        m = fit(sft, data_dir, checkpoints=sft_checkpoints, progress=progress, label="finetune[distill: SFT student]",
                logdir=out_dir / "tensorboard" / "sft")
        extra["sft"] = {k: m[k] for k in ("steps", "valid_loss_before", "valid_loss_after", "final_train_loss",
                                          "train_losses")}
        measure("sft_student", sft.model())
    extra["distill"] = {"teacher_layers": rows["teacher"]["layers"], "student_layers": list(layers),
                        "temperature": d.temperature, "alpha": d.alpha, "steps": t.steps, "checker": d.checker,
                        "prompts": len(heldout) if d.checker else 0, "models": rows}
    return extra


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
    traces = inputs.get("traces")
    if context is None:
        return finetune(config, base, inputs["data"], output, traces_dir=traces, progress=progress,
                        base_name=str(base.resolve()))
    # two trainings (sft_steps, or distill's SFT student): two sibling checkpoint folders, each resumed on its own
    keep = config.train.keep_checkpoints
    two = bool(config.sft_steps) or (config.method == "distill" and config.distill.compare_sft)
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
