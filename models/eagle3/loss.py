"""The EAGLE-3 training-time-test (TTT) loss: the draft is unrolled `steps` times on its own outputs
(no cache), each step attending to the step-0 keys of the prefix plus the same position's keys of the
earlier steps, and every step is scored against the target's distribution restricted to the draft
vocabulary, with weight decay^k.

Mirrors EAGLE-3's training-time test (arXiv:2503.01840) as SpecForge and vllm-project/speculators
(`models/eagle3/core.py`) train it. See docs/speculative-decoding.md (TTT loss).

Shape legend: B batch, T length, D draft width, D_t target width, N heads, K kv heads, G = N/K, H head
dim, V target vocab, Vd draft vocab, k TTT step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp

from models.decoder import build_context
from models.draft_losses import Objective, TargetHead, draft_loss, restricted_targets
from models.eagle3.model import Eagle3Draft
from models.layers import NEG_INF

Unroll = Callable[..., Iterator[jax.Array]]


def _shift(x: jax.Array, s: int) -> jax.Array:
    """x[:, s:] padded at the end with zeros (False) back to length T: row p holds x[p + s]. [B, T, ...]"""
    T = x.shape[1]
    if s >= T:
        return jnp.zeros_like(x)
    pad = [(0, 0), (0, s)] + [(0, 0)] * (x.ndim - 2)
    return jnp.pad(x[:, s:], pad)


def ttt_attention(q: jax.Array, k0: jax.Array, v0: jax.Array, mask0: jax.Array,
                  k_diag: Sequence[jax.Array], v_diag: Sequence[jax.Array]) -> jax.Array:
    """Attention of TTT step k without a cache: query p sees the step-0 keys k0 allowed by `mask0`
    (causal within its segment) plus the same position's keys from steps 1..k (`k_diag`), all in one
    softmax. Scores: [B, K, G, T, T] for step 0 plus one diagonal column per earlier step.

    q [B, T, N, H] (rotated, unscaled), k0 / v0 [B, T, K, H], mask0 [B, T, T], k_diag / v_diag: k
    arrays [B, T, K, H] -> [B, T, N, H]. Softmax in fp32; a query with no allowed key (padding at
    step 0) gets a uniform distribution, as in models.layers.attention.
    """
    B, T, N, H = q.shape
    K = k0.shape[2]
    q = (q * jnp.asarray(H**-0.5, q.dtype)).reshape(B, T, K, N // K, H)  # [B, T, K, G, H]
    s0 = jnp.einsum("btkgh,bskh->bkgts", q, k0).astype(jnp.float32)  # [B, K, G, T, T]
    s0 = jnp.where(mask0[:, None, None], s0, NEG_INF)
    cols = [jnp.einsum("btkgh,btkh->bkgt", q, kj).astype(jnp.float32) for kj in k_diag]  # k × [B, K, G, T]
    # one softmax over the T step-0 scores and the k diagonal ones, without concatenating them: the shared
    # maximum, the exponentials, and the normaliser applied after the value sums (no [.., T+k] copy and slice)
    top = jax.lax.stop_gradient(functools.reduce(jnp.maximum, cols, jnp.max(s0, axis=-1)))  # [B, K, G, T]
    e0 = jnp.exp(s0 - top[..., None])  # [B, K, G, T, T]
    ecols = [jnp.exp(c - top) for c in cols]
    denom = functools.reduce(jnp.add, ecols, jnp.sum(e0, axis=-1))  # [B, K, G, T]
    out = jnp.einsum("bkgts,bskh->btkgh", e0.astype(v0.dtype), v0).astype(jnp.float32)  # [B, T, K, G, H]
    for ej, vj in zip(ecols, v_diag, strict=True):
        out = out + jnp.einsum("bkgt,btkh->btkgh", ej, vj.astype(jnp.float32))
    out = out / jnp.transpose(denom, (0, 3, 1, 2))[..., None]
    return out.astype(v0.dtype).reshape(B, T, N, H)


def ttt_unroll(draft: Eagle3Draft, token_ids: jax.Array, features: jax.Array, *, positions: jax.Array,
               segment_ids: jax.Array | None, steps: int,
               head: Callable[[jax.Array], jax.Array] | None = None) -> Iterator[jax.Array]:
    """Yield the draft logits [B, T, Vd] of TTT steps 0..steps-1 (no cache, one pass per step); `head` maps
    a step's hidden state [B, T, D] to what is yielded (default: norm and LM head, the logits).

    Step k at position p: token token_ids[p + k] (0 past the end), f = fc(features_p) at k = 0 else
    the step k-1 output at p, rotary position positions[p] + k; attention over the step-0 keys of
    positions <= p in p's segment plus p's own keys from steps 1..k (the diagonal extension).
    """
    B, T = token_ids.shape
    head = head or (lambda h: draft.lm_head(draft.norm(h)))
    attn, layer = draft.midlayer.self_attn, draft.midlayer
    ctx, _ = build_context(T, B, positions=positions, segment_ids=segment_ids, cache=None, windows=set())
    mask0 = ctx.mask()  # [B, T, T] causal within segments
    f = draft.fuse(features)  # [B, T, D]
    k0 = v0 = None
    k_diag: list[jax.Array] = []
    v_diag: list[jax.Array] = []
    for k in range(steps):
        cos, sin = draft.rope(ctx.positions + k)
        emb = draft.embed_tokens(_shift(token_ids, k))  # [B, T, D]
        q, kk, vv = attn.project(layer.attn_input(emb, f), cos, sin)
        if k == 0:
            k0, v0 = kk, vv
        else:
            k_diag.append(kk)
            v_diag.append(vv)
        o = ttt_attention(q, k0, v0, mask0, k_diag, v_diag)  # [B, T, N, H]
        f = layer.finish(f, attn.o_proj(o.reshape(B, T, -1)))  # [B, T, D]: the next step's input
        yield head(f)  # [B, T, Vd]


def ttt_loss(draft: Eagle3Draft, batch: Mapping[str, jax.Array], features: jax.Array,
             target_logits: jax.Array | TargetHead,
             *, steps: int = 7, decay: float = 0.8, objective: Objective = "kl_div", temperature: float = 1.0,
             unroll: Unroll = ttt_unroll) -> tuple[jax.Array, dict[str, jax.Array]]:
    """EAGLE-3 training-time-test loss over one packed batch (jit / grad friendly, no cache).

    batch: data_prep's packed columns `target_ids`, `positions`, `segment_ids`, `loss_mask` [B, T]
    (target_ids[p] = t_{p+1}); features [B, T, num_aux·D_t]; target_logits: the target's logits at every
    position, [B, T, V] or factored (models/draft_losses.py `TargetHead`, hidden [B, T, D_t]).

    Step k at position p (see `ttt_unroll`; `unroll` swaps in another draft's steps, e.g. P-EAGLE's
    parallel depths) consumes target_ids[p + k] and is scored against the target's logits at p + 1 + k
    restricted to the draft vocabulary (columns `target_token_ids`), under the mask
    m = loss_mask[p + 1 + k] ∧ (p + 1 + k in p's segment) ∧ (the target's full-vocabulary argmax there is
    in the draft vocabulary). The per-position loss is `objective` (models/draft_losses.py; default the
    forward KL, EAGLE-3's soft-label objective) at serving `temperature`.

    Returns (Σ_k decay^k Σ_{b,p} m · loss, stats) with stats (each [steps], fp32): `loss` the
    unweighted per-step sums, `acc_num` masked positions where the draft argmax equals the restricted
    target argmax, `acc_den` masked positions. The caller divides by its token count.
    """
    if steps < 1:
        raise ValueError("steps must be >= 1")
    ids, positions = batch["target_ids"], batch["positions"]
    seg, loss_mask = batch["segment_ids"], batch["loss_mask"] != 0

    # labels, once: the target restricted to the draft vocabulary (ascending target ids == t2d columns)
    restricted, in_draft = restricted_targets(target_logits, draft.target_token_ids, draft.t2d[...])  # [B,T,Vd]
    label_arg = jnp.argmax(restricted, axis=-1)  # [B, T]
    scored = loss_mask & in_draft  # [B, T]: position q may be a label

    total = jnp.zeros((), jnp.float32)
    losses, nums, dens = [], [], []
    B, T = ids.shape
    flat_restricted = restricted.reshape(B * T, -1)  # [B·T, Vd]
    flat_label = label_arg.reshape(-1)  # [B·T]
    hidden = unroll(draft, ids, features, positions=positions, segment_ids=seg, steps=steps, head=lambda h: h)
    for k, h in enumerate(hidden):
        s = 1 + k  # label position offset
        m = (_shift(scored, s) & (_shift(seg, s) == seg) & (seg != 0)).astype(jnp.float32)  # [B, T]
        loss_k, num_k = _scored_positions(draft, h, m, flat_restricted, flat_label, s, objective, temperature)
        total = total + (decay**k) * loss_k
        losses.append(loss_k)
        nums.append(num_k)
        dens.append(jnp.sum(m))
    stats = {"loss": jnp.stack(losses), "acc_num": jnp.stack(nums), "acc_den": jnp.stack(dens)}
    return total, stats


def _scored_positions(draft: Eagle3Draft, h: jax.Array, m: jax.Array, flat_restricted: jax.Array,
                      flat_label: jax.Array, s: int, objective: Objective,
                      temperature: float) -> tuple[jax.Array, jax.Array]:
    """(Σ m · loss, Σ m · [draft argmax = label]) of one TTT step, the LM head and the loss computed only at the
    positions m scores. h [B, T, D] the step's hidden state, m [B, T] its mask, flat_restricted [B·T, Vd] and
    flat_label [B·T] the labels, which for position p sit at p + s.

    Only a third of the positions of a traces batch are answer tokens (the rest prompt and padding), and the
    head over the draft vocabulary and its softmax were 80 % of a TTT step. The scored positions are packed
    into a quarter or a half of the rows (`jnp.nonzero` with a fixed size, so the program has one shape) when
    they fit, else every row is computed: `lax.switch` picks at run time, the same sums either way."""
    B, T, D = h.shape
    n = B * T
    flat_m = m.reshape(n)
    count = jnp.sum(flat_m > 0)

    def packed(rows: int):
        def run(h: jax.Array) -> tuple[jax.Array, jax.Array]:
            idx = jnp.nonzero(flat_m > 0, size=rows, fill_value=0)[0]  # [rows]
            w = flat_m[idx] * (jnp.arange(rows) < count)  # [rows]: padding rows weigh nothing
            logits = draft.lm_head(draft.norm(h.reshape(n, D)[idx])).astype(jnp.float32)  # [rows, Vd]
            label_rows = jnp.minimum(idx + s, n - 1)  # a scored p has p + s in its own row of the batch
            per_pos = draft_loss(logits, flat_restricted[label_rows], objective, temperature)  # [rows]
            correct = (jnp.argmax(logits, axis=-1) == flat_label[label_rows]).astype(jnp.float32)
            return jnp.sum(w * per_pos), jnp.sum(w * correct)
        return run

    def every(h: jax.Array) -> tuple[jax.Array, jax.Array]:
        logits = draft.lm_head(draft.norm(h)).astype(jnp.float32)  # [B, T, Vd]
        restricted = _shift(flat_restricted.reshape(B, T, -1), s)
        per_pos = draft_loss(logits, restricted, objective, temperature)  # [B, T]
        correct = (jnp.argmax(logits, axis=-1) == _shift(flat_label.reshape(B, T), s)).astype(jnp.float32)
        return jnp.sum(m * per_pos), jnp.sum(m * correct)

    quarter, half = -(-n // 4), -(-n // 2)
    branch = (count > quarter).astype(jnp.int32) + (count > half).astype(jnp.int32)
    return jax.lax.switch(branch, [packed(quarter), packed(half), every], h)
