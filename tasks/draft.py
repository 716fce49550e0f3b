"""Stage `draft`: an EAGLE-3 draft head trained on the target's own traces.

    python -m tasks.draft --target DIR --traces DIR --out DIR [--set ttt_steps=7 draft_vocab_size=2048 ...]

Mirrors docs/speculative-decoding.md and docs/formats/eagle3.md (SpecForge / vLLM speculators practice):
- the draft (models/eagle3/) reads three target features (layers `aux_layer_ids`, recorded by the
  traces stage) fused by `fc`, has one decoder layer over [embedding ; fused], the target's frozen
  embeddings, and a pruned vocabulary: the `draft_vocab_size` target tokens most frequent in the
  traces' answers (`d2t`/`t2d`);
- it trains with the training-time-test unroll (`ttt_steps` steps weighted `ttt_decay`^k) on the
  forward KL to the target's distribution over the draft vocabulary, through the shared training loop
  (tasks/training/: mesh, checkpoints, NaN guard, metrics) with only the draft's parameters trainable;
- target features come from the traces' stored hidden states (offline) or, when the traces were
  written `hidden_states: online`, from the frozen target run inside the same jitted step;
- `init` (the current draft, for a refresh) warm-starts the weights and keeps its vocabulary.

Inputs: `target` (an HF checkpoint folder or a finetune artifact: the model the draft will serve
with, possibly a quantized variant) and `traces` (tasks/traces.py output). Output `draft/`:
`sglang/` (SGLang/EAGLE layout, `LlamaForCausalLMEagle3`, also loaded by vLLM), `speculators/`
(vLLM speculators `Eagle3Speculator` layout) and `draft_config.json`.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
from flax import nnx

import models
from models.eagle3 import (
    Eagle3Config,
    Eagle3Draft,
    build_draft_vocab,
    load_eagle3,
    save_sglang,
    save_speculators,
    ttt_loss,
)
from models.layers import Buffer, param
from tasks.cli import PATH, stage_main
from tasks.configs import DraftConfig
from tasks.data.features import load_hidden, target_features
from tasks.layout import draft_dir, model_dir
from tasks.stage import StageContext
from tasks.training.checkpoints import Checkpoints
from tasks.training.data import PackedBatches
from tasks.training.loop import Progress, fit
from tasks.training.trainer import Trainer

log = logging.getLogger("forgeline.draft")


# -- data ------------------------------------------------------------------------------------------


class TraceBatches(PackedBatches):
    """Packed trace rows plus, for offline traces, the target features stored next to each shard
    (`hidden-<shard>.safetensors`: `aux` [R, T, 3·D_t], `final` [R, T, D_t], tasks/traces.py)."""

    def _read(self, shard: int) -> dict[str, np.ndarray]:
        rows = super()._read(shard)
        hidden = self.files[shard].with_name(f"hidden-{self.files[shard].stem}.safetensors")
        if hidden.exists():
            rows.update(load_hidden(hidden))
        return rows


def token_counts(traces_dir: Path, vocab_size: int) -> np.ndarray:
    """How often each target token is an answer token (a loss target) in the traces' train split."""
    counts = np.zeros(vocab_size, np.int64)
    for f in sorted(traces_dir.glob("train-*.parquet")):
        table = pq.read_table(f, columns=["target_ids", "loss_mask"])
        for ids, mask in zip(table.column("target_ids").to_pylist(), table.column("loss_mask").to_pylist(),
                             strict=True):
            ids, mask = np.asarray(ids), np.asarray(mask, bool)
            counts += np.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    return counts


# -- the trainee: draft + what it needs of the target ---------------------------------------------


