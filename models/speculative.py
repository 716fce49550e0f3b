"""Greedy speculative decoding: a small draft proposes k tokens, the target verifies k+1 at once.

Reference: /work/shared/reference/speculative-and-quantization-formats.md Part A (A10: acceptance
length τ = mean tokens emitted per target forward). The output is token-for-token the target's
greedy output (`generate(target, ..., temperature=0)`); only the number of target calls changes.

One iteration, with x the newest emitted token (not yet in either cache) and a the token before it:
  1. draft: feed [a, x] (a is re-written: the draft cache may lack it), then k-1 single tokens,
     proposing d1..dk greedily;
  2. target: one cached forward over [x, d1..dk] -> greedy predictions p0..pk;
  3. accept n = longest prefix with d(j+1) == p(j); emit p0..pn (the n drafts + the bonus token);
  4. roll both caches back by length: target keeps x, d1..dn; draft keeps everything before dn.
Everything runs in one `jax.jit` (`lax.while_loop`), so timing it against `generate` is fair.

Shape legend: T prompt length, M max_new_tokens, k draft length, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from models.generate import KVCache, _eos_array


@dataclasses.dataclass
class SpecOutput:
    tokens: jax.Array  # [1, M] int32, pad after eos
    lengths: jax.Array  # [1] int32
    num_target_calls: int  # verify forwards (the prefill is not counted)
    accepted_per_call: jax.Array  # [num_target_calls] tokens emitted by each verify call (1..k+1)

    @property
    def mean_acceptance_length(self) -> float:
        """τ: mean tokens emitted per target verify call."""
        return float(jnp.mean(self.accepted_per_call)) if self.num_target_calls else 0.0


def speculative_generate(
    target: nnx.Module,
    draft: nnx.Module,
    prompt_ids: jax.Array,
    *,
    max_new_tokens: int,
    k: int = 4,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
) -> SpecOutput:
    """Greedy speculative decoding for one unpadded prompt [1, T]; both models share the vocab."""
    prompt_ids = jnp.asarray(prompt_ids, jnp.int32)
    if prompt_ids.ndim != 2 or prompt_ids.shape[0] != 1:
        raise ValueError(f"speculative_generate takes one prompt [1, T], got {prompt_ids.shape}")
    if k < 1 or max_new_tokens < 1:
        raise ValueError("k and max_new_tokens must be >= 1")
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError("target and draft must share the vocabulary")
    if pad_token_id is None:
        pad_token_id = getattr(target.config, "pad_token_id", None) or 0
    t_graph, t_state = nnx.split(target)
    d_graph, d_state = nnx.split(draft)
    tokens, n_out, calls, accepted = _speculative_jit(
        t_graph, t_state, d_graph, d_state, prompt_ids, _eos_array(eos_token_id), jnp.int32(pad_token_id),
        max_new_tokens=max_new_tokens, k=k)
    calls = int(calls)
    return SpecOutput(tokens=tokens, lengths=n_out[None], num_target_calls=calls,
                      accepted_per_call=accepted[:calls])


@functools.partial(jax.jit, static_argnames=("t_graph", "d_graph", "max_new_tokens", "k"))
def _speculative_jit(t_graph, t_state, d_graph, d_state, prompt_ids, eos_ids, pad_id, *, max_new_tokens, k):
    target, draft = nnx.merge(t_graph, t_state), nnx.merge(d_graph, d_state)
    T, M = prompt_ids.shape[1], max_new_tokens
    S = T + M + k + 1
    argmax = lambda logits: jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_eos = lambda tok: jnp.any(tok[..., None] == eos_ids, axis=-1)

    # -- prefill both; the draft forgets the last prompt token, it is re-fed as `a` ---------------
    logits, t_cache = target(prompt_ids, cache=KVCache.init(target.config, 1, S, target.dtype))
    _, d_cache = draft(prompt_ids, cache=KVCache.init(draft.config, 1, S, draft.dtype))
    d_cache = d_cache.rollback(d_cache.length - 1)
    x = argmax(logits[0, -1])
    out = jnp.full((M + k + 1,), pad_id, jnp.int32).at[0].set(x)
    carry = (out, jnp.int32(1), prompt_ids[0, -1], x, jnp.int32(T), t_cache, d_cache, is_eos(x),
             jnp.int32(0), jnp.zeros((M,), jnp.int32))

    def cond(c):
        _, n_out, *_, done, _, _ = c
        return (n_out < M) & ~done

    def body(c):
        out, n_out, a, x, pos, t_cache, d_cache, done, calls, accepted = c
        # 1. draft proposes d1..dk (pos = position of x = target cache length)
        d_logits, d_cache = draft(jnp.stack([a, x])[None], positions=(pos + jnp.arange(-1, 1))[None],
                                  cache=d_cache)
        d1 = argmax(d_logits[0, -1])

        def draft_step(j, st):
            drafts, d_cache = st
            lg, d_cache = draft(drafts[j - 1][None, None], positions=(pos + j)[None, None], cache=d_cache)
            return drafts.at[j].set(argmax(lg[0, -1])), d_cache

        drafts = jnp.zeros((k,), jnp.int32).at[0].set(d1)
        drafts, d_cache = jax.lax.fori_loop(1, k, draft_step, (drafts, d_cache))
        # 2. target verifies [x, d1..dk] in one forward
        block = jnp.concatenate([x[None], drafts])  # [k+1]
        t_logits, t_cache = target(block[None], positions=(pos + jnp.arange(k + 1))[None], cache=t_cache)
        preds = argmax(t_logits[0])  # [k+1]: p0..pk
        # 3. accept the longest matching prefix, plus the target's bonus token
        n = jnp.sum(jnp.cumprod((drafts == preds[:k]).astype(jnp.int32)))
        emit = n + 1
        eos_at = jnp.where(is_eos(preds) & (jnp.arange(k + 1) < emit), jnp.arange(k + 1), k + 1)
        first_eos = jnp.min(eos_at)
        emitted = jnp.minimum(emit, first_eos + 1)
        emitted_tokens = jnp.where(jnp.arange(k + 1) < emitted, preds, pad_id)
        out = jax.lax.dynamic_update_slice(out, emitted_tokens, (n_out,))
        accepted = accepted.at[calls].set(emit)
        # 4. roll back: target keeps x, d1..dn; the draft keeps everything before dn
        new_pos = pos + 1 + n
        t_cache = t_cache.rollback(new_pos[None])
        d_cache = d_cache.rollback((new_pos - 1)[None])
        new_a = jnp.where(n > 0, preds[jnp.maximum(n - 1, 0)], x)
        return (out, n_out + emitted, new_a, preds[n], new_pos, t_cache, d_cache, first_eos <= k,
                calls + 1, accepted)

    out, n_out, *_, calls, accepted = jax.lax.while_loop(cond, body, carry)
    n_out = jnp.minimum(n_out, M)
    tokens = jnp.where(jnp.arange(M) < n_out, out[:M], pad_id)
    return tokens[None], n_out, calls, accepted
