"""Speculative decoding with feature-level draft heads (EAGLE-3, DeepSeek/GLM MTP): batched chain
drafting with exact greedy or rejection-sampled verification, and EAGLE-2 dynamic draft trees.

Mirrors docs/speculative-decoding.md (the draft reads target features f_p and token t_{p+1} at
position p and predicts t_{p+2}; later steps feed its own hidden output back; draft vocabulary: draft
id -> target id through `d2t`; τ = mean tokens emitted per verify call, per-position acceptance).
Rejection sampling follows Leviathan et al. 2023 / Chen et al. 2023; the dynamic tree follows EAGLE-2
(Li et al. 2024).

    out = speculative_generate(target, draft, prompt_ids, max_new_tokens=64, k=5)       # greedy
    out = speculative_generate(target, draft, prompt_ids, max_new_tokens=64, temperature=1.0,
                               rng=jax.random.PRNGKey(0))                              # sampling
    out = speculative_generate(target, draft, prompt_ids[:1], max_new_tokens=64, mode="tree")
    out.tokens, out.mean_acceptance_length, out.per_position_acceptance

One chain iteration, per row, with x the newest emitted token at position P (the target cache holds
positions < P; the draft cache holds its entries < P - m, where m tokens were emitted last time):
  1. draft "extend": one call over the pending block of m entries (fixed width k+1, `segment_ids`
     mark the valid ones, the cache is rolled back to the true length afterwards). Entry p gets the
     target's real feature f_p and token t_{p+1}; its last entry (token x) proposes d1;
  2. k-1 autoregressive draft steps, each feeding the previous proposal and the draft's own
     `hidden_out` (greedy: argmax; sampling: a sample from the temperature-scaled draft q);
  3. ONE target forward over [x, d1..dk] (positions P..P+k) returning its logits and the features
     the draft reads (`return_hidden=draft.target_layers`, concatenated low -> high);
  4. verify: greedy accepts the longest prefix with d_{j+1} == argmax p_j; sampling accepts d_j
     with probability min(1, p/q) and resamples the first rejection from norm(max(0, p - q)) (or
     the bonus from p_k) - the emitted tokens are then distributed exactly as the target samples;
  5. emit accepted drafts + 1 token, roll the target cache back to P + n + 1 and the draft cache
     back to P; the pending block becomes the n + 1 emitted tokens with the verify's features.
Rows accept different counts: every cache length, position and output write is per row. The whole
loop (prefill included) is one `jax.jit` around a `lax.while_loop`.

Tree mode (EAGLE-2, greedy, batch 1): from the root x the draft expands the `tree_top_k` best
children of the `tree_top_k` best nodes of each depth (cumulative draft log-probability), for
`tree_depth` depths - each beam keeps its own copy of the draft cache, so the draft needs no tree
mask; the best `tree_tokens` candidates are verified in ONE target forward with a tree attention
mask (models/decoder.py `tree_mask`: every node sees the cached prefix and its ancestors, rotary
position = P + depth), the longest path matching the target's greedy predictions is accepted, and
its KV entries are compacted into contiguous target cache slots. The draft cache needs no
compaction: it keeps only real-feature entries and re-extends over the accepted path next time.

Shape legend: B batch, T prompt length, M max_new_tokens, k draft length (tree: depth), V target
vocab, Vd draft vocab, F target feature width (len(target_layers) · D_t), Dd draft hidden width,
S cache length, K tree_top_k, N tree_tokens, C tree candidates.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.decoder import DecoderLM, build_context
from models.generate import KVCache, _eos_array, pools_slots

# ------------------------------------------------------------------------------------------------
# Draft heads
# ------------------------------------------------------------------------------------------------


@runtime_checkable
class DraftHead(Protocol):
    """What speculative_generate needs from a draft (models.eagle3.Eagle3Draft, MTPDraft).

    `draft(input_ids [B, T], *, features=None [B, T, F], hidden=None [B, T, Dd], positions [B, T],
    segment_ids=None [B, T], cache=None) -> (logits [B, T, Vd], hidden_out [B, T, Dd], cache)`:
    exactly one of `features` (the target's hidden states at `target_layers`, concatenated) and
    `hidden` (the draft's own previous `hidden_out`). Entry p reads token t_{p+1} and predicts
    t_{p+2}. With a cache the tokens are written at each row's `cache.length` and `segment_ids != 0`
    marks the valid ones (like DecoderLM). Logits are over draft ids; `target_token_ids` [Vd] maps
    them to target ids.
    """

    @property
    def target_layers(self) -> tuple[int, ...]: ...

    @property
    def target_token_ids(self) -> jax.Array: ...

    def init_cache(self, batch: int, max_len: int) -> KVCache: ...

    def __call__(self, input_ids: jax.Array, *, features: jax.Array | None = None, hidden: jax.Array | None = None,
                 positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 cache: KVCache | None = None) -> tuple[jax.Array, jax.Array, KVCache | None]: ...


@runtime_checkable
class BlockDraft(Protocol):
    """A draft that proposes k tokens in ONE forward (P-EAGLE: models.peagle.PEagleDraft; DFlash:
    models.dflash.DFlashDraft). Besides `target_layers`, `target_token_ids` and `init_cache` (as DraftHead):

    `context(input_ids [B, T], features [B, T, F], *, positions [B, T], segment_ids=None [B, T], cache)
    -> cache`: write real entries (entry p: token t_{p+1}, feature f_p) at each row's cache.length.

    `propose(input_ids [B, W], features [B, W, F], num_valid [B], *, cache, k) -> (logits [B, k, Vd],
    cache)`: the pending block (entries j < num_valid[b] real, at positions cache.length + j) is written to
    the cache, and ONE forward drafts the k tokens after the newest token x (the token of the last real
    entry, at position P = cache.length + num_valid): logits[:, i] is the draft for position P + 1 + i.
    `max_block`: the largest k it was trained for.
    """

    @property
    def target_layers(self) -> tuple[int, ...]: ...

    @property
    def target_token_ids(self) -> jax.Array: ...

    @property
    def max_block(self) -> int: ...

    def init_cache(self, batch: int, max_len: int) -> KVCache: ...

    def context(self, input_ids: jax.Array, features: jax.Array, *, positions: jax.Array,
                segment_ids: jax.Array | None = None, cache: KVCache) -> KVCache: ...

    def propose(self, input_ids: jax.Array, features: jax.Array, num_valid: jax.Array, *, cache: KVCache,
                k: int) -> tuple[jax.Array, KVCache]: ...


def tree_unsupported(target: object) -> str | None:
    """Why `mode='tree'` cannot verify against `target`, or None when it can: a target whose cache keeps state
    built from consecutive slots (`config.cache_extra`, DeepSeek-V4's compressed windows) would mix a tree's
    branches, which sit in consecutive slots, into one window."""
    if pools_slots(getattr(target, "config", None)):
        return (f"{type(target).__name__}: its cache keeps state built from consecutive slots (compressed "
                "windows), which a tree's branches would mix")
    return None


def is_block_draft(draft: object) -> bool:
    """True for drafts that propose a whole block per forward (`BlockDraft`), False for chain drafts."""
    return callable(getattr(draft, "propose", None)) and callable(getattr(draft, "context", None))


class MTPDraft(nnx.Module):
    """A DeepSeek-V3 / V3.2 or GLM-4.5 / GLM-5 target's own multi-token-prediction layer as a DraftHead (V3.2 and
    GLM-5's layer runs its own DSA indexer over its own cache; DeepSeek-V4 builds none: transformers drops its
    published `mtp.*` layer and defines no structure for it, docs/models/deepseek-v4.md).

    Entry p: u = eh_proj([enorm(embed(t_{p+1})), hnorm(h)]) -> the MTP decoder block (its own
    attention over a 1-layer KV cache) -> shared_head.norm -> the target's LM head. `h` is the
    target's final normed hidden f_p (`target_layers = (-1,)`) on the first step and the previous
    step's output after shared_head.norm afterwards, as transformers' `MTPCandidateGenerator` feeds
    it back (models/decoder.py MTPLayer). The vocabulary is the target's (identity map).
    """

    def __init__(self, target: DecoderLM, depth: int = 0):
        if not 0 <= depth < target.num_mtp_layers:
            raise ValueError(f"MTPDraft depth {depth}: the target has {target.num_mtp_layers} MTP layers "
                             "(DeepSeek-V3 / V3.2, GLM-4.5 / GLM-5 build them with num_mtp_layers >= 1, or from a "
                             "checkpoint that holds them; DeepSeek-V4's published MTP layer is not built)")
        self.target = target
        self.depth = depth

    @property
    def target_layers(self) -> tuple[int, ...]:
        return (-1,)

    @property
    def target_token_ids(self) -> jax.Array:
        return jnp.arange(self.target.config.vocab_size, dtype=jnp.int32)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        # one layer of the target's geometry (not a config with num_hidden_layers=1: per-layer fields such as
        # GLM-5's indexer_types or V3.2's mlp_layer_types would no longer fit it)
        return KVCache.init(self.target.config, batch, max_len, self.target.dtype, layers=1)

    def __call__(self, input_ids: jax.Array, *, features: jax.Array | None = None, hidden: jax.Array | None = None,
                 positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
                 cache: KVCache | None = None) -> tuple[jax.Array, jax.Array, KVCache | None]:
        if (features is None) == (hidden is None):
            raise ValueError("MTPDraft: pass exactly one of features / hidden")
        h = features if features is not None else hidden  # [B, T, D]
        B, T = input_ids.shape
        t = self.target
        layer = t.layers[t.config.num_hidden_layers + self.depth]
        ctx, cache = build_context(T, B, positions=positions, segment_ids=segment_ids, cache=cache, windows=set())
        ctx.rope = t.rope(ctx.positions)
        u = layer.eh_proj(jnp.concatenate([layer.enorm(t.embed_tokens(input_ids)), layer.hnorm(h)], axis=-1))
        u, cache = layer(u, ctx, cache, 0)  # [B, T, D]; layer index 0 of the draft's own 1-layer cache
        normed = layer.shared_head.norm(u)
        return t.lm_logits(normed), normed, cache


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SpecOutput:
    """`emitted[i, b]`: tokens verify call i produced for row b (accepted drafts + 1, cut at the row's
    eos; 0 once the row is done). The prefill's first token is not counted, and a row's last call may
    produce more than its remaining max_new_tokens budget (the surplus is dropped from `tokens`).
    `position_accepted[j]`: (call, active row) pairs whose draft position j (tree: depth j+1) was
    accepted; `position_drafted[j]`: pairs that drafted it. `drafts[i, b]`: the k target ids call i
    verified for row b (tree: the best-scoring candidate of each depth)."""

    tokens: jax.Array  # [B, M] int32, pad after eos
    lengths: jax.Array  # [B] int32, generated tokens per row including the eos
    num_target_calls: int  # verify forwards (the prefill is not counted)
    emitted: np.ndarray  # [num_target_calls, B] int32
    position_accepted: np.ndarray  # [k] int
    position_drafted: np.ndarray  # [k] int
    drafts: np.ndarray  # [num_target_calls, B, k] int32

    @property
    def mean_acceptance_length(self) -> float:
        """τ: mean over (verify call, active row) of the tokens that call emitted for that row."""
        active = self.emitted > 0
        return float(self.emitted.sum() / active.sum()) if active.any() else 0.0

    @property
    def per_position_acceptance(self) -> np.ndarray:
        """[k]: the share of drafts whose position j was accepted (j = 0: the first draft token)."""
        return self.position_accepted / np.maximum(self.position_drafted, 1)


# ------------------------------------------------------------------------------------------------
# Verification (pure functions)
# ------------------------------------------------------------------------------------------------


def verify_greedy(draft_tokens: jax.Array, target_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """draft_tokens [B, k], target_logits [B, k+1, V] -> (num_accepted [B], tokens [B, k+1]).

    Accept the longest prefix with d_{j+1} == argmax p_j; tokens[:, :n+1] are the emitted ones
    (the accepted drafts, then the target's own next token), i.e. the target's greedy predictions."""
    preds = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    n = jnp.sum(jnp.cumprod((draft_tokens == preds[:, :-1]).astype(jnp.int32), axis=1), axis=1)
    return n, preds


def verify_sampled(draft_tokens: jax.Array, q: jax.Array, p: jax.Array, key: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
    """Speculative sampling: draft_tokens [B, k] sampled from q [B, k, V], target probabilities
    p [B, k+1, V] -> (num_accepted [B], tokens [B, k+1]).

    Draft j is accepted with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection n the
    token is drawn from normalize(max(0, p_n - q_n)), and when all k are accepted the bonus from
    p_k. tokens[:, :n+1] (accepted drafts, then that token) are distributed as target samples;
    later entries are 0."""
    B, k = draft_tokens.shape
    key_u, key_r = jax.random.split(key)
    d = draft_tokens[..., None]
    q_d = jnp.take_along_axis(q, d, axis=-1)[..., 0]  # [B, k]
    p_d = jnp.take_along_axis(p[:, :k], d, axis=-1)[..., 0]  # [B, k]
    u = jax.random.uniform(key_u, (B, k), jnp.float32)
    ok = u * q_d < p_d  # u < p/q without dividing; always true where p >= q
    n = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)  # [B]
    rows = jnp.arange(B)
    p_n = p[rows, n]  # [B, V]
    q_n = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)[rows, n]  # [B, V]; q_k = 0: bonus from p_k
    resid = jnp.maximum(p_n - q_n, 0.0)
    mass = jnp.sum(resid, axis=-1, keepdims=True)
    resid = jnp.where(mass > 0, resid / jnp.where(mass > 0, mass, 1.0), p_n)  # p == q: never rejected anyway
    last = jax.random.categorical(key_r, jnp.log(resid), axis=-1).astype(jnp.int32)  # [B]
    j = jnp.arange(k + 1)[None, :]
    drafts = jnp.concatenate([draft_tokens, jnp.zeros((B, 1), jnp.int32)], axis=1)  # [B, k+1]
    tokens = jnp.where(j < n[:, None], drafts, jnp.where(j == n[:, None], last[:, None], 0))
    return n, tokens.astype(jnp.int32)


def scaled_logits(logits: jax.Array, temperature: jax.Array, top_p: jax.Array, use_top_p: bool) -> jax.Array:
    """logits [..., V] / temperature in fp32, with -inf outside the nucleus when `use_top_p` (the
    smallest set of most probable tokens whose mass reaches top_p; the top token always stays), as
    models.generate.sample_token samples."""
    logits = logits.astype(jnp.float32) / temperature
    if use_top_p:
        sorted_logits = -jnp.sort(-logits, axis=-1)  # [..., V] descending
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        keep = jnp.cumsum(probs, axis=-1) - probs < top_p
        threshold = jnp.min(jnp.where(keep, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits >= threshold, logits, -jnp.inf)
    return logits


# ------------------------------------------------------------------------------------------------
# speculative_generate
# ------------------------------------------------------------------------------------------------


def speculative_generate(
    target: DecoderLM,
    draft: DraftHead,
    prompt_ids: jax.Array,
    *,
    max_new_tokens: int,
    k: int = 5,
    temperature: float = 0.0,
    top_p: float = 1.0,
    rng: jax.Array | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    mode: str = "chain",
    tree_top_k: int = 8,
    tree_depth: int = 5,
    tree_tokens: int = 32,
) -> SpecOutput:
    """Generate up to `max_new_tokens` per row of `prompt_ids` [B, T] (equal-length, unpadded) with
    `draft` (a DraftHead) proposing and `target` verifying.

    mode "chain": k draft tokens per verify call; temperature 0 is greedy and token for token equal
    to `models.generate.generate(target, ..., temperature=0)`; temperature > 0 (optionally with
    nucleus `top_p`, applied to both distributions) samples exactly from the target's distribution
    by speculative rejection sampling, with `rng` (default PRNGKey(0)).
    mode "tree": an EAGLE-2 dynamic tree (tree_top_k, tree_depth, tree_tokens; see the module
    docstring) verified in one forward; greedy (temperature 0) and batch 1 only (ValueError otherwise),
    lossless as above. `k` is ignored: the per-position statistics have length tree_depth.
    A row stops after any of `eos_token_id`; later slots hold `pad_token_id` (default: the target
    config's pad id, else 0).
    """
    prompt_ids = jnp.asarray(prompt_ids, jnp.int32)
    if prompt_ids.ndim != 2 or prompt_ids.shape[1] < 1:
        raise ValueError(f"prompt_ids must be [B, T] with T >= 1, got {prompt_ids.shape}")
    B, T = prompt_ids.shape
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    greedy = float(temperature) == 0.0
    if float(temperature) < 0 or not 0.0 < float(top_p) <= 1.0:
        raise ValueError(f"temperature must be >= 0 and top_p in (0, 1], got {temperature}, {top_p}")
    block = is_block_draft(draft)
    if mode == "chain":
        if k < 1:
            raise ValueError("k must be >= 1")
        if block and k > draft.max_block:
            raise ValueError(f"k {k}: {type(draft).__name__} drafts at most {draft.max_block} tokens per forward")
        tree = None
    elif mode == "tree":
        if block:
            raise ValueError(f"mode='tree' needs a chain draft; {type(draft).__name__} drafts a block per forward")
        if not greedy or B != 1:
            raise ValueError(f"mode='tree' supports greedy decoding (temperature 0) of one prompt [1, T]; "
                             f"got temperature {temperature}, batch {B}")
        if (why := tree_unsupported(target)) is not None:  # e.g. DeepSeek-V4's compressed entries
            raise NotImplementedError(f"mode='tree' with {why}")
        K, D, N = tree_top_k, tree_depth, tree_tokens
        C = K + (D - 1) * K * K
        if K < 1 or D < 1 or not 1 <= N <= C:
            raise ValueError(f"tree_top_k {K} and tree_depth {D} must be >= 1 and tree_tokens {N} in [1, {C}]")
        tree = (K, D, N)
        k = D
    else:
        raise ValueError(f"mode must be 'chain' or 'tree', got {mode!r}")
    ids = np.asarray(draft.target_token_ids)
    if ids.ndim != 1 or ids.min() < 0 or ids.max() >= target.config.vocab_size:
        raise ValueError(f"draft.target_token_ids must map draft ids into [0, {target.config.vocab_size})")
    if tree is not None and tree[0] > ids.shape[0]:
        raise ValueError(f"tree_top_k {tree[0]} exceeds the draft vocabulary ({ids.shape[0]})")
    if pad_token_id is None:
        pad_token_id = getattr(target.config, "pad_token_id", None) or 0
    rng = jax.random.PRNGKey(0) if rng is None else rng
    graphdef, state = nnx.split((target, draft))  # shared modules (MTPDraft holds the target) travel once
    tokens, n_out, calls, emitted, accepted, drafted, drafts = _speculative_jit(
        graphdef, state, prompt_ids, rng, jnp.float32(1.0 if greedy else temperature), jnp.float32(top_p),
        _eos_array(eos_token_id), jnp.int32(pad_token_id), max_new_tokens=max_new_tokens, k=k, greedy=greedy,
        use_top_p=not greedy and float(top_p) < 1.0, layers=tuple(draft.target_layers), tree=tree, block=block)
    calls = int(calls)
    return SpecOutput(tokens=tokens, lengths=n_out, num_target_calls=calls, emitted=np.asarray(emitted)[:calls],
                      position_accepted=np.asarray(accepted), position_drafted=np.asarray(drafted),
                      drafts=np.asarray(drafts)[:calls])


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "k", "greedy", "use_top_p", "layers",
                                             "tree", "block"))
def _speculative_jit(graphdef, state, prompt_ids, rng, temperature, top_p, eos_ids, pad_id, *, max_new_tokens, k,
                     greedy, use_top_p, layers, tree, block):
    target, draft = nnx.merge(graphdef, state)
    B, T = prompt_ids.shape
    M, V = max_new_tokens, target.config.vocab_size
    W = k + 1  # verify width (chain) and pending-block width
    verify_len = W if tree is None else tree[2] + 1
    S = T + M + max(W, verify_len) + 1
    tmap = draft.target_token_ids.astype(jnp.int32)  # [Vd] draft id -> target id
    is_eos = lambda tok: jnp.any(tok[..., None] == eos_ids, axis=-1)
    rows = jnp.arange(B)
    j_w = jnp.arange(W, dtype=jnp.int32)[None, :]  # [1, W]
    features = lambda hidden: jnp.concatenate(hidden, axis=-1)  # list of [B, T, D_t] -> [B, T, F]

    # -- prefill: the target over the prompt; the draft over entries 0..T-2 (entry T-1 is pending) --
    t_cache = KVCache.init(target.config, B, S, target.dtype, call_width=max(W, verify_len))  # rolled back per call
    logits, t_cache, hidden = target(prompt_ids, cache=t_cache, return_hidden=layers)
    feats = features(hidden)  # [B, T, F]
    rng, key = jax.random.split(rng)
    last = logits[:, -1]  # [B, V]
    if greedy:
        x = jnp.argmax(last, axis=-1).astype(jnp.int32)
    else:
        x = jax.random.categorical(key, scaled_logits(last, temperature, top_p, use_top_p), axis=-1)
        x = x.astype(jnp.int32)
    d_cache = draft.init_cache(B, S)
    if T > 1:
        prefix_pos = jnp.broadcast_to(jnp.arange(T - 1, dtype=jnp.int32), (B, T - 1))
        if block:
            d_cache = draft.context(prompt_ids[:, 1:], feats[:, :-1], positions=prefix_pos, cache=d_cache)
        else:
            _, _, d_cache = draft(prompt_ids[:, 1:], features=feats[:, :-1], positions=prefix_pos, cache=d_cache)
    pend_tok = jnp.zeros((B, W), jnp.int32).at[:, 0].set(x)
    pend_feat = jnp.zeros((B, W, feats.shape[-1]), feats.dtype).at[:, 0].set(feats[:, -1])
    out = jnp.full((B, M + W), pad_id, jnp.int32).at[:, 0].set(x)
    n_out = jnp.ones((B,), jnp.int32)
    done = is_eos(x) | (M <= 1)

    def extend(pend_tok, pend_feat, pend_n, d_cache):
        """Draft over the pending block: entry p gets t_{p+1} and f_p. -> logits [B, Vd] and hidden_out
        [B, Dd] of the last valid entry (which read x), the cache at its true length."""
        start = d_cache.length  # [B]
        lg, h, d_cache = draft(pend_tok, features=pend_feat, positions=start[:, None] + j_w,
                               segment_ids=(j_w < pend_n[:, None]).astype(jnp.int32), cache=d_cache)
        d_cache = d_cache.rollback(start + pend_n)
        return lg[rows, pend_n - 1], h[rows, pend_n - 1], d_cache

    def propose(lg, key):
        """Draft logits [B, Vd] -> (target token [B], q over the target vocab [B, V] or None)."""
        if greedy:
            return tmap[jnp.argmax(lg, axis=-1)], None
        scaled = scaled_logits(lg, temperature, top_p, use_top_p)
        q = jnp.zeros((B, V), jnp.float32).at[:, tmap].set(jax.nn.softmax(scaled, axis=-1))
        return tmap[jax.random.categorical(key, scaled, axis=-1)], q

    def draft_chain(pos, pend_tok, pend_feat, pend_n, d_cache, rng):
        """k sequential draft forwards (EAGLE-3, MTP). -> (drafts [B, k], q [B, k, V] or None, cache, rng)."""
        lg, h, d_cache = extend(pend_tok, pend_feat, pend_n, d_cache)
        rng, key = jax.random.split(rng)
        d1, q1 = propose(lg, key)

        def draft_step(c, i):
            tok, h, d_cache, rng = c
            lg, h_out, d_cache = draft(tok[:, None], hidden=h[:, None], positions=(pos + i - 1)[:, None],
                                       cache=d_cache)
            rng, key = jax.random.split(rng)
            nxt, q = propose(lg[:, 0], key)
            return (nxt, h_out[:, 0], d_cache, rng), (nxt, q)

        (_, _, d_cache, rng), (rest, rest_q) = jax.lax.scan(draft_step, (d1, h, d_cache, rng),
                                                             jnp.arange(1, k, dtype=jnp.int32))
        drafts = jnp.concatenate([d1[:, None], rest.T], axis=1)  # [B, k]
        q = None if greedy else jnp.concatenate([q1[:, None], rest_q.transpose(1, 0, 2)], axis=1)  # [B, k, V]
        return drafts, q, d_cache, rng

    def draft_block(pos, pend_tok, pend_feat, pend_n, d_cache, rng):
        """ONE draft forward for all k tokens (P-EAGLE, DFlash): the draft at depth i does not see the
        tokens drafted before it, so each is drawn from its own q_i (still exact: the rejection test only
        needs q_i to be the distribution d_i was drawn from, given the verified prefix)."""
        lg, d_cache = draft.propose(pend_tok, pend_feat, pend_n, cache=d_cache, k=k)  # [B, k, Vd]
        if greedy:
            return tmap[jnp.argmax(lg, axis=-1)], None, d_cache, rng
        rng, key = jax.random.split(rng)
        scaled = scaled_logits(lg, temperature, top_p, use_top_p)  # [B, k, Vd]
        q = jnp.zeros((B, k, V), jnp.float32).at[:, :, tmap].set(jax.nn.softmax(scaled, axis=-1))
        return tmap[jax.random.categorical(key, scaled, axis=-1)], q, d_cache, rng

    def chain_step(x, pos, pend_tok, pend_feat, pend_n, t_cache, d_cache, rng):
        """Draft k tokens, verify them in one target forward. -> (n [B], tokens [B, W], features [B, W, F],
        target cache, draft cache (rolled back to pos), rng, drafts [B, k])."""
        drafts, q, d_cache, rng = (draft_block if block else draft_chain)(pos, pend_tok, pend_feat, pend_n, d_cache,
                                                                           rng)
        verify_in = jnp.concatenate([x[:, None], drafts], axis=1)  # [B, W]
        t_logits, t_cache, hidden = target(verify_in, positions=pos[:, None] + j_w, cache=t_cache,
                                           return_hidden=layers)
        if greedy:
            n, toks = verify_greedy(drafts, t_logits)
        else:
            p = jax.nn.softmax(scaled_logits(t_logits, temperature, top_p, use_top_p), axis=-1)  # [B, W, V]
            rng, key = jax.random.split(rng)
            n, toks = verify_sampled(drafts, q, p, key)
        return n, toks, features(hidden), t_cache, d_cache.rollback(pos), rng, drafts

    def tree_step(x, pos, pend_tok, pend_feat, pend_n, t_cache, d_cache, rng):
        """EAGLE-2: expand, rerank, verify the tree in one forward, accept the longest greedy path, compact
        the target cache. Batch 1. Same returns as chain_step (tokens / features along the path)."""
        K, D, N = tree
        C = K + (D - 1) * K * K
        depth_of = np.concatenate([np.ones(K, np.int32)] + [np.full(K * K, d, np.int32) for d in range(2, D + 1)])
        lg, h, d_cache = extend(pend_tok, pend_feat, pend_n, d_cache)
        s1, i1 = jax.lax.top_k(jax.nn.log_softmax(lg[0].astype(jnp.float32)), K)  # [K]
        cand_tok = jnp.zeros((C,), jnp.int32).at[:K].set(tmap[i1])
        cand_score = jnp.zeros((C,), jnp.float32).at[:K].set(s1)
        cand_parent = jnp.zeros((C,), jnp.int32)  # tree index of the parent: 0 = root, c + 1 = candidate c
        beam = (jnp.arange(K, dtype=jnp.int32), s1, tmap[i1], jnp.broadcast_to(h, (K, h.shape[-1])),
                d_cache.rows(jnp.zeros((K,), jnp.int32)))

        def expand(c, d):
            """Depth d + 2: feed the K beam nodes (depth d + 1), keep all K·K children as candidates and
            the best K as the next beam, each with its parent's draft cache row."""
            (b_idx, b_score, b_tok, b_h, b_cache), cand_tok, cand_score, cand_parent = c
            lg, h_out, b_cache = draft(b_tok[:, None], hidden=b_h[:, None],
                                       positions=jnp.broadcast_to(pos + d, (K, 1)), cache=b_cache)
            s, i = jax.lax.top_k(jax.nn.log_softmax(lg[:, 0].astype(jnp.float32), axis=-1), K)  # [K, K]
            score = (b_score[:, None] + s).reshape(-1)  # [K·K]
            tok = tmap[i].reshape(-1)
            off = K + d * K * K
            cand_tok = jax.lax.dynamic_update_slice(cand_tok, tok, (off,))
            cand_score = jax.lax.dynamic_update_slice(cand_score, score, (off,))
            cand_parent = jax.lax.dynamic_update_slice(cand_parent, jnp.repeat(b_idx + 1, K), (off,))
            best_score, best = jax.lax.top_k(score, K)
            parent = best // K
            beam = (off + best, best_score, tok[best], h_out[parent, 0], b_cache.rows(parent))
            return (beam, cand_tok, cand_score, cand_parent), None

        (_, cand_tok, cand_score, cand_parent), _ = jax.lax.scan(
            expand, (beam, cand_tok, cand_score, cand_parent), jnp.arange(D - 1, dtype=jnp.int32))
        # rerank: best N by score, ties to the shallower node, so every parent precedes its children
        depth_c = jnp.asarray(depth_of)
        _, _, order = jax.lax.sort((-cand_score, depth_c, jnp.arange(C, dtype=jnp.int32)), num_keys=3)
        sel = order[:N]  # [N] candidates -> tree nodes 1..N
        node_of = jnp.full((C + 1,), -1, jnp.int32).at[0].set(0).at[sel + 1].set(jnp.arange(1, N + 1))
        parent = jnp.concatenate([jnp.full((1,), -1, jnp.int32), node_of[cand_parent[sel]]])  # [N+1]; -1: none
        node_depth = jnp.concatenate([jnp.zeros((1,), jnp.int32), depth_c[sel]])  # [N+1]
        node_tok = jnp.concatenate([x, cand_tok[sel]])  # [N+1]
        eye = jnp.eye(N + 1, dtype=bool)
        anc = eye  # anc[i, j]: node j is node i or one of its ancestors
        for _ in range(D):
            anc = eye | (anc[jnp.maximum(parent, 0)] & (parent >= 0)[:, None])
        t_logits, t_cache, hidden = target(node_tok[None], positions=(pos + node_depth)[None], cache=t_cache,
                                           tree_mask=anc[None], return_hidden=layers)
        preds = jnp.argmax(t_logits[0], axis=-1).astype(jnp.int32)  # [N+1]
        match = (parent < 0) | (node_tok == preds[jnp.maximum(parent, 0)])  # the root matches trivially
        on_path = anc[:, 0] & jnp.all(jnp.where(anc, match[None, :], True), axis=1)  # [N+1]
        deepest = jnp.argmax(jnp.where(on_path, node_depth, -1))
        n = node_depth[deepest]
        path = jnp.argmax(anc[deepest][None, :] & (node_depth[None, :] == jnp.arange(W)[:, None]), axis=1)  # [W]
        path = jnp.where(jnp.arange(W) <= n, path, 0)
        # compact: the path's KV entries (slots pos + path[d]) move to slots pos + d
        dst = jnp.where((jnp.arange(W) >= 1) & (jnp.arange(W) <= n), pos[0] + jnp.arange(W), S)
        src = pos[0] + path
        t_cache = dataclasses.replace(t_cache, k=t_cache.k.at[:, :, :, dst].set(t_cache.k[:, :, :, src], mode="drop"),
                                      v=t_cache.v.at[:, :, :, dst].set(t_cache.v[:, :, :, src], mode="drop"))
        feats = features(hidden)[:, path]  # [1, W, F]
        best = jnp.argmax(jnp.where(depth_c[None, :] == jnp.arange(1, D + 1)[:, None], cand_score[None, :], -jnp.inf),
                          axis=1)  # [D]: the best candidate of each depth
        return n[None], preds[path][None], feats, t_cache, d_cache, rng, cand_tok[best][None]

    step = chain_step if tree is None else tree_step

    def cond(c):
        it, done = c[0], c[8]
        return (it < M) & ~jnp.all(done)

    def body(c):
        (it, x, pos, pend_tok, pend_feat, pend_n, t_cache, d_cache, done, out, n_out, rng, emitted, acc, drafted,
         drafts_log) = c
        active = ~done
        n, toks, feats, t_cache, d_cache, rng, drafts = step(x, pos, pend_tok, pend_feat, pend_n, t_cache, d_cache,
                                                             rng)
        emit = n + 1
        eos_at = jnp.where(is_eos(toks) & (j_w < emit[:, None]), j_w, W)
        first_eos = jnp.min(eos_at, axis=1)
        emit = jnp.where(active, jnp.minimum(emit, first_eos + 1), 0)
        idx = jnp.where(j_w < emit[:, None], n_out[:, None] + j_w, M + W)  # out-of-range: dropped
        out = out.at[rows[:, None], idx].set(toks, mode="drop")
        n_out = n_out + emit
        done = done | (active & (first_eos < W)) | (n_out >= M)
        new_pos = jnp.where(active, pos + n + 1, pos)
        t_cache = t_cache.rollback(new_pos)
        d_cache = d_cache.rollback(jnp.where(active, pos, pos - pend_n))  # done rows keep their state
        keep = lambda new, old: jnp.where(active.reshape((B,) + (1,) * (new.ndim - 1)), new, old)
        x = keep(toks[rows, n], x)
        pend_tok, pend_feat, pend_n = keep(toks, pend_tok), keep(feats, pend_feat), keep(n + 1, pend_n)
        emitted = emitted.at[it].set(emit)
        acc = acc + jnp.sum((jnp.arange(k)[None, :] < n[:, None]) & active[:, None], axis=0)
        drafted = drafted + jnp.sum(active)
        drafts_log = drafts_log.at[it].set(drafts)
        return (it + 1, x, new_pos, pend_tok, pend_feat, pend_n, t_cache, d_cache, done, out, n_out, rng, emitted,
                acc, drafted, drafts_log)

    carry = (jnp.int32(0), x, jnp.full((B,), T, jnp.int32), pend_tok, pend_feat, jnp.ones((B,), jnp.int32),
             t_cache, d_cache, done, out, n_out, rng, jnp.zeros((M, B), jnp.int32), jnp.zeros((k,), jnp.int32),
             jnp.int32(0), jnp.zeros((M, B, k), jnp.int32))
    carry = jax.lax.while_loop(cond, body, carry)
    it, out, n_out, emitted, acc, drafted, drafts = (carry[i] for i in (0, 9, 10, 12, 13, 14, 15))
    n_out = jnp.minimum(n_out, M)
    tokens = jnp.where(jnp.arange(M)[None, :] < n_out[:, None], out[:, :M], pad_id)
    return tokens, n_out, it, emitted, acc, jnp.broadcast_to(drafted, (k,)), drafts