class Eagle3Trainee(nnx.Module):
    """The draft plus the frozen target pieces its loss needs: the whole target (online: features and
    logits are recomputed in the step) or only its LM head [V, D_t] (offline: logits = final @ headᵀ).
    Only `draft`'s nnx.Params are trained (TRAINABLE); the target's are constants of the step."""

    def __init__(self, draft: Eagle3Draft, target: nnx.Module, *, online: bool, steps: int, decay: float):
        self.draft = draft
        self.steps, self.decay = steps, decay
        self.online = online
        if online:
            self.target = target
            self.head = nnx.data(None)
        else:
            self.target = nnx.data(None)
            head = target.embed_tokens.weight[...] if target.lm_head is None else target.lm_head.weight().T
            self.head = param(jnp.asarray(head), ("vocab", "embed"), Buffer)  # [V, D_t]

    def target_outputs(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """(features [B, T, 3·D_t], target logits [B, T, V]) for the batch's packed rows."""
        if self.online:  # the traces stage's own feature function: online == offline up to storage rounding
            features, final = target_features(self.target, batch, self.draft.target_layers)
            logits = self.target.lm_logits(final)
        else:
            features = batch["aux"]
            logits = jnp.einsum("btd,vd->btv", batch["final"].astype(jnp.float32), self.head[...].astype(jnp.float32))
        return jax.lax.stop_gradient(features), jax.lax.stop_gradient(logits)

    def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        features, logits = self.target_outputs(batch)
        return ttt_loss(self.draft, batch, features, logits, steps=self.steps, decay=self.decay)


TRAINABLE = nnx.All(nnx.Param, nnx.PathContains("draft"))


def _loss_fn(trainee: Eagle3Trainee, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    return trainee.loss(batch)[0], jnp.float32(0.0)


def _eval_fn(trainee: Eagle3Trainee, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    return trainee.loss(batch)[0], batch["loss_mask"].astype(jnp.float32).sum()


def step_accuracy(trainee: Eagle3Trainee, loader: PackedBatches, batches: int) -> list[float]:
    """Per-TTT-step top-1 agreement with the target on held-out trace rows (conditional acceptance
    proxies; acc_k is not τ, docs/speculative-decoding.md)."""
    graphdef, state = nnx.split(trainee)

    @jax.jit
    def stats(state, batch):
        return nnx.merge(graphdef, state).loss(batch)[1]

    num = den = None
    for i in range(min(batches, math.ceil(loader.total / loader.batch_size))):
        s = stats(state, {c: jnp.asarray(x) for c, x in loader.batch(i).items()})
        n, d = np.asarray(s["acc_num"], np.float64), np.asarray(s["acc_den"], np.float64)
        num, den = (n, d) if num is None else (num + n, den + d)
    return [round(float(a / max(b, 1.0)), 4) for a, b in zip(num, den, strict=True)]


# -- the stage -------------------------------------------------------------------------------------


def build_draft(cfg: DraftConfig, target: nnx.Module, traces_dir: Path, aux_layer_ids: list[int],
                init_dir: Path | None) -> tuple[Eagle3Draft, dict[str, Any]]:
    """A fresh draft with the traces' vocabulary, or the warm-start draft (its weights and vocabulary)."""
    embed = target.embed_tokens.weight[...]
    if init_dir is not None:
        draft = load_eagle3(str(draft_dir(init_dir)), embed_tokens=embed)
        if list(draft.target_layers) != list(aux_layer_ids):
            raise ValueError(f"draft init: aux layers {list(draft.target_layers)} differ from the traces' "
                             f"{list(aux_layer_ids)}")
        return draft, {"warm_start": True}
    V = target.config.vocab_size
    overrides = {k: v for k, v in (("intermediate_size", cfg.intermediate_size),
                                   ("num_attention_heads", cfg.num_attention_heads),
                                   ("num_key_value_heads", cfg.num_key_value_heads)) if v is not None}
    config = Eagle3Config.for_target(target.config, draft_vocab_size=min(cfg.draft_vocab_size, V),
                                     aux_layer_ids=aux_layer_ids, **overrides)
    draft = Eagle3Draft(config, rngs=nnx.Rngs(cfg.seed))
    draft.load_embedding(embed)
    d2t, t2d, coverage = build_draft_vocab(token_counts(traces_dir, V), config.draft_vocab_size)
    draft.set_vocab(d2t, t2d)
    log.info("draft: vocabulary of %d of %d target tokens covers %.2f%% of the answer tokens",
             config.draft_vocab_size, V, 100 * coverage)
    return draft, {"warm_start": False, "draft_vocab_coverage": round(float(coverage), 5)}


def train_draft(cfg: DraftConfig, target_dir: Path, traces_dir: Path, out_dir: Path, *,
                progress: Progress | None = None, init_dir: Path | None = None,
                checkpoints: Checkpoints | None = None) -> dict[str, Any]:
    meta = json.loads((traces_dir / "traces.json").read_text())
    aux_ids, online = list(meta["aux_layer_ids"]), meta["hidden_states"] == "online"
    target = models.from_pretrained(str(target_dir))
    draft, info = build_draft(cfg, target, traces_dir, aux_ids, init_dir)
    trainee = Eagle3Trainee(draft, target, online=online, steps=cfg.ttt_steps, decay=cfg.ttt_decay)
    trainer = Trainer(trainee, cfg.train, trainable=TRAINABLE, loss_fn=_loss_fn, eval_fn=_eval_fn)
    n_params = sum(x.size for x in jax.tree.leaves(trainer.params))
    log.info("draft: EAGLE-3 head with %.2fM trainable parameters, %s target features from layers %s",
             n_params / 1e6, "online" if online else "offline", aux_ids)
    metrics = fit(trainer, traces_dir, checkpoints=checkpoints, progress=progress, label="draft",
                  logdir=out_dir / "tensorboard", loader=TraceBatches)
    trained = trainer.model(gather=True)  # step_accuracy and the exports read it whole on every host
    valid = TraceBatches(traces_dir, "valid", cfg.train.batch_size, shuffle=False)
    acc = step_accuracy(trained, valid, cfg.train.eval_batches)
    dest = out_dir / "draft"
    target_config = json.loads((target_dir / "config.json").read_text())
    dtype = cfg.export_dtype
    save_sglang(trained.draft, str(dest / "sglang"), target_config=target_config, dtype=dtype)
    save_speculators(trained.draft, str(dest / "speculators"), target_config=target_config,
                     verifier_name_or_path=target_config.get("_name_or_path") or "../../model",
                     num_speculative_tokens=cfg.k, dtype=dtype)
    summary = {
        "method": "eagle3", "num_speculative_tokens": cfg.k, "aux_layer_ids": aux_ids,
        "hidden_states": meta["hidden_states"], "draft_vocab_size": trained.draft.config.draft_vocab_size,
        "trainable_params": int(n_params), "ttt_steps": cfg.ttt_steps, "valid_step_accuracy": acc,
        "target_architecture": (target_config.get("architectures") or ["?"])[0],
        "target_num_hidden_layers": target_config["num_hidden_layers"], **info,
        "layouts": {"sglang": "sglang/ (LlamaForCausalLMEagle3)", "speculators": "speculators/ (Eagle3Speculator)"},
    }
    (dest / "draft_config.json").write_text(json.dumps(summary, indent=2))
    return {**metrics, **{k: v for k, v in summary.items() if k != "layouts"}}


def run(config: DraftConfig, inputs: Mapping[str, Path], output: Path, *, progress: Progress | None = None,
        context: StageContext | None = None) -> dict[str, Any]:
    """The stage: inputs `target` (finetune artifact or a model folder; `config.target` names the served
    variant), `traces`, optionally `init` (a previous draft to warm-start from)."""
    ckpt = Checkpoints.for_stage(context, config.train.keep_checkpoints) if context is not None else None
    try:
        return train_draft(config, model_dir(inputs["target"], config.target), inputs["traces"], output,
                           progress=progress, init_dir=inputs.get("init"), checkpoints=ckpt)
    finally:
        if ckpt is not None:
            ckpt.close()


def main(argv: list[str] | None = None) -> None:
    stage_main(__doc__, DraftConfig, {"--target": PATH, "--traces": PATH},
               lambda cfg, a: train_draft(cfg, model_dir(a.target), a.traces, a.out), argv)


if __name__ == "__main__":
    main()
