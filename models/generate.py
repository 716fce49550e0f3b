"""KV cache and batched autoregressive generation (greedy, temperature, nucleus) in one jitted loop.

The model API this relies on (models/llama.py): `model(ids [B, T], positions=[B, T],
segment_ids=[B, T], cache=KVCache) -> (logits [B, T, V], KVCache)`. The cache is written at each
row's current `length`, so rolling a row back is just lowering its length (models/speculative.py).

    out = generate(model, prompt_ids, prompt_lengths=lengths, max_new_tokens=32)
    out.tokens  # [B, 32] int32, pad after eos

Prefill is one forward over the (left- or right-padded) prompt block; decoding is a
`lax.while_loop` inside the same `jax.jit`, compiled once per (shapes, static options).

Shape legend: B batch, T prompt length, M max_new_tokens, S cache length, L layers, K kv heads,
H head dim, D model, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# ------------------------------------------------------------------------------------------------
# KV cache
# ------------------------------------------------------------------------------------------------


def pools_slots(config: Any) -> bool:
    """Whether a family's cache keeps state built from consecutive slots (`config.cache_extra`: DeepSeek-V4's
    compressed windows): a row's tokens must then sit in consecutive slots from slot 0 (no left padding, no
    tree branches side by side)."""
    return getattr(config, "cache_extra", None) is not None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    k: jax.Array  # [L, B, K, S, H] (head-major: attention reads a layer's slice without a transpose)
    v: jax.Array  # [L, B, K, S, Hv] (MLA: k = latent [L, B, 1, S, kv_lora], v = rope key [L, B, 1, S, R])
    valid: jax.Array  # [B, S] bool: slot holds a real (non-padding) token
    length: jax.Array  # [B] int32: next slot to write per row
    # A family's own state beyond one entry per slot (a pytree of arrays, batch on axis 0; DeepSeek-V4's compressed
    # entries and open compression windows). The family keys it by slot so that `rollback` needs no change.
    extra: Any = None

    @classmethod
    def init(cls, config: Any, batch: int, max_len: int, dtype: Any = jnp.float32, call_width: int = 1, *,
             layers: int | None = None) -> KVCache:
        """An empty cache of `layers` layers (default config.num_hidden_layers). `config.kv_cache_dims()`
        ((Kk, Hk), (Kv, Hv)) overrides the (K, H) per token of k and v: MLA caches its compressed latent
        and its single rope key instead. `config.cache_extra(batch, max_len, dtype, call_width)` builds
        `extra`; `call_width` is the widest call a later `rollback` may cut into (speculative verification:
        k + 1; decoding: 1)."""
        dims = getattr(config, "kv_cache_dims", None)
        (kk, hk), (kv, hv) = dims() if dims else ((config.num_key_value_heads, config.head_dim),) * 2
        L = config.num_hidden_layers if layers is None else layers
        extra = getattr(config, "cache_extra", None)
        return cls(
            k=jnp.zeros((L, batch, kk, max_len, hk), dtype),
            v=jnp.zeros((L, batch, kv, max_len, hv), dtype),
            valid=jnp.zeros((batch, max_len), bool),
            length=jnp.zeros((batch,), jnp.int32),
            extra=extra(batch, max_len, dtype, call_width) if extra else None,
        )

    def rows(self, idx: jax.Array) -> KVCache:
        """The cache rows idx [B'] (repeats allowed: a beam's copy of its parent's, a prompt's for its samples)."""
        return KVCache(k=self.k[:, idx], v=self.v[:, idx], valid=self.valid[idx], length=self.length[idx],
                       extra=jax.tree.map(lambda a: a[idx], self.extra))

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def advance(self, slots: jax.Array, valid: jax.Array) -> KVCache:
        """Mark slots [B, T] as holding this call's tokens (valid [B, T]) and move length past them."""
        rows = jnp.arange(slots.shape[0])[:, None]
        new_valid = self.valid.at[rows, slots].set(valid, mode="drop")
        return dataclasses.replace(self, valid=new_valid, length=self.length + slots.shape[1])

    def write(self, layer: int, slots: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
        """Store k, v [B, T, K, H] of one layer at slots [B, T]."""
        rows = jnp.arange(slots.shape[0])[:, None]
        # advanced indices around a slice: the update is laid out [B, T, K, H], like k and v
        return dataclasses.replace(
            self,
            k=self.k.at[layer, rows, :, slots].set(k.astype(self.k.dtype), mode="drop"),
            v=self.v.at[layer, rows, :, slots].set(v.astype(self.v.dtype), mode="drop"),
        )

    def rollback(self, length: jax.Array) -> KVCache:
        """Forget every slot at or beyond `length` [B]; stale slots are never attended to (causality). `extra`
        stays: its family keys it by slot, and rewrites what the next calls overwrite."""
        return dataclasses.replace(self, length=jnp.asarray(length, jnp.int32))


@functools.partial(jax.jit, static_argnames=("graphdef", "return_hidden"))
def _shared_forward(graphdef, state, input_ids, positions=None, segment_ids=None, cache=None, return_hidden=()):
    """`jit_forward`'s program, keyed by the model's structure: every model with an equal graphdef (the
    same family, config and dtypes; the weights are the traced `state`) reuses one compiled program
    per shape, as a training run's many evaluations of fresh snapshots and a test's twin models do."""
    model = nnx.merge(graphdef, state)
    return model(input_ids, positions=positions, segment_ids=segment_ids, cache=cache, return_hidden=return_hidden)


def jit_forward(model: nnx.Module):
    """A jitted `model(input_ids, **kw)` (one compile per shape and `return_hidden`, shared by every model
    of the same structure).

    It snapshots the model's state now: re-create it after the weights change.
    """
    graphdef, state = nnx.split(model)
    try:
        hash(graphdef)
    except TypeError:  # a module holding an unhashable static attribute: its own program
        @functools.partial(jax.jit, static_argnames=("return_hidden",))
        def forward(state, input_ids, positions=None, segment_ids=None, cache=None, return_hidden=()):
            return _shared_forward.__wrapped__(graphdef, state, input_ids, positions, segment_ids, cache,
                                               return_hidden)

        return lambda input_ids, **kw: forward(state, input_ids, **kw)
    return lambda input_ids, **kw: _shared_forward(graphdef, state, input_ids, **kw)


# ------------------------------------------------------------------------------------------------
# Sampling
# ------------------------------------------------------------------------------------------------


def sample_token(
    logits: jax.Array, rng: jax.Array | None, *, temperature: float | jax.Array = 0.0,
    top_p: float | jax.Array = 1.0, greedy: bool = False, use_top_p: bool = False,
) -> jax.Array:
    """logits [B, V] -> tokens [B] int32. `greedy` and `use_top_p` are static switches.

    Nucleus: keep the smallest set of most probable tokens whose mass reaches top_p (the top token
    always stays), then sample from the renormalised distribution.
    """
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if use_top_p:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]  # [B, V] descending
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < top_p
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)  # [B, 1]
        logits = jnp.where(logits >= threshold, logits, -jnp.inf)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


