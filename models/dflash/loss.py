"""The DFlash training loss: `num_anchors` blocks per packed row, each anchored at a real answer token,
every proposed slot scored against the target's distribution (restricted to the draft vocabulary)
with speculators' exponential slot decay.

Block at anchor a (models/dflash/model.py): slot j (1..bs-1) predicts t_{a+j}; its label is the
target's logits at position a+j-1 (`target_logits[a+j-1]`, which predict t_{a+j}), its mask
`loss_mask[a+j-1]` (our columns are aligned with `target_ids`: loss_mask[p] says whether t_{p+1} is an
answer token) ∧ t_{a+j} in a's segment ∧ the target's full-vocabulary argmax there is in the draft
vocabulary ∧ the anchor is real. Slot weights are speculators' `dflash_loss_decay`: 0 for the anchor
slot, 1 for slot 1, exp(-(j-1)/gamma) after.

Mirrors vllm-project/speculators 0.9.0 `src/speculators/models/dflash/core.py` (`_backbone_forward`),
`utils.py` (`select_anchors`: answer-token anchors, the last block_size positions of a row left out),
`metrics.py` (`compute_metrics`) and `src/speculators/losses/utils.py` (`dflash_loss_decay`,
`loss_function`); the objectives are models/draft_losses.py's (speculators' names). DFlash: arXiv
2602.06036. Differences: speculators scores a block that runs past its document into the next one,
this loss masks such slots; it returns the weighted SUM (the caller divides by its token count, as
`ttt_loss`) instead of speculators' mean over masked slots.

Shape legend: B batch, T length, n anchors per row, bs block size, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from models.dflash.model import DFlashDraft
from models.draft_losses import Objective, TargetHead, draft_loss, restricted_targets


def anchor_candidates(batch: Mapping[str, jax.Array], block_size: int) -> jax.Array:
    """Positions a that may anchor a block, [B, T] bool: t_a is a real answer token of the segment
    of a (loss_mask[a-1], same segment as a-1, not padding) and a < T - block_size (speculators'
    `select_anchors` leaves the last block_size positions out)."""
    seg, loss_mask = batch["segment_ids"], batch["loss_mask"] != 0
    B, T = seg.shape
    a = jnp.arange(T, dtype=jnp.int32)[None, :]  # [1, T]
    prev_mask = jnp.pad(loss_mask[:, :-1], ((0, 0), (1, 0)))  # [B, T]: loss_mask[a-1], False at 0
    prev_seg = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)))  # [B, T]
    return prev_mask & (seg != 0) & (prev_seg == seg) & (a < T - block_size)


def select_anchors(batch: Mapping[str, jax.Array], num_anchors: int, block_size: int,
                   rng: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """`num_anchors` anchors per row -> (anchors [B, n] int32 ascending among the valid ones,
    valid [B, n] bool). Drawn uniformly without replacement with `rng`, else the first candidates;
    rows with fewer candidates pad with anchor 0, valid False."""
    cand = anchor_candidates(batch, block_size)  # [B, T]
    B, T = cand.shape
    if not 1 <= num_anchors <= T:
        raise ValueError(f"num_anchors {num_anchors} must be in [1, T={T}]")
    if rng is None:
        score = -jnp.arange(T, dtype=jnp.float32)[None, :].repeat(B, 0)  # earliest first
    else:
        score = jax.random.uniform(rng, (B, T))
    score = jnp.where(cand, score, -jnp.inf)
    top, idx = jax.lax.top_k(score, num_anchors)  # [B, n]
    valid = top > -jnp.inf
    idx = jnp.where(valid, idx, T)  # padding sorts last
    order = jnp.argsort(idx, axis=1)
    idx, valid = jnp.take_along_axis(idx, order, axis=1), jnp.take_along_axis(valid, order, axis=1)
    return jnp.where(valid, idx, 0).astype(jnp.int32), valid


def slot_weights(block_size: int, gamma: float) -> jax.Array:
    """speculators' `dflash_loss_decay` (sample_from_anchor false): [0, 1, e^{-1/γ}, e^{-2/γ}, ...] [bs]."""
    j = jnp.arange(block_size, dtype=jnp.float32)
    return jnp.where(j == 0, 0.0, jnp.exp(-jnp.maximum(j - 1.0, 0.0) / gamma))


