"""The pruned draft vocabulary: the `draft_vocab_size` most frequent target tokens, as the `d2t`
offsets (draft id -> target id) and the `t2d` mask (target id -> in the draft vocabulary) that both
export layouts carry, with the ascending-id convention of SpecForge and vllm-project/speculators.
See docs/formats/eagle3.md (d2t / t2d).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def check_vocab(d2t: np.ndarray | Sequence[int], t2d: np.ndarray | Sequence[bool], draft_vocab_size: int,
                vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t [Vd], t2d [V] bool) as numpy, after checking they describe one ascending draft vocabulary inside
    the target's: ValueError otherwise (what a draft's `set_vocab` installs)."""
    d2t, t2d = np.asarray(d2t), np.asarray(t2d, bool)
    if d2t.shape != (draft_vocab_size,) or t2d.shape != (vocab_size,):
        raise ValueError(f"d2t {d2t.shape} / t2d {t2d.shape}: expected ({draft_vocab_size},) / ({vocab_size},)")
    ids = np.arange(draft_vocab_size) + d2t
    if ids.min() < 0 or ids.max() >= vocab_size or np.any(np.diff(ids) <= 0):
        raise ValueError("d2t must map draft ids to strictly ascending target ids inside the vocabulary")
    if not np.array_equal(np.flatnonzero(t2d), ids):
        raise ValueError("t2d does not mark exactly the target ids that d2t maps to")
    return d2t, t2d


def build_draft_vocab(counts: np.ndarray | Sequence[int], draft_vocab_size: int
                      ) -> tuple[np.ndarray, np.ndarray, float]:
    """Token counts [V] (loss-masked answer tokens) -> (d2t int64 [Vd], t2d bool [V], coverage).

    Keeps the `draft_vocab_size` most frequent ids (ties: the lower id), sorted ASCENDING so that draft
    column i is the i-th smallest kept target id (the order boolean `t2d` selects columns in);
    d2t[i] = used[i] - i; coverage = the kept share of all counted tokens (0 when nothing counted).
    """
    counts = np.asarray(counts)
    V = counts.shape[0]
    if counts.ndim != 1 or not 1 <= draft_vocab_size <= V:
        raise ValueError(f"counts must be [V] and 1 <= draft_vocab_size <= V (got {counts.shape}, {draft_vocab_size})")
    top = np.argsort(-counts, kind="stable")[:draft_vocab_size]
    used = np.sort(top)  # [Vd] ascending target ids
    d2t = (used - np.arange(draft_vocab_size)).astype(np.int64)
    t2d = np.zeros((V,), bool)
    t2d[used] = True
    total = counts.sum()
    coverage = float(counts[used].sum() / total) if total > 0 else 0.0
    return d2t, t2d, coverage