# ------------------------------------------------------------------------------------------------
# generate
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class GenerateOutput:
    tokens: jax.Array  # [B, M] int32, pad_token_id after eos
    lengths: jax.Array  # [B] int32, generated tokens per row including the eos
    hidden: list[jax.Array] | None = None  # per return_hidden index: [B, T + M, D]


def _eos_array(eos_token_id: int | Sequence[int] | None) -> jax.Array:
    if eos_token_id is None:
        return jnp.full((1,), -1, jnp.int32)
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    return jnp.asarray(ids, jnp.int32)


def generate(
    model: nnx.Module,
    prompt_ids: jax.Array,
    *,
    max_new_tokens: int,
    prompt_lengths: jax.Array | None = None,
    padding_side: str = "left",
    temperature: float = 0.0,
    top_p: float = 1.0,
    rng: jax.Array | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    return_hidden: tuple[int, ...] = (),
    num_samples: int = 1,
) -> GenerateOutput:
    """Generate up to `max_new_tokens` per row of `prompt_ids` [B, T].

    Rows shorter than T are padded on `padding_side` ("left" or "right") and `prompt_lengths` [B]
    gives the real lengths (default: all T); a model whose cache pools consecutive slots (`config.cache_extra`:
    DeepSeek-V4) decodes left-padded rows right-padded instead, so its windows start at each row's first token.
    temperature 0 is greedy; otherwise sampling with `rng` (default PRNGKey(0)) and optional nucleus `top_p` < 1.
    A row stops after emitting any of `eos_token_id` (None: never stops early); later slots hold `pad_token_id`
    (default: the model config's pad id, else 0). `return_hidden` (see the model's call) adds the hidden states at
    those indices for every token of concat(prompt_ids, tokens): [B, T + M, D] each, zeros after a
    row has stopped.

    `num_samples` n > 1 (vLLM's `n`): n completions per prompt, rows [B·n] with prompt b's at b·n .. b·n+n-1,
    each prompt prefilled once and its KV cache repeated for its n samples (GRPO's groups: the prefill costs
    1/n of repeating the prompts, the tokens are those of generating from the repeated prompts with the same
    rng). Not with `return_hidden`.
    """
    prompt_ids = jnp.asarray(prompt_ids, jnp.int32)
    B, T = prompt_ids.shape
    if num_samples < 1 or (num_samples > 1 and return_hidden):
        raise ValueError(f"num_samples must be >= 1 (and 1 with return_hidden), got {num_samples}")
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    lengths = jnp.full((B,), T) if prompt_lengths is None else prompt_lengths
    lengths = jnp.asarray(lengths, jnp.int32)
    if pad_token_id is None:
        pad_token_id = getattr(model.config, "pad_token_id", None) or 0
    greedy = float(temperature) == 0.0
    if rng is None:
        rng = jax.random.PRNGKey(0)
    realign = padding_side == "left" and pools_slots(model.config)
    if realign:  # a cache pooling windows of consecutive slots (DeepSeek-V4's compressed entries) would pool a
        # left-padded row's padding with its first tokens: decode the rows right-padded (the same tokens)
        pad = (T - lengths)[:, None]  # [B, 1]
        prompt_ids = jnp.take_along_axis(prompt_ids, (jnp.arange(T)[None, :] + pad) % T, axis=1)
        padding_side = "right"
    graphdef, state = nnx.split(model)
    tokens, out_lengths, hidden = _generate_jit(
        graphdef, state, prompt_ids, lengths, rng, jnp.float32(temperature if not greedy else 1.0),
        jnp.float32(top_p), _eos_array(eos_token_id), jnp.int32(pad_token_id),
        max_new_tokens=max_new_tokens, padding_side=padding_side, greedy=greedy,
        use_top_p=not greedy and float(top_p) < 1.0, return_hidden=tuple(return_hidden), num_samples=num_samples,
    )
    if realign and return_hidden:  # the prompt's hidden states back in the caller's (left-padded) slots
        slots = jnp.arange(hidden[0].shape[1])[None, :]  # [1, T + M]
        back = jnp.where(slots < T, (slots - pad) % T, slots)  # [B, T + M]
        hidden = [jnp.take_along_axis(h, back[:, :, None], axis=1) for h in hidden]
    return GenerateOutput(tokens=tokens, lengths=out_lengths, hidden=hidden if return_hidden else None)