def block_loss(draft: DFlashDraft, batch: Mapping[str, jax.Array], features: jax.Array,
               target_logits: jax.Array | TargetHead,
               *, num_anchors: int, objective: Objective = "kl_div", temperature: float = 1.0, gamma: float = 4.0,
               rng: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DFlash block loss over one packed batch (jit / grad friendly, static shapes, no cache).

    batch: packed columns `input_ids` (t_p), `target_ids` (t_{p+1}), `positions`, `segment_ids`,
    `loss_mask` [B, T]; features [B, T, num_aux·D] (f_p); target_logits: the target's logits at every
    position, full vocabulary [B, T, V], or factored (models/draft_losses.py `TargetHead`, hidden [B, T, D_t]).
    Anchors: `select_anchors(batch, num_anchors, bs, rng)`.

    Returns (Σ_j w_j Σ_{b,blocks} m · draft_loss(slot j), stats) with stats (each [bs-1] fp32, slots
    1..bs-1): `loss` unweighted per-slot sums, `acc_num` masked slots whose draft argmax equals the
    restricted target argmax, `acc_den` masked slots.
    """
    bs = draft.config.block_size
    ids, positions, seg = batch["input_ids"], batch["positions"], batch["segment_ids"]
    loss_mask = batch["loss_mask"] != 0
    B, T = ids.shape
    anchors, a_valid = select_anchors(batch, num_anchors, bs, rng)  # [B, n]
    logits = draft(ids, features, anchors, positions=positions, segment_ids=seg).astype(jnp.float32)  # [B,n,bs,Vd]

    j = jnp.arange(bs, dtype=jnp.int32)
    label_pos = anchors[..., None] + j - 1  # [B, n, bs]: slot j's label position a + j - 1
    lp = jnp.clip(label_pos, 0, T - 1).reshape(B, -1)  # [B, n·bs]
    tok = jnp.clip(anchors[..., None] + j, 0, T - 1).reshape(B, -1)  # [B, n·bs]: where t_{a+j} sits
    # labels: the target restricted to the draft vocabulary (ascending target ids == t2d columns), at the
    # label positions only (a TargetHead's matmuls run there; full logits are gathered there first)
    at_labels = target_logits.at(lp) if isinstance(target_logits, TargetHead) else jnp.take_along_axis(
        target_logits, lp[..., None], axis=1)  # [B, n·bs, ...]
    restricted, in_draft = restricted_targets(at_labels, draft.target_token_ids, draft.t2d[...])  # [B, n·bs, Vd]
    labels = restricted.reshape(logits.shape)  # [B, n, bs, Vd]
    a_seg = jnp.take_along_axis(seg, anchors, axis=1)  # [B, n]
    m = ((jnp.take_along_axis(loss_mask, lp, axis=1) & in_draft)
         & (jnp.take_along_axis(seg, tok, axis=1) == jnp.repeat(a_seg, bs, axis=1))).reshape(B, -1, bs)
    m = m & a_valid[..., None] & (j >= 1) & (label_pos >= 0) & (label_pos < T - 1)  # [B, n, bs]
    m = m.astype(jnp.float32)

    per = draft_loss(logits, labels, objective, temperature)  # [B, n, bs]
    correct = (jnp.argmax(logits, axis=-1) == jnp.argmax(labels, axis=-1)).astype(jnp.float32)  # [B, n, bs]
    per_slot = jnp.sum(m * per, axis=(0, 1))  # [bs]
    total = jnp.sum(slot_weights(bs, gamma) * per_slot)
    stats = {"loss": per_slot[1:], "acc_num": jnp.sum(m * correct, axis=(0, 1))[1:],
             "acc_den": jnp.sum(m, axis=(0, 1))[1:]}
    return total, stats
