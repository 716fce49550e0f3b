"""Preference optimisation: DPO and the reference-free SimPO on chosen / rejected pairs.

- **DPO** (Rafailov et al. 2023, arXiv:2305.18290, eq. 7): with the policy's and the frozen reference's
  sequence log-probabilities of the chosen (w) and rejected (l) answers,

      h = (log π(y_w|x) - log π_ref(y_w|x)) - (log π(y_l|x) - log π_ref(y_l|x))
      L = -(1 - ε) log σ(β h) - ε log σ(-β h)

  (ε = `label_smoothing`: conservative DPO, Mitchell 2023; ε = 0 is the paper's loss). The implicit
  rewards are r_w = β (log π(y_w) - log π_ref(y_w)) and r_l likewise; their margin and the share of pairs
  with r_w > r_l ("reward accuracy") are TRL's `rewards/margins` and `rewards/accuracies`.
- **SimPO** (Meng et al. 2024, arXiv:2405.14734, eq. 6): no reference model; the reward is the
  length-normalised log-probability, and a target margin γ:

      h = β/|y_w| log π(y_w|x) - β/|y_l| log π(y_l|x) - γ,   L = -(1 - ε) log σ(h) - ε log σ(-h)

  Why SimPO as the reference-free variant (over ORPO): it needs neither a reference pass nor a stored
  reference, it is a drop-in loss on the same pairs (ORPO adds an SFT term whose weight interacts with
  the odds ratio), and its length normalisation keeps the policy from preferring longer answers, which
  plain sequence log-probabilities reward.

The reference log-probabilities (DPO) are computed once, before training, by the model training starts
from (for LoRA that is the base with its adapters off: LoRA's B factor starts at zero) and stored beside
the pairs as an artifact of the fine-tune (`reference/reference-<shard>.safetensors`: per-token
log-probabilities [R, T] of each side, float32), so a resumed run reads the same numbers and the train step
runs one forward (policy, both sides in one batch) instead of two.

Pairs are tasks/data/rows.py's `pairs-<split>-*.parquet` (data_prep on a chosen/rejected corpus).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx
from jax.experimental import multihost_utils

from tasks.data.rows import COLUMNS, SIDES, read_pairs
from tasks.training.data import PackedBatches
from tasks.training.losses import with_aux_losses

REF = "ref_logp"  # per-token reference log-probabilities of a side: `<side>_ref_logp` [R, T] float32


# -- data ------------------------------------------------------------------------------------------


def reference_file(reference_dir: Path, shard: Path) -> Path:
    return Path(reference_dir) / f"reference-{shard.stem}.safetensors"


class PairBatches(PackedBatches):
    """Deterministic batches of preference pairs (`pairs-<split>-*.parquet`): `chosen_*` and `rejected_*`
    columns [B, T], plus `<side>_ref_logp` [B, T] when `reference_dir` holds the reference's numbers."""

    def __init__(self, data_dir: Path, split: str, batch_size: int, seed: int = 0, shuffle: bool = True,
                 reference_dir: Path | None = None):
        self.reference_dir = reference_dir
        super().__init__(data_dir, f"pairs-{split}", batch_size, seed=seed, shuffle=shuffle)

    def _read(self, shard: int) -> dict[str, np.ndarray]:
        rows = read_pairs(self.files[shard])
        if self.reference_dir is not None:
            ref = safetensors.numpy.load_file(str(reference_file(self.reference_dir, self.files[shard])))
            rows.update({f"{side}_{REF}": ref[side] for side in SIDES})
        return rows

    @property
    def seq_len(self) -> int:
        return int(self._load(0)["chosen_input_ids"].shape[1])

    @property
    def tokens_per_batch(self) -> int:
        return 2 * self.batch_size * self.seq_len


def count_pairs(data_dir: Path, split: str) -> int:
    try:
        return PairBatches(data_dir, split, 1).total
    except ValueError:
        return 0


# -- log-probabilities -----------------------------------------------------------------------------


