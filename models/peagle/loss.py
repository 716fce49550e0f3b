"""P-EAGLE's training-time view: every anchor at every parallel depth in one pass, a drop-in `unroll`
for models/eagle3/loss.py `ttt_loss` (whose labels for depth d sit at p + 1 + d).

Depth d at anchor p attends to the depth-0 keys of positions <= p in p's segment and to the depth 1..d
keys of the same anchor: the EAGLE-3 training-time-test attention (`ttt_attention`) with the mask token
and `mask_hidden` as inputs in place of the fed-back ones. Mirrors vllm-project/speculators 0.9.0
`models/peagle/core.py` (the parallel-group forward) and `models/peagle/attention.py` (its mask), with
every anchor kept at every depth (speculators subsamples them: COD sampling).

Shape legend: B batch, T length, D draft width, N heads, H head dim, Vd draft vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp

from models.decoder import build_context
from models.eagle3.loss import ttt_attention
from models.peagle.model import PEagleDraft


def parallel_unroll(draft: PEagleDraft, token_ids: jax.Array, features: jax.Array, *, positions: jax.Array,
                    segment_ids: jax.Array | None, steps: int,
                    head: Callable[[jax.Array], jax.Array] | None = None) -> Iterator[jax.Array]:
    """Yield the draft logits [B, T, Vd] of depths 0..steps-1 at every anchor p (no cache; a drop-in
    `unroll` for models/eagle3/loss.py `ttt_loss`, whose labels for depth d sit at p + 1 + d). `head` maps
    a depth's hidden state [B, T, D] to what is yielded (default: norm and LM head, the logits).

    Depth 0: token token_ids[p] (= t_{p+1}) and fc(features_p) at rotary position positions[p]. Depth d:
    the mask token and fc(mask_hidden) at positions[p] + d, attending to the depth-0 keys of positions
    ≤ p in p's segment plus the keys of depths 1..d at p.
    """
    B, T = token_ids.shape
    head = head or (lambda h: draft.lm_head(draft.norm(h)))
    attn, layer = draft.midlayer.self_attn, draft.midlayer
    ctx, _ = build_context(T, B, positions=positions, segment_ids=segment_ids, cache=None, windows=set())
    mask0 = ctx.mask()  # [B, T, T] causal within segments
    f0 = draft.fuse(features)  # [B, T, D]
    q, k0, v0 = attn.project(layer.attn_input(draft.embed_tokens(token_ids), f0), *draft.rope(ctx.positions))
    o = ttt_attention(q, k0, v0, mask0, [], [])  # [B, T, N, H]
    yield head(layer.finish(f0, attn.o_proj(o.reshape(B, T, -1))))
    if steps == 1:
        return
    fm = jnp.broadcast_to(draft.fuse(draft.mask_hidden[...][None, None]), f0.shape)  # [B, T, D]
    em = draft.embed_tokens(jnp.full((B, T), draft.config.mask_token_id, jnp.int32))  # [B, T, D]
    a_mask = layer.attn_input(em, fm)  # [B, T, 2D]: the same input at every anchor
    k_diag: list[jax.Array] = []
    v_diag: list[jax.Array] = []
    for d in range(1, steps):
        q, kk, vv = attn.project(a_mask, *draft.rope(ctx.positions + d))
        k_diag.append(kk)
        v_diag.append(vv)
        o = ttt_attention(q, k0, v0, mask0, k_diag, v_diag)
        yield head(layer.finish(fm, attn.o_proj(o.reshape(B, T, -1))))
