"""Per-step metrics and the terminal progress bar.


    tb = TensorBoardWriter("runs/finetune")                     # events.out.tfevents.<time>.<host>.<pid>.<n>
    flops = train_flops_per_token(model.config, seq_len=T)      # PaLM appendix B: 6N + 12·L·H·Q·T
    metrics = StepMetrics(flops, matmul_peak_flops())           # peak: this machine's measured matmul FLOP/s
    with ProgressBar(steps, "finetune") as bar:
        for step in range(steps):
            out = trainer.step(batch)
            m = metrics(loss=out["loss"], grad_norm=out["grad_norm"], learning_rate=lr, tokens=B * T, seconds=dt)
            tb.scalars(step, m)
            bar.update(step + 1, m)
    tb.close()
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepMetrics:
    """Turns one step's raw numbers into the logged dict. `peak_flops` is the summed peak FLOP/s of every
    device the step runs on (e.g. `matmul_peak_flops() * jax.device_count()`); None leaves mfu out."""

    flops_per_token: float
    peak_flops: float | None = None

    def __call__(self, *, loss: Any, grad_norm: Any, learning_rate: Any, tokens: float,
                 seconds: float) -> dict[str, float]:
        """loss, grad_norm, learning_rate: numbers or 0-d arrays; tokens processed in `seconds` of wall time."""
        if seconds <= 0:
            raise ValueError(f"seconds must be > 0 (got {seconds})")
        rate = float(tokens) / seconds
        out = {"loss": float(loss), "grad_norm": float(grad_norm), "learning_rate": float(learning_rate),
               "tokens_per_s": rate}
        if self.peak_flops:
            out["mfu"] = rate * self.flops_per_token / self.peak_flops
        return out


# -- terminal progress bar -------------------------------------------------------------------------


class ProgressBar:
    """A rich progress bar on stderr: step/total, loss, tokens/s and ETA. Does nothing when stderr is not
    a terminal (log lines carry the same numbers there). Usable as tasks.training.loop.fit's `progress` callback:
    `bar(step, total, metrics)`."""

    def __init__(self, total: int, label: str = "train", *, enabled: bool | None = None):
        self.total, self.label = total, label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._progress = self._task = None
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} tok/s"),
                TextColumn("ETA"), TimeRemainingColumn(),
                console=Console(file=sys.stderr), transient=False,
            )
            self._task = self._progress.add_task(label, total=total, loss="-", rate="-")
            self._progress.start()

    def update(self, step: int, metrics: Mapping[str, Any] | None = None) -> None:
        """Move to `step` (completed steps) and show `loss` / `tokens_per_s` from `metrics` when present."""
        if self._progress is None:
            return
        m = metrics or {}
        fields = {}
        if m.get("loss") is not None:
            fields["loss"] = f"{float(m['loss']):.4f}"
        if m.get("tokens_per_s") is not None:
            fields["rate"] = f"{float(m['tokens_per_s']):,.0f}"
        self._progress.update(self._task, completed=step, **fields)

    def __call__(self, step: int, total: int, metrics: Mapping[str, Any]) -> None:
        if self._progress is not None and total != self.total:
            self.total = total
            self._progress.update(self._task, total=total)
        self.update(step, metrics)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