@functools.partial(
    jax.jit,
    static_argnames=("graphdef", "max_new_tokens", "padding_side", "greedy", "use_top_p", "return_hidden",
                     "num_samples"),
)
def _generate_jit(graphdef, state, prompt_ids, prompt_lengths, rng, temperature, top_p, eos_ids, pad_id, *,
                  max_new_tokens, padding_side, greedy, use_top_p, return_hidden, num_samples=1):
    model = nnx.merge(graphdef, state)
    B, T = prompt_ids.shape
    M = max_new_tokens
    want_hidden = bool(return_hidden)
    sample = functools.partial(sample_token, temperature=temperature, top_p=top_p, greedy=greedy,
                               use_top_p=use_top_p)
    is_eos = lambda tok: jnp.any(tok[:, None] == eos_ids[None, :], axis=-1)

    # -- prefill: one forward over the padded prompt block --------------------------------------
    t = jnp.arange(T, dtype=jnp.int32)[None, :]
    if padding_side == "left":
        pad = (T - prompt_lengths)[:, None]
        real = t >= pad  # [B, T]
        positions = jnp.maximum(t - pad, 0)
        last = jnp.full((B,), T - 1, jnp.int32)
    else:
        real = t < prompt_lengths[:, None]
        positions = t
        last = prompt_lengths - 1
    cache = KVCache.init(model.config, B, T + M + int(want_hidden), model.dtype)
    # the LM head on each row's last prompt position only: the model's [B, T, V] logits go unused, so the
    # compiled program never computes them (at 128k+ vocabularies and long prompts, the prefill's largest tensor)
    out = model(prompt_ids, positions=positions, segment_ids=real.astype(jnp.int32), cache=cache,
                return_hidden=(*return_hidden, -1))
    cache, final = out[1], out[2][-1]  # final normed hidden [B, T, D]
    if padding_side == "right":
        cache = cache.rollback(prompt_lengths)  # decode overwrites the right padding
    final = final[jnp.arange(B), last]  # [B, D]: the last prompt position's
    if num_samples > 1:  # each prompt's cache, length and last hidden repeated for its samples: [B] -> [B·n]
        rep = functools.partial(jnp.repeat, repeats=num_samples, axis=0)
        cache = cache.rows(rep(jnp.arange(B)))  # k, v: [L, B·n, ...]
        final, prompt_lengths, B = rep(final), rep(prompt_lengths), B * num_samples
    rng, key = jax.random.split(rng)
    first = sample(model.lm_logits(final), key)  # [B]
    done = is_eos(first)
    tokens = jnp.full((B, M + 1), pad_id, jnp.int32).at[:, 0].set(first)  # one spare column
    D = model.config.hidden_size
    hidden = [  # [B, T + M, D] each
        jnp.concatenate([h, jnp.zeros((B, M, D), h.dtype)], axis=1)
        for h in out[2][:-1]
    ] if want_hidden else []

    # -- decode: step i feeds token i-1 and samples token i; with return_hidden a last step i = M
    # only feeds token M-1 so that every emitted token has its hidden state ------------------------
    def cond(carry):
        i, _, _, done, n_out, _, _ = carry
        if want_hidden:
            return (i <= M) & jnp.any(n_out >= i)  # some row still has a real token i-1 to feed
        return (i < M) & ~jnp.all(done)

    def body(carry):
        i, cache, tokens, done, n_out, rng, hidden = carry
        prev = jax.lax.dynamic_index_in_dim(tokens, i - 1, axis=1, keepdims=False)  # [B]
        pos = (prompt_lengths + i - 1)[:, None]
        out = model(prev[:, None], positions=pos, cache=cache, return_hidden=return_hidden)
        logits, cache = out[0], out[1]
        if want_hidden:
            fed = (n_out >= i)[:, None, None]
            hidden = [
                jax.lax.dynamic_update_slice_in_dim(h, jnp.where(fed, new, 0).astype(h.dtype), T + i - 1, 1)
                for h, new in zip(hidden, out[2], strict=True)
            ]
        rng, key = jax.random.split(rng)
        active = ~done & (i < M)
        tok = jnp.where(active, sample(logits[:, 0], key), pad_id)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, tok[:, None], i, 1)
        n_out = n_out + active.astype(jnp.int32)
        done = done | (active & is_eos(tok))
        return i + 1, cache, tokens, done, n_out, rng, hidden

    carry = (jnp.int32(1), cache, tokens, done, jnp.ones((B,), jnp.int32), rng, hidden)
    _, _, tokens, _, n_out, _, hidden = jax.lax.while_loop(cond, body, carry)
    return tokens[:, :M], n_out, hidden