def token_logps(model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
    """log π(target | prefix) per position of a packed-rows batch, fp32 [B, T] (0 off the loss mask)."""
    logits = model(batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)  # [B, T, V]
    picked = jnp.take_along_axis(logp, batch["target_ids"][..., None], axis=-1)[..., 0]  # [B, T]
    return jnp.where(batch["loss_mask"] > 0, picked, 0.0)


def pair_token_logps(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Per-token log-probabilities of both sides, from one forward over [chosen; rejected] ([2B, T])."""
    B = batch["chosen_input_ids"].shape[0]
    both = {c: jnp.concatenate([batch[f"chosen_{c}"], batch[f"rejected_{c}"]]) for c in COLUMNS}
    logps = token_logps(model, both)  # [2B, T]
    return logps[:B], logps[B:]


# -- losses ----------------------------------------------------------------------------------------


def _smoothed(h: jax.Array, label_smoothing: float) -> jax.Array:
    """-(1 - ε) log σ(h) - ε log σ(-h), per pair."""
    return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(h) - label_smoothing * jax.nn.log_sigmoid(-h)


def dpo_loss(policy_chosen: jax.Array, policy_rejected: jax.Array, ref_chosen: jax.Array, ref_rejected: jax.Array,
             beta: float, label_smoothing: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-pair DPO loss [B] and its implicit rewards, from sequence log-probabilities [B]."""
    chosen_reward = beta * (policy_chosen - ref_chosen)  # [B]
    rejected_reward = beta * (policy_rejected - ref_rejected)
    loss = _smoothed(chosen_reward - rejected_reward, label_smoothing)
    return loss, {"reward_chosen": chosen_reward, "reward_rejected": rejected_reward}


def simpo_loss(policy_chosen: jax.Array, policy_rejected: jax.Array, len_chosen: jax.Array, len_rejected: jax.Array,
               beta: float, gamma: float, label_smoothing: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-pair SimPO loss [B] and its rewards (β x mean token log-probability), from sums and lengths [B]."""
    chosen_reward = beta * policy_chosen / jnp.maximum(len_chosen, 1.0)
    rejected_reward = beta * policy_rejected / jnp.maximum(len_rejected, 1.0)
    loss = _smoothed(chosen_reward - rejected_reward - gamma, label_smoothing)
    return loss, {"reward_chosen": chosen_reward, "reward_rejected": rejected_reward}


def pair_count(batch: dict[str, jax.Array]) -> jax.Array:
    """Pairs in a batch (a row whose chosen side has no loss position is padding): the step's normaliser."""
    return (batch["chosen_loss_mask"].sum(-1) > 0).astype(jnp.float32).sum()


def preference_objective(loss: str, beta: float, label_smoothing: float = 0.0,
                         gamma: float = 0.0) -> Callable[[nnx.Module, dict[str, jax.Array]], Any]:
    """The train step's objective: (model, batch) -> (loss summed over pairs, the MoE load-balancing loss
    (0 for a dense model), metric sums), for `tasks.training.trainer.Trainer(loss_fn=..., count_fn=pair_count)`."""

    def pairs(model: nnx.Module, batch: dict[str, jax.Array]):
        tok_c, tok_r = pair_token_logps(model, batch)  # [B, T] each
        valid = (batch["chosen_loss_mask"].sum(-1) > 0).astype(jnp.float32)  # [B]
        pc, pr = tok_c.sum(-1), tok_r.sum(-1)
        if loss == "dpo":
            rc = (batch[f"chosen_{REF}"] * batch["chosen_loss_mask"]).sum(-1)
            rr = (batch[f"rejected_{REF}"] * batch["rejected_loss_mask"]).sum(-1)
            per_pair, rewards = dpo_loss(pc, pr, rc, rr, beta, label_smoothing)
        else:
            lc = batch["chosen_loss_mask"].sum(-1).astype(jnp.float32)
            lr = batch["rejected_loss_mask"].sum(-1).astype(jnp.float32)
            per_pair, rewards = simpo_loss(pc, pr, lc, lr, beta, gamma, label_smoothing)
        margin = rewards["reward_chosen"] - rewards["reward_rejected"]
        metrics = {"reward_chosen": (rewards["reward_chosen"] * valid).sum(),
                   "reward_rejected": (rewards["reward_rejected"] * valid).sum(),
                   "reward_margin": (margin * valid).sum(),
                   "reward_accuracy": ((margin > 0) * valid).sum()}
        return (per_pair * valid).sum(), metrics

    def objective(model: nnx.Module, batch: dict[str, jax.Array]):
        # an MoE policy sows its load-balancing loss (a DSA one its indexer KL) in this forward, as in SFT
        # (losses.xent_sum_and_aux)
        (total, metrics), aux = with_aux_losses(pairs, model, batch)
        return total, aux, metrics

    return objective


def preference_eval(objective: Callable[..., Any]) -> Callable[[nnx.Module, dict[str, jax.Array]], Any]:
    """The Trainer's eval function for an objective: (loss summed over pairs, pairs)."""

    def eval_fn(model: nnx.Module, batch: dict[str, jax.Array]):
        total, _, _ = objective(model, batch)
        return total, pair_count(batch)

    return eval_fn


# -- the reference and held-out measurements --------------------------------------------------------


def _gather(x: jax.Array) -> np.ndarray:
    if jax.process_count() > 1 and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def write_reference(model: nnx.Module, data_dir: Path, out_dir: Path, put: Callable[[dict], dict],
                    batch_size: int) -> dict[str, Any]:
    """Per-token log-probabilities of both sides of every pair (train and valid) under `model`, one file per
    pairs shard under `out_dir`; `put` places a host batch on the training mesh. Every process computes its
    part and writes the whole (gathered) file into its own `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    step = nnx.jit(pair_token_logps)
    pairs = 0
    for split in ("train", "valid"):
        try:
            loader = PairBatches(data_dir, split, batch_size, shuffle=False)
        except ValueError:
            continue
        for path in loader.files:
            rows = read_pairs(path)
            R = len(rows["chosen_input_ids"])
            out = {side: np.zeros(rows["chosen_input_ids"].shape, np.float32) for side in SIDES}
            for lo in range(0, R, batch_size):
                chunk = {c: v[lo : lo + batch_size] for c, v in rows.items()}
                n = len(chunk["chosen_input_ids"])
                if n < batch_size:  # the last chunk padded to the compiled shape with copies of its first row
                    chunk = {c: np.concatenate([v, np.repeat(v[:1], batch_size - n, 0)]) for c, v in chunk.items()}
                c, r = step(model, put(chunk))
                out["chosen"][lo : lo + n] = _gather(c)[:n]
                out["rejected"][lo : lo + n] = _gather(r)[:n]
            # every process writes (it reads the file back through its own loader); write-then-rename keeps
            # processes sharing one folder from reading a half-written file
            dest = reference_file(out_dir, path)
            tmp = dest.with_name(f".{dest.name}.{jax.process_index()}.tmp")
            safetensors.numpy.save_file(out, str(tmp))
            os.replace(tmp, dest)
            pairs += R
    return {"pairs": pairs}


def sequence_logps(model: nnx.Module, batches: PairBatches, put: Callable[[dict], dict]) -> dict[str, np.ndarray]:
    """Over every pair of a split, in order: each side's sequence log-probability under `model` (`chosen`,
    `rejected` [P]), its answer length (`chosen_len`, `rejected_len`) and, when the loader has them, the
    stored reference's (`ref_chosen`, `ref_rejected`)."""
    step = nnx.jit(pair_token_logps)
    cols: dict[str, list[np.ndarray]] = {}
    for i in range(math.ceil(batches.total / batches.batch_size)):
        host = batches.batch(i)  # the last batch wraps around to the first rows: cut to the split's end
        n = min(batches.batch_size, batches.total - i * batches.batch_size)
        c, r = (_gather(x)[:n] for x in step(model, put(host)))
        mc, mr = host["chosen_loss_mask"][:n], host["rejected_loss_mask"][:n]
        got = {"chosen": c.sum(-1), "rejected": r.sum(-1), "chosen_len": mc.sum(-1), "rejected_len": mr.sum(-1)}
        if f"chosen_{REF}" in host:
            got["ref_chosen"] = (host[f"chosen_{REF}"][:n] * mc).sum(-1)
            got["ref_rejected"] = (host[f"rejected_{REF}"][:n] * mr).sum(-1)
        for k, v in got.items():
            cols.setdefault(k, []).append(np.asarray(v, np.float64))
    return {k: np.concatenate(v) for k, v in cols.items()}


def own_preference(lp: dict[str, np.ndarray]) -> dict[str, float]:
    """How often a model itself scores the chosen answer higher: by sequence log-probability
    (`preference_accuracy`) and by mean token log-probability (`preference_accuracy_normalized`)."""
    d = lp["chosen"] - lp["rejected"]
    dn = lp["chosen"] / np.maximum(lp["chosen_len"], 1) - lp["rejected"] / np.maximum(lp["rejected_len"], 1)
    return {"preference_accuracy": float((d > 0).mean()), "preference_accuracy_normalized": float((dn > 0).mean()),
            "logp_margin": float(d.mean())}


def implicit_reward(policy: dict[str, np.ndarray], reference: dict[str, np.ndarray]) -> dict[str, float]:
    """DPO's implicit reward of `policy` against `reference` (in log-ratio units, β = 1): the mean margin
    (log π/π_ref of chosen minus that of rejected) and the share of pairs where it is positive."""
    m = (policy["chosen"] - reference["chosen"]) - (policy["rejected"] - reference["rejected"])
    return {"reward_margin": float(m.mean()), "reward_accuracy": float((m > 0).mean())}


def preference_metrics(model: nnx.Module, batches: PairBatches, put: Callable[[dict], dict], *, loss: str,
                       beta: float, gamma: float = 0.0) -> dict[str, float]:
    """Held-out preference numbers over every pair of a split: reward margin and reward accuracy under the
    training loss's implicit reward (DPO: against the stored reference columns; SimPO: β x mean token
    log-probability), and the model's own preference (`own_preference`), which needs no reference and means
    the same before and after training."""
    lp = sequence_logps(model, batches, put)
    if loss == "dpo":
        reward = implicit_reward(lp, {"chosen": lp["ref_chosen"], "rejected": lp["ref_rejected"]})
        reward["reward_margin"] *= beta
    else:
        m = beta * (lp["chosen"] / np.maximum(lp["chosen_len"], 1) - lp["rejected"] / np.maximum(lp["rejected_len"], 1))
        reward = {"reward_margin": float(m.mean()), "reward_accuracy": float((m > 0).mean())}
    return {"pairs": int(len(lp["chosen"])), **reward, **own_preference(lp)}
