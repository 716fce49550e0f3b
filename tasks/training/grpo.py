"""GRPO's objective: group-relative advantages and the clipped policy-ratio loss with a KL penalty to the
reference, on sampled completions scored by checkers (tasks/checkers/).

Shao et al. 2024 (DeepSeekMath, arXiv:2402.03300, eq. 3 and 4), as DeepSeek-R1 (arXiv:2501.12948) trains:
for each prompt q, a group of G completions o_1..o_G sampled from the old policy, rewards r_i, and

    A_i = (r_i - mean(r)) / (std(r) + eps)                                    (outcome supervision)
    ρ_{i,t} = π(o_{i,t} | q, o_{i,<t}) / π_old(o_{i,t} | q, o_{i,<t})
    J = 1/G Σ_i 1/|o_i| Σ_t [ min(ρ A_i, clip(ρ, 1 - ε, 1 + ε) A_i) - β D_KL(π || π_ref)_{i,t} ]
    D_KL_{i,t} = π_ref/π - log(π_ref/π) - 1                                   (Schulman's k3 estimator)

and the loss is -J. Options a user of TRL's GRPOTrainer would expect: `scale_rewards=False` drops the
division by the group's std (Dr. GRPO, Liu et al. 2025, arXiv:2503.20783: the std reweights easy and hard
prompts); `loss_agg="token"` averages over every completion token of the batch instead of per completion
first (DAPO, Yu et al. 2025, arXiv:2503.14476: long completions are not down-weighted). Shapes: P prompts,
G completions each, N = P·G rows, T positions.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import pyarrow.parquet as pq
from flax import nnx

from models.generate import generate
from tasks.checkers.registry import score_all
from tasks.data.rows import prompts_from_rows
from tasks.training.config import TrainingDiverged
from tasks.training.losses import with_aux_losses
from tasks.training.tensorboard import TensorBoardWriter

log = logging.getLogger("forgeline.grpo")

LossAgg = Literal["sequence", "token"]


def group_advantages(rewards: jax.Array, *, scale: bool = True, eps: float = 1e-4) -> jax.Array:
    """rewards [P, G] -> advantages [P, G]: each reward minus its group's mean, divided by the group's
    (population) std + eps when `scale`. A group whose rewards are all equal gets 0: nothing to learn."""
    centred = rewards - rewards.mean(axis=-1, keepdims=True)
    return centred / (rewards.std(axis=-1, keepdims=True) + eps) if scale else centred


def informative_groups(rewards: np.ndarray, keep: int) -> np.ndarray:
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476, section 3.2): of sampled groups' rewards
    [Q, G], the indices of `keep` groups, those whose rewards differ first (a group whose rewards are all equal
    has zero advantages: it adds no gradient, only rows), each part in sampled order; all-equal groups fill
    what is left, so the batch keeps its shape (DAPO samples again instead)."""
    differ = rewards.std(axis=-1) > 0
    return np.concatenate([np.flatnonzero(differ), np.flatnonzero(~differ)])[:keep]


def k3(new_logp: jax.Array, ref_logp: jax.Array) -> jax.Array:
    """Schulman's k3 estimate of KL(π ‖ π_ref) per sampled token [N, T] (unbiased and >= 0 on tokens drawn
    from π): π_ref/π - log(π_ref/π) - 1."""
    d = ref_logp - new_logp
    return jnp.exp(d) - d - 1.0


