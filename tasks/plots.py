"""Training curves as one PNG: a panel per metric, [step, value] series as every stage reports them
(`train_losses`, the objective's `train_metrics`, GRPO's `curves`). Rendered with matplotlib's Agg backend
(no display, no GUI toolkit), so it runs on any worker; the PNG goes into the stage's output, the release
bundle and the Prefect UI (an image artifact).

    png = curves_png({"reward": [[1, 0.1], [2, 0.3]], "accuracy": {"T=0": [[0, .2]], "T=1": [[0, .1]]}},
                     title="finetune[grpo]")

A panel's value is one series ([[step, value], ...]) or several named ones ({label: series}) drawn together,
such as held-out accuracy at two temperatures.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence

Series = Sequence[Sequence[float]]  # [[step, value], ...]
Panel = Series | Mapping[str, Series]


def _named(panel: Panel) -> dict[str, Series]:
    return dict(panel) if isinstance(panel, Mapping) else {"": panel}


def curves_png(panels: Mapping[str, Panel], *, title: str = "", columns: int = 3) -> bytes:
    """The panels (title -> series) on a grid, `columns` wide, as PNG bytes. Empty series are left out;
    non-finite values are dropped (a plot is a record, not a check: training refuses NaNs before this)."""
    from matplotlib.figure import Figure  # no pyplot: no backend switch, no global state (Agg renders savefig)

    kept = {name: {k: [(float(s), float(v)) for s, v in pts if math.isfinite(v)] for k, pts in _named(p).items()}
            for name, p in panels.items()}
    kept = {name: {k: pts for k, pts in p.items() if pts} for name, p in kept.items()}
    kept = {name: p for name, p in kept.items() if p}
    if not kept:
        raise ValueError("curves_png: no data points in any panel")
    cols = min(columns, len(kept))
    rows = math.ceil(len(kept) / cols)
    fig = Figure(figsize=(4.2 * cols, 3.0 * rows + (0.4 if title else 0)), dpi=100, layout="constrained")
    if title:
        fig.suptitle(title)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, (name, series) in zip(axes.flat, kept.items(), strict=False):
        for label, pts in series.items():
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o" if len(pts) <= 12 else None, markersize=3, label=label or None)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend(fontsize=8)
    for ax in axes.flat[len(kept):]:
        ax.set_visible(False)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def finetune_panels(result: Mapping) -> dict[str, Panel]:
    """The panels of a fine-tune's result (tasks/finetune.py): SFT loss (an SFT phase's and/or the run's;
    distillation's beside its SFT student's),
    the objective's metrics (DPO rewards and margins), and GRPO's reward, KL, clip fraction, completion
    length and held-out accuracy (greedy and sampled, one panel)."""
    panels: dict[str, Panel] = {}
    sft = result.get("sft", {}).get("train_losses")
    if sft and result.get("method") == "distill":  # the baseline trained beside the student: one panel, both
        panels["train loss: distilled vs SFT student"] = {"distill (KL)": result.get("train_losses", []),
                                                          "SFT (CE)": sft}
    else:
        if sft:
            panels["SFT train loss"] = sft
        if result.get("train_losses"):
            panels["train loss"] = result["train_losses"]
    for k, pts in result.get("train_metrics", {}).items():
        panels[k] = pts
    curves = dict(result.get("curves", {}))
    acc = {k: curves.pop(k) for k in sorted(curves) if k.startswith("accuracy_")}
    if acc:
        panels["held-out accuracy (pass@1)"] = {f"T={k[len('accuracy_t'):]}": v for k, v in acc.items()}
    panels.update(curves)
    return panels
