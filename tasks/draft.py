"""Stage `draft`: speculative-decoding drafts trained on the target's own traces, one per candidate.

    python -m tasks.draft --target DIR --traces DIR --out DIR [--set k=5 select_every=50 ...]

Mirrors docs/speculative-decoding.md (SpecForge / vLLM speculators practice). Every candidate in
`candidates` (a kind, a per-position objective, a serving temperature) is trained and exported:
- `eagle3` (models/eagle3/): one decoder layer over [embedding ; fc(three target layers)], trained with
  the training-time-test unroll of `ttt_steps` sequential steps;
- `peagle` (models/peagle/): the same layer plus a learned mask hidden state, trained on all `num_depths`
  parallel depths at once; drafts k tokens in one forward;
- `dflash` (models/dflash/): a block drafter whose `num_layers` layers attend to the target's fused
  features as context and predict a block of `block_size` - 1 tokens in one forward;
- `mtp` (models/mtp_finetune.py; DeepSeek-V3 / V3.2, GLM-4.5 / GLM-5 targets): the target's own MTP layers fine-tuned
  on its traces (FastMTP-style recursive steps), exported under the checkpoint's own tensor names;
all with the target's frozen embedding and a pruned vocabulary (the `draft_vocab_size` target tokens most
frequent in the traces' answers, shared by the candidates), through the shared training loop
(tasks/training/: mesh, checkpoints, NaN guard, metrics) with only the draft's parameters trainable.
The objective (models/draft_losses.py: forward KL by default; TV, the LK hybrid and others target the
acceptance rate itself) is computed at the candidate's serving temperature (default: the traces').
Target features come from the traces' stored hidden states (offline) or from the frozen target run
inside the same jitted step (`hidden_states: online`).

With `select_every` > 0 the draft is decoded through the real speculative engine (models/speculative.py)
on held-out trace prompts at the serving temperature every `select_every` steps, and the exported draft
is the checkpoint with the highest measured τ (acceptance peaks before the loss stops falling), recorded
in `draft_config.json`. `init` (the current draft, for a refresh) warm-starts the candidate of the same
kind and keeps its vocabulary.

Inputs: `target` (an HF checkpoint folder or a finetune artifact: the model the drafts will serve with,
possibly a quantized variant) and `traces` (tasks/traces.py output). Output `draft/`: `drafts.json`
(the candidates, in order) and per candidate `draft/<name>/` with `speculators/` (vLLM speculators
layout, every kind), `sglang/` (EAGLE-3 only) and `draft_config.json`; training curves under
`tensorboard/<name>/` (volatile, outside the digest, like every stage's).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
import safetensors.numpy
from flax import nnx

import models
from models.draft_format import draft_kind
from models.draft_losses import TargetHead
from models.drafts import kind_of, load_draft, save_draft, target_head
from models.eagle3 import build_draft_vocab
from models.layers import Buffer, param
from models.speculative import speculative_generate
from tasks.cli import stage_cli
from tasks.configs import DraftCandidate, DraftConfig
from tasks.data.features import load_hidden, target_features
from tasks.layout import DRAFTS_FILE, draft_candidates, model_dir
from tasks.stage import StageContext, write_report
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


def selection_prompts(traces_dir: Path, n: int, length: int) -> np.ndarray:
    """[n', length] held-out prompts for measuring τ: the first `length` tokens of the traces' valid
    sequences (prompt + the target's own answer), one equal-length batch; n' <= n."""
    out: list[np.ndarray] = []
    for f in sorted(traces_dir.glob("valid-*.parquet")):
        table = pq.read_table(f, columns=["input_ids", "segment_ids"])
        for ids, seg in zip(table.column("input_ids").to_pylist(), table.column("segment_ids").to_pylist(),
                            strict=True):
            ids, seg = np.asarray(ids), np.asarray(seg)
            for s in np.unique(seg[seg > 0]):
                where = np.flatnonzero(seg == s)
                if len(where) >= length:
                    out.append(ids[where[:length]])
                if len(out) == n:
                    return np.stack(out).astype(np.int32)
    if not out:
        raise ValueError(f"draft: select_every needs held-out sequences of at least select_prompt_len={length} "
                         f"tokens in {traces_dir} (valid-*.parquet); none found")
    return np.stack(out).astype(np.int32)


# -- how each kind trains: one entry per kind with a draft module (its files: models/drafts.py) -----


@dataclasses.dataclass(frozen=True)
class Fresh:
    """What building a fresh draft of a candidate needs: the target's config, the draft vocabulary size, the
    target layers the draft reads, the token that fills masked slots, the candidate and the stage config
    (`k`, size overrides), and the initialisation seed."""

    target_config: Any
    draft_vocab_size: int
    aux_layer_ids: list[int]
    mask_token_id: int
    candidate: Any  # tasks.configs.DraftCandidate
    stage: Any  # tasks.configs.DraftConfig
    overrides: dict[str, int]  # intermediate_size / num_attention_heads / num_key_value_heads, where set
    rngs: nnx.Rngs


def _eagle3_config(f: Fresh) -> Any:
    from models.eagle3 import Eagle3Config

    return Eagle3Config.for_target(f.target_config, draft_vocab_size=f.draft_vocab_size,
                                   aux_layer_ids=f.aux_layer_ids, **f.overrides)


def _eagle3_build(f: Fresh) -> nnx.Module:
    from models.eagle3 import Eagle3Draft

    return Eagle3Draft(_eagle3_config(f), rngs=f.rngs)


def _ttt_loss(trainee: Any, batch: dict[str, jax.Array], features: jax.Array, logits: TargetHead, *, steps: int,
              decay: float, unroll: Callable | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    from models.eagle3 import ttt_loss
    from models.eagle3.loss import ttt_unroll

    return ttt_loss(trainee.draft, batch, features, logits, steps=steps, decay=decay, objective=trainee.objective,
                    temperature=trainee.temperature, unroll=unroll or ttt_unroll)


def _peagle_build(f: Fresh) -> nnx.Module:
    from models.peagle import PEagleConfig, PEagleDraft

    return PEagleDraft(PEagleConfig.from_eagle3(_eagle3_config(f), mask_token_id=f.mask_token_id,
                                                num_depths=f.candidate.num_depths or f.stage.k), rngs=f.rngs)


def _peagle_loss(trainee: Any, batch: dict[str, jax.Array], features: jax.Array, logits: TargetHead, *, steps: int,
                 decay: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    from models.peagle import parallel_unroll

    return _ttt_loss(trainee, batch, features, logits, steps=steps, decay=decay, unroll=parallel_unroll)


def _dflash_build(f: Fresh) -> nnx.Module:
    from models.dflash import DFlashConfig, DFlashDraft

    config = DFlashConfig.for_target(f.target_config, draft_vocab_size=f.draft_vocab_size,
                                     aux_layer_ids=f.aux_layer_ids, num_layers=f.candidate.num_layers,
                                     block_size=f.candidate.block_size or f.stage.k + 1,
                                     mask_token_id=f.mask_token_id, **f.overrides)
    return DFlashDraft(config, rngs=f.rngs)


def _dflash_loss(trainee: Any, batch: dict[str, jax.Array], features: jax.Array, logits: TargetHead, *, steps: int,
                 decay: float) -> tuple[jax.Array, dict[str, jax.Array]]:
    from models.dflash import block_loss

    return block_loss(trainee.draft, batch, features, logits, num_anchors=trainee.num_anchors,
                      objective=trainee.objective, temperature=trainee.temperature, gamma=trainee.gamma,
                      rng=trainee.rngs.anchors())


@dataclasses.dataclass(frozen=True)
class DraftTraining:
    """How the draft stage trains a kind: `build(fresh)` a fresh draft module, `steps(draft, cfg)` the draft
    positions a training row unrolls, `loss(trainee, batch, features, logits, steps=, decay=)` one batch's
    (loss, stats)."""

    build: Callable[[Fresh], nnx.Module]
    steps: Callable[[nnx.Module, DraftConfig], int]
    loss: Callable[..., tuple[jax.Array, dict[str, jax.Array]]]


TRAINING: dict[str, DraftTraining] = {
    "eagle3": DraftTraining(_eagle3_build, lambda draft, cfg: cfg.ttt_steps, _ttt_loss),
    "peagle": DraftTraining(_peagle_build, lambda draft, cfg: draft.max_block, _peagle_loss),
    "dflash": DraftTraining(_dflash_build, lambda draft, cfg: cfg.k, _dflash_loss),
}


# -- the trainee: draft + what it needs of the target ---------------------------------------------


class DraftTrainee(nnx.Module):
    """The draft plus the frozen target pieces its loss needs: the whole target (online: features and
    logits are recomputed in the step) or only its LM head [V, D_t] (offline: logits = final @ headᵀ).
    Only `draft`'s nnx.Params are trained (TRAINABLE); the target's are constants of the step."""

    def __init__(self, draft: nnx.Module, target: nnx.Module, *, online: bool, steps: int, decay: float,
                 objective: str | tuple[tuple[str, float], ...], temperature: float, num_anchors: int = 0,
                 gamma: float = 4.0, seed: int = 0):
        self.draft = draft
        self.kind = kind_of(draft)
        self.steps, self.decay = steps, decay
        self.objective, self.temperature = objective, temperature
        self.num_anchors, self.gamma = num_anchors, gamma
        self.online = online
        self.rngs = nnx.Rngs(anchors=seed)  # DFlash's random block anchors, threaded through the train state
        if online:
            self.target = target
            self.head = nnx.data(None)
        else:
            self.target = nnx.data(None)
            self.head = param(jnp.asarray(target_head(target)), ("vocab", "embed"), Buffer)  # [V, D_t]

    def target_outputs(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, TargetHead]:
        """(features [B, T, 3·D_t], the target's logits [B, T, V] as final hidden [B, T, D_t] @ head.T) for the
        batch's packed rows: the losses read them at the draft vocabulary's columns only (`restricted_targets`)."""
        if self.online:  # the traces stage's own feature function: online == offline up to storage rounding
            features, final = target_features(self.target, batch, self.draft.target_layers)
            head = target_head(self.target)  # [V, D_t]: lm_logits(x) == x @ head.T (tied or not)
        else:
            features, final, head = batch["aux"], batch["final"], self.head[...]
        return jax.lax.stop_gradient(features), TargetHead(jax.lax.stop_gradient(final), jax.lax.stop_gradient(head))

    def loss(self, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        features, logits = self.target_outputs(batch)
        return TRAINING[self.kind].loss(self, batch, features, logits, steps=self.steps, decay=self.decay)


TRAINABLE = nnx.All(nnx.Param, nnx.PathContains("draft"))


def _loss_fn(trainee: DraftTrainee, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    return trainee.loss(batch)[0], jnp.float32(0.0)


def _eval_fn(trainee: DraftTrainee, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    return trainee.loss(batch)[0], batch["loss_mask"].astype(jnp.float32).sum()


def step_accuracy(trainee: DraftTrainee, loader: PackedBatches, batches: int) -> list[float]:
    """Per-step (EAGLE-3 TTT step, P-EAGLE depth, DFlash block slot) top-1 agreement with the target on
    held-out trace rows (conditional acceptance proxies; acc_k is not τ, docs/speculative-decoding.md)."""
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


# -- building a candidate --------------------------------------------------------------------------


def build_draft(cand: DraftCandidate, cfg: DraftConfig, target: nnx.Module, aux_layer_ids: list[int],
                vocab: tuple[np.ndarray, np.ndarray, float], init: Path | None) -> tuple[nnx.Module, dict[str, Any]]:
    """A fresh draft of the candidate's kind with the traces' vocabulary, or the warm-start draft (its
    weights and its vocabulary) when `init` holds one of the same kind."""
    embed = target.embed_tokens.weight[...]
    if init is not None:
        draft = load_draft(init, embed, target_head(target))
        if list(draft.target_layers) != list(aux_layer_ids):
            raise ValueError(f"draft init: aux layers {list(draft.target_layers)} differ from the traces' "
                             f"{list(aux_layer_ids)}")
        return draft, {"warm_start": True}
    V = target.config.vocab_size
    overrides = {k: v for k, v in (("intermediate_size", cfg.intermediate_size),
                                   ("num_attention_heads", cfg.num_attention_heads),
                                   ("num_key_value_heads", cfg.num_key_value_heads)) if v is not None}
    Vd = min(cfg.draft_vocab_size, V)
    rngs = nnx.Rngs(cfg.seed)
    mask_token = getattr(target.config, "pad_token_id", None)
    mask_token = V - 1 if mask_token is None else int(mask_token)
    draft = TRAINING[cand.kind].build(Fresh(target.config, Vd, aux_layer_ids, mask_token, cand, cfg, overrides,
                                               rngs))
    draft.load_embedding(embed)
    d2t, t2d, coverage = vocab
    draft.set_vocab(d2t, t2d)
    if draft_kind(cand.kind).uses_target_head:  # DFlash: the target's own head rows (frozen, as speculators does)
        draft.load_lm_head(target_head(target))
    return draft, {"warm_start": False, "draft_vocab_coverage": round(float(coverage), 5)}


class Selection:
    """Checkpoint selection by measured τ: `__call__(step)` decodes the held-out prompts with the current
    draft through `speculative_generate` (batched, k tokens, the serving temperature) every `every` steps
    and at the last one, and keeps a host copy of the trainable parameters of the best τ so far.
    `target` verifies (None: the trained model itself, an MTP fine-tune); `draft_of(trained model)` is the
    draft (default: the trainee's `.draft`)."""

    def __init__(self, trainer: Trainer, target: nnx.Module | None, prompts: np.ndarray, *, every: int, k: int,
                 temperature: float, max_new_tokens: int, eos: Any, seed: int,
                 draft_of: Any = lambda trained: trained.draft):
        self.trainer, self.target, self.prompts = trainer, target, jnp.asarray(prompts)
        self.draft_of = draft_of
        self.every, self.k, self.temperature = every, k, temperature
        self.max_new_tokens, self.eos, self.seed = max_new_tokens, eos, seed
        self.history: list[list[float]] = []  # [step, τ]
        self.best: tuple[float, int, Any] | None = None  # (τ, step, params on the host)
        self.seconds = 0.0

    def measure(self) -> float:
        trained = self.trainer.model(gather=True)
        target = trained if self.target is None else self.target
        out = speculative_generate(target, self.draft_of(trained), self.prompts, max_new_tokens=self.max_new_tokens,
                                   k=self.k, temperature=self.temperature, rng=jax.random.PRNGKey(self.seed),
                                   eos_token_id=self.eos)
        return out.mean_acceptance_length

    def __call__(self, step: int) -> None:
        if step % self.every and step != self.trainer.cfg.steps:
            return
        t0 = time.perf_counter()
        tau = self.measure()
        self.history.append([step, round(tau, 4)])
        if self.best is None or tau > self.best[0]:
            self.best = (tau, step, jax.device_get(self.trainer.params))
        self.seconds += time.perf_counter() - t0
        log.info("draft: held-out τ %.3f at step %d (best %.3f at step %d)", tau, step, self.best[0], self.best[1])

    def restore_best(self) -> dict[str, Any]:
        """Put the best checkpoint's parameters back into the trainer; the record for draft_config.json.
        A run resumed from its last checkpoint trained no step here: the final weights are measured now."""
        if self.best is None:
            self(self.trainer.cfg.steps)
        tau, step, params = self.best
        self.trainer.params = jax.device_put(params, self.trainer.param_sh)
        return {"selected_step": step, "selected_acceptance_length": round(tau, 4), "acceptance_history": self.history,
                "selection_seconds": round(self.seconds, 1)}


# -- the stage -------------------------------------------------------------------------------------


def train_candidate(cand: DraftCandidate, cfg: DraftConfig, target: nnx.Module, target_dir: Path, traces_dir: Path,
                    meta: dict[str, Any], vocab: tuple[np.ndarray, np.ndarray, float], dest: Path, *,
                    progress: Progress | None, init: Path | None, checkpoints: Checkpoints | None) -> dict[str, Any]:
    aux_ids, online = list(meta["aux_layer_ids"]), meta["hidden_states"] == "online"
    draft, info = build_draft(cand, cfg, target, aux_ids, vocab, init)
    kind = kind_of(draft)
    temperature = float(meta.get("temperature", 0.0)) if cand.temperature is None else cand.temperature
    objective = cand.loss if isinstance(cand.loss, str) else tuple(sorted(cand.loss.items()))
    steps = TRAINING[kind].steps(draft, cfg)
    decay = 1.0 if draft_kind(kind).equal_step_weights else cfg.ttt_decay
    trainee = DraftTrainee(draft, target, online=online, steps=steps, decay=decay, objective=objective,
                           temperature=temperature, num_anchors=cand.num_anchors, gamma=cand.gamma, seed=cfg.seed)
    trainer = Trainer(trainee, cfg.train_for(cand), trainable=TRAINABLE, loss_fn=_loss_fn, eval_fn=_eval_fn)
    n_params = sum(x.size for x in jax.tree.leaves(trainer.params))
    log.info("draft[%s]: %s with %.2fM trainable parameters, objective %s at T=%g, %s features from layers %s",
             cand.label, kind, n_params / 1e6, cand.loss, temperature, "online" if online else "offline", aux_ids)
    select = None
    if cfg.select_every:
        eos = json.loads((target_dir / "config.json").read_text()).get("eos_token_id")
        select = Selection(trainer, target, selection_prompts(traces_dir, cfg.select_prompts, cfg.select_prompt_len),
                           every=cfg.select_every, k=cfg.k, temperature=temperature,
                           max_new_tokens=cfg.select_max_new_tokens, eos=eos, seed=cfg.seed)
    t0 = time.perf_counter()
    metrics = fit(trainer, traces_dir, checkpoints=checkpoints, progress=progress, label=f"draft[{cand.label}]",
                  logdir=dest.parent.parent / "tensorboard" / cand.label, loader=TraceBatches, on_step=select)
    train_seconds = time.perf_counter() - t0 - (select.seconds if select else 0.0)
    chosen = select.restore_best() if select is not None else {}
    trained = trainer.model(gather=True)  # step_accuracy and the exports read it whole on every host
    valid = TraceBatches(traces_dir, "valid", cfg.train.batch_size, shuffle=False)
    acc = step_accuracy(trained, valid, cfg.train.eval_batches)
    target_config = json.loads((target_dir / "config.json").read_text())
    layouts = save_draft(trained.draft, dest, target_config=target_config,
                         verifier_name_or_path=target_config.get("_name_or_path") or "../../model",
                         num_speculative_tokens=cfg.k, dtype=cfg.export_dtype)
    summary = {
        "name": cand.label, "method": kind, "candidate": cand.model_dump(mode="json"),
        "num_speculative_tokens": cfg.k, "aux_layer_ids": aux_ids,
        "objective": cand.loss, "train_temperature": temperature, "hidden_states": meta["hidden_states"],
        "draft_vocab_size": trained.draft.config.draft_vocab_size, "trainable_params": int(n_params),
        "train_steps_per_unroll": steps, "valid_step_accuracy": acc, "train_seconds": round(train_seconds, 1),
        "target_architecture": (target_config.get("architectures") or ["?"])[0],
        "target_num_hidden_layers": target_config["num_hidden_layers"], **info, **chosen, "layouts": layouts,
    }
    write_report(dest / "draft_config.json", summary)  # training / selection seconds go to timing.json
    return {**metrics, **{k: v for k, v in summary.items() if k != "layouts"}}


def train_mtp(cand: DraftCandidate, cfg: DraftConfig, target_dir: Path, traces_dir: Path, meta: dict[str, Any],
              dest: Path, *, progress: Progress | None, init: Path | None,
              checkpoints: Checkpoints | None) -> dict[str, Any]:
    """Fine-tune the target's own MTP layers on its traces (models/mtp_finetune.py, FastMTP-style: the MTP
    layer applied recursively for `num_depths` steps, soft labels from the frozen target, step weights
    ∝ beta^k), with the main stack frozen; export the layers under the checkpoint's own names (`mtp/`)."""
    from models.mtp_finetune import (
        load_mtp_state,
        mtp_loss,
        mtp_loss_fn,
        mtp_state_dict,
        mtp_trainable,
        target_final_hidden,
    )
    from models.speculative import MTPDraft

    model = models.from_pretrained(str(target_dir))  # its own copy: the Trainer adopts and shards it
    target_config = json.loads((target_dir / "config.json").read_text())
    if not getattr(model, "num_mtp_layers", 0):
        arch = (target_config.get("architectures") or ["?"])[0]
        raise ValueError(f"draft.candidates[{cand.label}]: kind mtp fine-tunes the target's own MTP layers, and the "
                         f"{arch} at {target_dir} has none (DeepSeek-V3 / V3.2, GLM-4.5 / GLM-5 checkpoints that hold "
                         "them; DeepSeek-V4's published MTP layer is not built)")
    if init is not None:  # a refresh: continue from the current fine-tuned head
        load_mtp_state(model, safetensors.numpy.load_file(str(init / "mtp" / "model.safetensors")))
    temperature = float(meta.get("temperature", 0.0)) if cand.temperature is None else cand.temperature
    objective = cand.loss if isinstance(cand.loss, str) else tuple(sorted(cand.loss.items()))
    steps = cand.num_depths or cfg.k
    loss_fn = mtp_loss_fn(steps=steps, step_weight_beta=cand.step_weight_beta, objective=objective,
                          temperature=temperature)

    def eval_fn(m: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
        return loss_fn(m, batch)[0], batch["loss_mask"].astype(jnp.float32).sum()

    trainer = Trainer(model, cfg.train_for(cand), trainable=mtp_trainable(model), loss_fn=loss_fn, eval_fn=eval_fn)
    n_params = sum(x.size for x in jax.tree.leaves(trainer.params))
    log.info("draft[%s]: fine-tuning the target's %d MTP layer(s), %.2fM trainable parameters, %d steps, "
             "objective %s at T=%g", cand.label, model.num_mtp_layers, n_params / 1e6, steps, cand.loss, temperature)
    select = None
    if cfg.select_every:
        select = Selection(trainer, None, selection_prompts(traces_dir, cfg.select_prompts, cfg.select_prompt_len),
                           every=cfg.select_every, k=cfg.k, temperature=temperature,
                           max_new_tokens=cfg.select_max_new_tokens, eos=target_config.get("eos_token_id"),
                           seed=cfg.seed, draft_of=MTPDraft)
    t0 = time.perf_counter()
    metrics = fit(trainer, traces_dir, checkpoints=checkpoints, progress=progress, label=f"draft[{cand.label}]",
                  logdir=dest.parent.parent / "tensorboard" / cand.label, loader=TraceBatches, on_step=select)
    train_seconds = time.perf_counter() - t0 - (select.seconds if select else 0.0)
    chosen = select.restore_best() if select is not None else {}
    trained = trainer.model(gather=True)
    graphdef, state = nnx.split(trained)

    @jax.jit
    def stats(state, batch):
        m = nnx.merge(graphdef, state)
        final = target_final_hidden(m, batch)
        return mtp_loss(m, batch, final_hidden=final, target_logits=m.lm_logits(final), steps=steps,
                        step_weight_beta=cand.step_weight_beta, objective=objective, temperature=temperature)[1]

    valid = TraceBatches(traces_dir, "valid", cfg.train.batch_size, shuffle=False)
    num = den = 0.0
    for i in range(min(cfg.train.eval_batches, math.ceil(valid.total / valid.batch_size))):
        s = stats(state, {c: jnp.asarray(x) for c, x in valid.batch(i).items()})
        num, den = num + np.asarray(s["acc_num"], np.float64), den + np.asarray(s["acc_den"], np.float64)
    acc = [round(float(a / max(b, 1.0)), 4) for a, b in zip(np.atleast_1d(num), np.atleast_1d(den), strict=True)]
    (dest / "mtp").mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file(mtp_state_dict(trained, cfg.export_dtype, include_shared=False),
                                str(dest / "mtp" / "model.safetensors"), metadata={"format": "pt"})
    (dest / "mtp" / "config.json").write_text(json.dumps(target_config, indent=2))
    summary = {
        "name": cand.label, "method": "mtp", "candidate": cand.model_dump(mode="json"),
        "num_speculative_tokens": cfg.k, "objective": cand.loss, "train_temperature": temperature,
        "hidden_states": meta["hidden_states"], "trainable_params": int(n_params), "train_steps_per_unroll": steps,
        "valid_step_accuracy": acc, "train_seconds": round(train_seconds, 1),
        "target_architecture": (target_config.get("architectures") or ["?"])[0],
        "target_num_hidden_layers": target_config["num_hidden_layers"], "warm_start": init is not None, **chosen,
        "layouts": {"mtp": "mtp/ (the target's MTP layers, model.layers.{L+m}.* as in its checkpoint)"},
    }
    write_report(dest / "draft_config.json", summary)
    return {**metrics, **{k: v for k, v in summary.items() if k != "layouts"}}


def train_draft(cfg: DraftConfig, target_dir: Path, traces_dir: Path, out_dir: Path, *,
                progress: Progress | None = None, init_dir: Path | None = None,
                context: StageContext | None = None) -> dict[str, Any]:
    """Train and export every candidate; returns the first candidate's metrics at the top level (the
    stage's headline) and every candidate's under `candidates`."""
    meta = json.loads((traces_dir / "traces.json").read_text())
    target = models.from_pretrained(str(target_dir))
    V = target.config.vocab_size
    vocab = build_draft_vocab(token_counts(traces_dir, V), min(cfg.draft_vocab_size, V))
    log.info("draft: vocabulary of %d of %d target tokens covers %.2f%% of the answer tokens",
             len(vocab[0]), V, 100 * vocab[2])
    inits = {}
    if init_dir is not None:  # warm starts: the current draft(s) by kind
        from models.drafts import folder_kind
        inits = {folder_kind(f): f for f in draft_candidates(init_dir).values()}
    results: dict[str, dict[str, Any]] = {}
    for cand in cfg.candidates:
        ckpt = (Checkpoints.for_stage(context, cfg.train.keep_checkpoints, sub=cand.label)
                if context is not None else None)
        try:
            dest = out_dir / "draft" / cand.label
            if draft_kind(cand.kind).trains_target:  # MTP: the target's own layers
                results[cand.label] = train_mtp(cand, cfg, target_dir, traces_dir, meta, dest, progress=progress,
                                                init=inits.get("mtp"), checkpoints=ckpt)
            else:
                results[cand.label] = train_candidate(cand, cfg, target, target_dir, traces_dir, meta, vocab, dest,
                                                      progress=progress, init=inits.get(cand.kind), checkpoints=ckpt)
        finally:
            if ckpt is not None:
                ckpt.close()
    (out_dir / "draft" / DRAFTS_FILE).write_text(json.dumps({"candidates": list(results)}, indent=2))
    first = next(iter(results.values()))
    return {**first, "candidates": {name: {k: r[k] for k in ("method", "objective", "valid_step_accuracy",
                                                             "valid_loss_after", "trainable_params", "train_seconds")
                                           if k in r} for name, r in results.items()}}


def run(config: DraftConfig, inputs: Mapping[str, Path], output: Path, *, progress: Progress | None = None,
        context: StageContext | None = None) -> dict[str, Any]:
    """The stage: inputs `target` (finetune artifact or a model folder; `config.target` names the served
    variant), `traces`, optionally `init` (a previous draft to warm-start from)."""
    return train_draft(config, model_dir(inputs["target"], config.target), inputs["traces"], output,
                       progress=progress, init_dir=inputs.get("init"), context=context)


main = stage_cli(__name__)  # `python -m tasks.draft`: the command line its declaration implies (tasks/cli.py)


if __name__ == "__main__":
    main()