def grpo_sums(new_logp: jax.Array, old_logp: jax.Array, ref_logp: jax.Array | None, advantages: jax.Array,
              mask: jax.Array, *, clip_eps: float = 0.2, beta: float = 0.04,
              loss_agg: LossAgg = "sequence") -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(the loss summed over the aggregation's units, their count, metric sums over completion tokens and that
    token count): `grpo_loss` is the first over the second. Summed so that the Trainer can split a batch into
    micro-batches and divide once. Units: completions (`sequence`: each completion's token mean) or tokens."""
    mask = mask.astype(jnp.float32)
    ratio = jnp.exp(new_logp - old_logp)  # [N, T]
    adv = advantages[:, None] if advantages.ndim == 1 else advantages  # [N, 1] or per token [N, T]
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    kl = k3(new_logp, ref_logp) if ref_logp is not None and beta > 0 else jnp.zeros_like(new_logp)  # [N, T]
    per_token = surrogate - beta * kl
    tokens = mask.sum(-1)  # [N]
    if loss_agg == "sequence":
        has = (tokens > 0).astype(jnp.float32)
        total, count = -((per_token * mask).sum(-1) / jnp.maximum(tokens, 1.0) * has).sum(), has.sum()
    else:
        total, count = -(per_token * mask).sum(), mask.sum()
    clipped = ((adv > 0) & (ratio > 1 + clip_eps)) | ((adv < 0) & (ratio < 1 - clip_eps))
    metrics = {"kl": (kl * mask).sum(), "clip_fraction": (clipped * mask).sum(), "ratio": (ratio * mask).sum(),
               "tokens": mask.sum()}
    return total, count, metrics


def grpo_loss(new_logp: jax.Array, old_logp: jax.Array, ref_logp: jax.Array | None, advantages: jax.Array,
              mask: jax.Array, *, clip_eps: float = 0.2, beta: float = 0.04,
              loss_agg: LossAgg = "sequence") -> tuple[jax.Array, dict[str, jax.Array]]:
    """The batch's loss (-J, a scalar) and its metrics.

    new_logp, old_logp, ref_logp: log-probabilities of the sampled tokens [N, T] under the policy being
    trained, the policy that sampled them, and the reference (None: β = 0, no KL term); advantages [N] (one per
    completion; or [N, T], the same along each row); mask [N, T]: 1 on completion tokens. Metrics: `kl` (mean k3
    estimate per token), `clip_fraction` (tokens whose ratio left [1 - ε, 1 + ε] in the direction the clip
    binds), `ratio` (mean ρ)."""
    total, count, m = grpo_sums(new_logp, old_logp, ref_logp, advantages, mask, clip_eps=clip_eps, beta=beta,
                                loss_agg=loss_agg)
    n = jnp.maximum(m["tokens"], 1.0)
    return total / jnp.maximum(count, 1.0), {k: m[k] / n for k in ("kl", "clip_fraction", "ratio")}


def sampled_logps(logits: jax.Array, tokens: jax.Array, temperature: float = 1.0) -> jax.Array:
    """log-probabilities [N, T] of `tokens` [N, T] under `logits` [N, T, V] at the sampling temperature (the
    distribution the completions were drawn from, so the ratio compares like with like)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


# -- the completion window ----------------------------------------------------------------------------------
#
# Only a completion's tokens carry loss, so the LM head (and its softmax over the vocabulary) runs on a window
# of W = max_new_tokens positions per row, from the row's first completion target on, instead of on all T
# (verl likewise takes log-probabilities of the response slice only). With short completions after longer
# prompts this is most of the head's work: tiny-grpo's rows are ~18 positions of which <= 8 are completion.


def completion_window(batch: dict[str, jax.Array], width: int) -> tuple[jax.Array, jax.Array]:
    """(positions [N, W] of each row's completion targets, `completion_start` + 0..W-1 clipped to the row, and
    the loss mask at them [N, W], zero where clipping repeated a position)."""
    T = batch["input_ids"].shape[1]
    pos = batch["completion_start"][:, :1] + jnp.arange(width)[None, :]  # [N, W]
    idx = jnp.minimum(pos, T - 1)
    mask = jnp.take_along_axis(batch["loss_mask"], idx, axis=1) * (pos < T)
    return idx, mask


def completion_logps(model: nnx.Module, batch: dict[str, jax.Array], idx: jax.Array,
                     temperature: float) -> jax.Array:
    """log-probabilities [N, W] of the target tokens at positions `idx` [N, W], the LM head applied there only
    (the decoder's own [N, T, V] logits are unused, so the compiled program never computes them)."""
    _, (h,) = model(batch["input_ids"], positions=batch["positions"], segment_ids=batch["segment_ids"],
                    return_hidden=(-1,))  # h: the final normed hidden [N, T, D]
    h = jnp.take_along_axis(h, idx[..., None], axis=1)  # [N, W, D]
    return sampled_logps(model.lm_logits(h), jnp.take_along_axis(batch["target_ids"], idx, axis=1), temperature)


# -- the objective on the Trainer ---------------------------------------------------------------------------


def grpo_objective(*, clip_eps: float, beta: float, loss_agg: LossAgg, temperature: float, width: int):
    """The Trainer's objective on a rollout batch (`rollout_batch`): (loss sum, the MoE balance loss, metric
    sums); pair it with `count_fn=grpo_count(loss_agg)`. `width`: the completion window (max_new_tokens);
    `old_logp` and `ref_logp` columns are [N, width] (`completion_logps`). Without an `old_logp` column the
    sampling policy is the current one (one update per rollout, as TRL's default): ρ = 1 in value, its gradient
    the policy gradient."""

    def inner(model: nnx.Module, batch: dict[str, jax.Array]):
        idx, mask = completion_window(batch, width)  # [N, W] each
        new = completion_logps(model, batch, idx, temperature)  # [N, W]
        old = batch["old_logp"] if "old_logp" in batch else jax.lax.stop_gradient(new)
        adv = jnp.take_along_axis(batch["advantage"], idx, axis=1)
        total, _, m = grpo_sums(new, old, batch.get("ref_logp"), adv, mask, clip_eps=clip_eps, beta=beta,
                                loss_agg=loss_agg)
        return total, m

    def objective(model: nnx.Module, batch: dict[str, jax.Array]):
        (total, m), aux = with_aux_losses(inner, model, batch)
        # metrics are divided by the step's count like the loss: report them per completion token instead
        return total, aux, {k: m[k] for k in ("kl", "clip_fraction", "ratio", "tokens")}

    return objective


def grpo_count(loss_agg: LossAgg):
    """The Trainer's normaliser: completions with a token to train on, or completion tokens."""

    def count(batch: dict[str, jax.Array]) -> jax.Array:
        mask = batch["loss_mask"].astype(jnp.float32)
        return (mask.sum(-1) > 0).astype(jnp.float32).sum() if loss_agg == "sequence" else mask.sum()

    return count


# -- prompts and rollouts -----------------------------------------------------------------------------------


@dataclass
class PromptSet:
    """Prompts as token ids (bos + prompt, what generation continues) and as text (what checkers read)."""

    ids: list[np.ndarray]
    text: list[str]

    def __len__(self) -> int:
        return len(self.ids)


def train_prompts(data_dir: Path, decode: Callable[[list[int]], str], bos: int) -> PromptSet:
    """The prompts of the data's train split, read back from its packed rows (tasks/data/rows.py
    `prompts_from_rows`: each document's tokens up to its first loss position)."""
    ids = prompts_from_rows(data_dir, "train", sys.maxsize, bos, sys.maxsize)
    return PromptSet([np.asarray(x, np.int32) for x in ids], [decode(x[1:]) for x in ids])


def heldout_prompts(data_dir: Path, limit: int | None = None) -> PromptSet:
    """data_prep's held-out prompts (`prompts.parquet`)."""
    table = pq.read_table(Path(data_dir) / "prompts.parquet", columns=["prompt_ids", "prompt_text"]).to_pylist()
    table = table[:limit] if limit is not None else table
    return PromptSet([np.asarray(r["prompt_ids"], np.int32) for r in table], [r["prompt_text"] for r in table])


def _padded(seqs: list[np.ndarray], pad: int) -> tuple[np.ndarray, np.ndarray]:
    T = max(len(s) for s in seqs)
    out = np.full((len(seqs), T), pad, np.int32)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out, np.asarray([len(s) for s in seqs], np.int32)


def sample(model: nnx.Module, prompts: list[np.ndarray], *, max_new_tokens: int, temperature: float, top_p: float,
           rng: jax.Array, eos: int, pad: int, prompt_len: int, num_samples: int = 1) -> list[np.ndarray]:
    """`num_samples` completions per prompt, prompt i's at i·n .. i·n+n-1 (right-padded to `prompt_len`, one
    compiled shape), through the jitted sampling engine every stage decodes with (models/generate.py; a group's
    prompt is prefilled once); each completion up to and with its eos."""
    ids, lengths = _padded([p[-prompt_len:] for p in prompts], pad)
    ids = np.pad(ids, ((0, 0), (0, prompt_len - ids.shape[1])), constant_values=pad)
    out = generate(model, jnp.asarray(ids), prompt_lengths=jnp.asarray(lengths), padding_side="right",
                   max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, rng=rng,
                   eos_token_id=eos, pad_token_id=pad, num_samples=num_samples)
    tokens, n = np.asarray(out.tokens), np.asarray(out.lengths)
    return [tokens[i, : n[i]] for i in range(len(prompts) * num_samples)]


def length_bucket(n: int, cap: int, step: int = 32) -> int:
    """The padded prompt length for a batch whose longest prompt has `n` tokens: `n` rounded up to a multiple
    of `step`, at most `cap` (the data's longest). A few compiled shapes instead of one, so a batch of short
    prompts does not decode over the longest prompt's padding (prefill and every decode step attend to it)."""
    return min(cap, -(-n // step) * step)


def rollout_batch(prompts: list[np.ndarray], completions: list[np.ndarray], advantages: np.ndarray, *,
                  seq_len: int, pad: int) -> dict[str, np.ndarray]:
    """Packed-row columns [N, seq_len] of prompt + completion, loss on the completion's tokens, the
    completion's advantage on every position (`advantage` [N, seq_len]) and the position of its first target
    on every position (`completion_start`: where `completion_window` starts)."""
    N = len(prompts)
    cols = {c: np.zeros((N, seq_len), np.int32) for c in ("input_ids", "target_ids", "positions", "segment_ids",
                                                         "loss_mask")}
    cols["input_ids"][:], cols["target_ids"][:] = pad, pad
    adv = np.zeros((N, seq_len), np.float32)
    start = np.zeros((N, seq_len), np.int32)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        seq = np.concatenate([p, c])[: seq_len + 1]
        n = len(seq) - 1
        cols["input_ids"][i, :n], cols["target_ids"][i, :n] = seq[:-1], seq[1:]
        cols["positions"][i, :n], cols["segment_ids"][i, :n] = np.arange(n), 1
        cols["loss_mask"][i, len(p) - 1 : n] = 1  # targets from the completion's first token on
        adv[i], start[i] = advantages[i], len(p) - 1
    return {**cols, "advantage": adv, "completion_start": start}


def filtered_rows(n: int, batch_size: int, multiple: int) -> int:
    """Rows of an update batch that holds `n` kept completions (`filter_groups`): `n` rounded up to an eighth
    of `batch_size`, itself rounded up to `multiple` (what the mesh and the micro-batches divide), at most
    `batch_size`: at most eight compiled shapes. 0 kept rows still make one eighth: an update of zero gradient,
    as the unfiltered batch would be."""
    eighth = -(-max(batch_size // 8, 1) // multiple) * multiple
    return min(batch_size, max(1, -(-n // eighth)) * eighth)


def pad_rows(batch: dict[str, np.ndarray], rows: int, pad: int) -> dict[str, np.ndarray]:
    """`batch` [N, T] with empty rows appended up to `rows`: pad tokens, no loss, segment 0, so they add no
    gradient and count in neither normaliser (`grpo_count`)."""
    extra = rows - len(batch["input_ids"])
    fill = {"input_ids": pad, "target_ids": pad}
    return {c: np.concatenate([x, np.full((extra, *x.shape[1:]), fill.get(c, 0), x.dtype)]) for c, x in batch.items()}


# -- the loop -----------------------------------------------------------------------------------------------


def accuracy(model: nnx.Module, prompts: PromptSet, score: Callable[[str, str], float],
             decode: Callable[[list[int]], str], *, temperature: float, max_new_tokens: int, eos: int, pad: int,
             prompt_len: int, batch_size: int, seed: int = 0) -> float:
    """pass@1: the share of prompts whose one completion (greedy at temperature 0) the checker scores 1.0
    (correct; a checker's partial credit counts as wrong)."""
    scores = []
    for lo in range(0, len(prompts), batch_size):
        chunk = prompts.ids[lo : lo + batch_size]
        n = len(chunk)
        chunk = chunk + [chunk[0]] * (batch_size - n)  # one compiled shape
        outs = sample(model, chunk, max_new_tokens=max_new_tokens, temperature=temperature, top_p=1.0,
                      rng=jax.random.PRNGKey(seed + lo), eos=eos, pad=pad,
                      prompt_len=length_bucket(max(len(p) for p in chunk), prompt_len))
        scores += score_all(score, prompts.text[lo : lo + n], [decode(outs[i].tolist()) for i in range(n)])
    return float(np.mean(np.asarray(scores) >= 1.0)) if scores else 0.0


def fit_grpo(trainer: Any, reference: nnx.Module | None, cfg: Any, train: PromptSet, heldout: PromptSet,
             score: Callable[[str, str], float], decode: Callable[[list[int]], str], eos: int, pad: int, *,
             checkpoints: Any = None, progress: Any = None, logdir: Path | None = None,
             label: str = "grpo") -> dict[str, Any]:
    """GRPO for `trainer.cfg.steps` steps: each rollout samples `prompts_per_step` train prompts (fixed by the
    rollout's number, so a resumed run repeats nothing), G completions each with the current policy, scores them
    with the checker (with `cfg.oversample` > 1, more prompts are sampled and the groups whose rewards differ are
    kept: `informative_groups`; with `cfg.filter_groups` only those are, `pad_rows`), turns the scores into
    group-relative advantages, and takes `cfg.num_iterations` optimizer steps on the batch (`cfg`: tasks/configs.py
    GRPOConfig; after the first, against the rollout's own log-probabilities). The reference's log-probabilities
    enter the KL term; with β = 0 they are only watched: KL(π ‖ π_ref) on the rollout of each evaluated step (None:
    no reference, no KL). Held-out pass@1 at temperature 0 and at the sampling temperature is measured before
    training, every `eval_every` steps and at the end. Returns the curves (reward, informative groups, KL, clip
    fraction, completion length, held-out accuracy per measured step) and the before/after accuracies."""
    tc = trainer.cfg
    G, P = cfg.group_size, tc.batch_size // cfg.group_size
    prompt_len = max(len(p) for p in train.ids + heldout.ids)
    seq_len = prompt_len + cfg.max_new_tokens
    ref_logps = nnx.jit(lambda m, b: completion_logps(m, b, completion_window(b, cfg.max_new_tokens)[0],
                                                      cfg.temperature))  # [N, max_new_tokens]
    writer = TensorBoardWriter(logdir) if logdir is not None and jax.process_index() == 0 else None

    def heldout_accuracy() -> dict[str, float]:
        model = trainer.model()
        return {f"accuracy_t{t:g}": accuracy(model, heldout, score, decode, temperature=t,
                                             max_new_tokens=cfg.max_new_tokens, eos=eos, pad=pad,
                                             prompt_len=prompt_len, batch_size=cfg.eval_batch_size, seed=tc.seed)
                for t in sorted({0.0, cfg.temperature})}

    # the accuracy before RL travels in every checkpoint, so a resumed run reports the same start
    temps = [f"accuracy_t{t:g}" for t in sorted({0.0, cfg.temperature})]

    def state(before: dict[str, float]) -> dict[str, Any]:  # Python floats: scalars orbax saves on every host
        return {**trainer.state(), "heldout_before": {k: float(before[k]) for k in temps}}

    start = 0
    if checkpoints is not None and (found := checkpoints.restore_latest(state(dict.fromkeys(temps, 0.0)))):
        start, restored = found
        before = {k: float(v) for k, v in restored.pop("heldout_before").items()}
        trainer.load_state(restored)
        log.info("%s: resumed from checkpoint at step %d (held-out accuracy before RL %s)", label, start, before)
    else:
        before = heldout_accuracy()
        log.info("%s: held-out accuracy before training %s", label, before)
    curves: dict[str, list[list[float]]] = {k: [[0, v]] for k, v in before.items()}
    t0, rollout_s, rollout_tokens = time.perf_counter(), 0.0, 0
    mu = cfg.num_iterations

    def evaluates(step: int) -> bool:  # whether held-out accuracy is measured after update `step` (0-based)
        return (step + 1) % cfg.eval_every == 0 or step + 1 == tc.steps

    # a filtered batch's rows: a multiple of what the mesh's batch shards times the micro-batches divide
    row_multiple = tc.grad_accum * (tc.batch_size // trainer.batch_sh.shard_shape((tc.batch_size, seq_len))[0])
    watched_kl = None  # β = 0 with a reference: KL(π ‖ π_ref) measured on the rollouts of evaluated steps
    try:
        for step in range(start, tc.steps):
            if step % mu == 0:  # a new rollout: rollout r is fixed by r, so a resumed run repeats nothing
                r = step // mu
                rng = np.random.default_rng([tc.seed, r])
                Q = math.ceil(P * cfg.oversample)  # prompts sampled: P of them are trained on
                picks = rng.choice(len(train), size=Q, replace=len(train) < Q)
                prompts = [train.ids[i] for i in picks for _ in range(G)]
                texts = [train.text[i] for i in picks for _ in range(G)]
                tr = time.perf_counter()
                completions = sample(trainer.model(), prompts[::G], max_new_tokens=cfg.max_new_tokens,
                                     temperature=cfg.temperature, top_p=cfg.top_p,
                                     rng=jax.random.PRNGKey(tc.seed * 1_000_003 + r), eos=eos, pad=pad,
                                     prompt_len=length_bucket(max(len(p) for p in prompts), prompt_len),
                                     num_samples=G)
                rollout_s += time.perf_counter() - tr
                lengths = [len(c) for c in completions]  # of every sampled completion, kept or not
                rollout_tokens += int(sum(lengths))
                sampled = np.asarray(score_all(score, texts, [decode(c.tolist()) for c in completions]),
                                     np.float32).reshape(Q, G)
                keep = informative_groups(sampled, P) if Q > P else np.arange(P)
                if cfg.filter_groups:
                    keep = keep[sampled[keep].std(-1) > 0]
                rows = [g * G + j for g in keep for j in range(G)]
                prompts, completions = [prompts[i] for i in rows], [completions[i] for i in rows]
                rewards = sampled[keep]
                adv = np.asarray(group_advantages(jnp.asarray(rewards), scale=cfg.scale_rewards)).reshape(-1)
                batch = rollout_batch(prompts, completions, adv, seq_len=seq_len, pad=pad)
                if cfg.filter_groups:
                    batch = pad_rows(batch, filtered_rows(len(rows), tc.batch_size, row_multiple), pad)
                device_batch = {k: jnp.asarray(v) for k, v in batch.items()}
                if reference is not None and cfg.beta > 0:
                    batch["ref_logp"] = np.asarray(ref_logps(reference, device_batch))
                watch = reference is not None and cfg.beta == 0 and any(map(evaluates, range(step, step + mu)))
                # the sampling policy's log-probabilities: the ratio's denominator for all μ updates, and the
                # policy side of the watched KL
                policy_logp = ref_logps(trainer.model(), device_batch) if mu > 1 or watch else None
                if mu > 1:
                    batch["old_logp"] = np.asarray(policy_logp)
                if watch:
                    # the policy that sampled these completions against the reference, on them: the k3 estimate
                    # the KL term would train on, watched instead (no gradient)
                    kl = k3(policy_logp, ref_logps(reference, device_batch))
                    mask = completion_window(device_batch, cfg.max_new_tokens)[1]
                    watched_kl = float((kl * mask).sum() / jnp.maximum(mask.sum(), 1))
            stats = {k: float(v) for k, v in trainer.step(batch).items()}
            if not (math.isfinite(stats["loss"]) and math.isfinite(stats["grad_norm"])):
                raise TrainingDiverged(f"{label}: step {step + 1}: loss {stats['loss']} grad_norm "
                                       f"{stats['grad_norm']} is not finite")
            per_tok = max(stats["tokens"], 1e-9)
            row = {"reward": float(sampled.mean()), "informative_groups": float((sampled.std(-1) > 0).mean()),
                   "loss": stats["loss"],
                   **({"kl": stats["kl"] / per_tok} if cfg.beta > 0 else {}),
                   "clip_fraction": stats["clip_fraction"] / per_tok, "grad_norm": stats["grad_norm"],
                   "completion_tokens": float(np.mean(lengths)),
                   "rollout_tokens_per_s": rollout_tokens / max(rollout_s, 1e-9)}
            if evaluates(step):
                row |= heldout_accuracy() | ({"kl": watched_kl} if watched_kl is not None else {})
            for k, v in row.items():
                if k not in ("loss", "grad_norm", "rollout_tokens_per_s"):
                    curves.setdefault(k, []).append([step + 1, v])
            if (step + 1) % tc.log_every == 0 or step + 1 == tc.steps:
                log.info("%s step %d/%d %s", label, step + 1, tc.steps,
                         " ".join(f"{k} {v:.4g}" for k, v in row.items()))
                if writer is not None:
                    writer.scalars(step + 1, {f"{label}/{k}": v for k, v in row.items()})
                if progress is not None:
                    progress(step + 1, tc.steps, row)
            if checkpoints is not None and ((step + 1) % tc.checkpoint_every == 0 or step + 1 == tc.steps):
                checkpoints.save(step + 1, state(before))
        if checkpoints is not None:
            checkpoints.wait()
    finally:
        if writer is not None:
            writer.close()
    if curves[temps[0]][-1][0] != tc.steps:  # resumed from the last checkpoint: the loop measured nothing
        for k, v in heldout_accuracy().items():
            curves[k].append([tc.steps, v])
    after = {k: v[-1][1] for k, v in curves.items() if k.startswith("accuracy_")}
    return {"steps": tc.steps, "resumed_from_step": start or None, "accuracy_before": before,
            "accuracy_after": after, "curves": curves, "seconds": round(time.perf_counter() - t0, 1),
            "rollout_tokens_per_s": round(rollout_tokens / max(rollout_s, 1e-9), 1)}
