"""The training loop: resume from the newest checkpoint, step, log (log lines, TensorBoard, a progress bar,
the caller's `progress`), checkpoint, and stop at the first NaN/Inf with the step named."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from tasks.stage import raise_if_interrupted
from tasks.training.checkpoints import Checkpoints
from tasks.training.config import Progress, TrainingDiverged
from tasks.training.data import PackedBatches
from tasks.training.flops import matmul_peak_flops, train_flops_per_token
from tasks.training.progress import ProgressBar
from tasks.training.tensorboard import TensorBoardWriter
from tasks.training.trainer import Trainer

log = logging.getLogger("forgeline.train")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


_STEP_STATS = {"loss", "grad_norm", "aux_loss", "target_tokens"}  # what every train step reports
_FORMATS = {"loss": "{:.4f}", "grad_norm": "{:.3f}", "learning_rate": "{:.3e}", "tokens_per_s": "{:.0f}",
            "mfu": "{:.1%}", "aux_loss": "{:.4f}"}


def fit(
    trainer: Trainer,
    data_dir: Path,
    *,
    checkpoints: Checkpoints | None = None,
    progress: Progress | None = None,
    label: str = "train",
    logdir: Path | None = None,
    loader: Callable[..., PackedBatches] = PackedBatches,
    on_step: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Train `trainer` for `cfg.steps` steps on `data_dir`'s train split, resuming if possible.

    Logs loss, grad norm, learning rate, tokens/s and MFU every `log_every` steps (to the log, a
    terminal progress bar, TensorBoard event files under `logdir`, and `progress`). A NaN/Inf loss
    or gradient norm raises TrainingDiverged naming the step; no checkpoint after it is written.
    Returns JSON-able metrics: validation loss before and after, the final train loss, tokens/s, MFU.
    `on_step(n)` runs after step n (1-based) is checked, e.g. the draft stage's held-out acceptance
    measurement; its time is kept out of tokens/s.
    """
    cfg = trainer.cfg
    train = loader(data_dir, "train", cfg.batch_size, seed=cfg.seed)
    valid = loader(data_dir, "valid", cfg.batch_size, shuffle=False)
    start, resumed_from = 0, None
    if checkpoints is not None and (found := checkpoints.restore_latest(trainer.state())) is not None:
        start, state = found
        trainer.load_state(state)
        resumed_from = start
        log.info("%s: resumed from checkpoint at step %d", label, start)
    valid_before = trainer.evaluate(valid, cfg.eval_batches) if start == 0 else None

    n_dev = trainer.mesh.devices.size
    flops_per_token = None
    if trainer.config is not None:
        flops_per_token = train_flops_per_token(trainer.config, train.seq_len,
                                                              trainable_only=trainer.lora,
                                                              adapter_params=trainer.adapter_params_per_token())
    peak = cfg.peak_flops or matmul_peak_flops(jnp.dtype(cfg.compute_dtype))
    writer = TensorBoardWriter(logdir) if logdir is not None and jax.process_index() == 0 else None
    bar = ProgressBar(cfg.steps, label) if jax.process_index() == 0 else None

    losses: list[list[float]] = []
    curves: dict[str, list[list[float]]] = {}
    loss0, compile_s, tokens, t0 = None, 0.0, 0, time.perf_counter()
    last_mfu = None
    pending: tuple[int, dict[str, jax.Array]] | None = None  # the previous step's stats, checked one step late

    def check(step: int, stats: dict[str, jax.Array]) -> dict[str, float]:
        m = {k: float(v) for k, v in stats.items()}
        if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
            last = checkpoints.manager.latest_step() if checkpoints is not None else None
            raise TrainingDiverged(f"{label}: step {step}: loss {m['loss']} grad_norm {m['grad_norm']} is not finite"
                                   f" (last good checkpoint: {'none' if last is None else f'step {last}'})")
        return m

    try:
        for step in range(start, cfg.steps):
            batch = trainer.global_batch(train, step)
            if not trainer.compiled:
                tc = time.perf_counter()
                est = trainer.compile(batch)
                compile_s = time.perf_counter() - tc
                log.info("%s: memory estimate per device: params %s, optimizer %s, frozen %s, activations/temp %s"
                         " = %s (%d devices, mesh %s)", label, _gib(est["params"]), _gib(est["optimizer"]),
                         _gib(est["frozen"]), _gib(est["temp"]), _gib(est["total"]), n_dev,
                         dict(trainer.mesh.shape))
            raise_if_interrupted()  # a signal that library code swallowed still stops training at a step
            stats = trainer.step(batch)
            if pending is not None:
                check(*pending)
            pending = (step + 1, stats)
            if step == start:  # the first step is slow (allocation); keep it out of the throughput number
                loss0 = check(*pending)["loss"]
                t0 = time.perf_counter()
            else:
                tokens += train.tokens_per_batch
            if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
                m = check(*pending)
                losses.append([step + 1, m["loss"]])
                rate = tokens / max(time.perf_counter() - t0, 1e-9)
                row = {"loss": m["loss"], "grad_norm": m["grad_norm"],
                       "learning_rate": float(trainer.schedule(step)), "tokens_per_s": rate}
                if flops_per_token is not None and tokens:
                    row["mfu"] = last_mfu = rate * flops_per_token / (peak * n_dev)
                if trainer.moe:
                    row["aux_loss"] = m["aux_loss"]
                for k in sorted(m.keys() - _STEP_STATS):  # the objective's own metrics (preference rewards, ...),
                    # in a fixed order: a set's follows the hash seed, and training.json would differ run to run
                    row[k] = m[k]
                    curves.setdefault(k, []).append([step + 1, m[k]])
                log.info("%s step %d/%d %s", label, step + 1, cfg.steps,
                         " ".join(f"{k} {_FORMATS.get(k, '{:.4f}').format(v)}" for k, v in row.items()))
                if writer is not None:
                    writer.scalars(step + 1, {f"{label}/{k}": v for k, v in row.items()})
                if bar is not None:
                    bar.update(step + 1, row)
                if progress is not None:
                    progress(step + 1, cfg.steps, row)
            if checkpoints is not None and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps):
                check(*pending)  # never checkpoint past a NaN
                checkpoints.save(step + 1, trainer.state())
            if on_step is not None:
                check(*pending)
                th = time.perf_counter()
                on_step(step + 1)
                t0 += time.perf_counter() - th  # not training time
        if pending is not None:
            check(*pending)
        if checkpoints is not None:
            checkpoints.wait()
    finally:
        if writer is not None:
            writer.close()
        if bar is not None:
            bar.close()
    elapsed = time.perf_counter() - t0
    valid_after = trainer.evaluate(valid, cfg.eval_batches)
    return {
        "steps": cfg.steps,
        "resumed_from_step": resumed_from,
        "first_train_loss": loss0,
        "final_train_loss": losses[-1][1] if losses else None,
        "train_losses": losses,  # [step, loss] at every logged step
        **({"train_metrics": curves} if curves else {}),  # the objective's metrics, [step, value] likewise
        "valid_loss_before": valid_before,
        "valid_loss_after": valid_after,
        "tokens_per_s": round(tokens / elapsed, 1) if tokens else None,
        "mfu": round(last_mfu, 4) if last_mfu is not None else None,
        "compile_s": round(compile_s, 2),
        "devices": n_dev,
    }
