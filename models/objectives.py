"""The names of the draft training objectives and their validation, without JAX (a recipe is validated
on machines without accelerators; the objectives themselves are models/draft_losses.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping

OBJECTIVE_NAMES = ("kl_div", "rkl", "jsd", "ce", "tv", "nla", "lk_hybrid")

Objective = str | Mapping[str, float]


def check_objective(objective: Objective) -> dict[str, float]:
    """A name or {name: weight} -> {name: weight}; ValueError naming an unknown objective or a bad weight."""
    mix = {objective: 1.0} if isinstance(objective, str) else dict(objective)
    if not mix:
        raise ValueError("loss: an empty mix (name at least one objective)")
    for name, w in mix.items():
        if name not in OBJECTIVE_NAMES:
            raise ValueError(f"loss: unknown objective {name!r} (known: {', '.join(OBJECTIVE_NAMES)})")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"loss: weight of {name!r} must be a finite number >= 0, got {w!r}")
    return {k: float(v) for k, v in mix.items()}
