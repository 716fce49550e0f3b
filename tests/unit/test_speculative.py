"""Speculative decoding (models/speculative.py): greedy chain and tree decoding are token for token
`generate(..., temperature=0)` for every family, with EAGLE-3 and MTP drafts; rows accept, stop and
roll back independently; speculative sampling emits exactly the target's distribution (chi-square
tests with a control that shows the tests have power)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

from models import Llama, LlamaConfig, generate, jit_forward
from models.decoder import build_context
from models.deepseek_v3 import DeepseekV3, DeepseekV3Config
from models.eagle3 import Eagle3Config, Eagle3Draft, build_draft_vocab
from models.generate import KVCache
from models.glm4_moe import Glm4Moe, Glm4MoeConfig
from models.gpt_oss import GptOss, GptOssConfig
from models.peagle import PEagleConfig, PEagleDraft
from models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig
from models.speculative import (
    BlockDraft,
    DraftHead,
    MTPDraft,
    is_block_draft,
    speculative_generate,
    verify_greedy,
    verify_sampled,
)

pytestmark = pytest.mark.unit
jax.config.update("jax_default_matmul_precision", "highest")

V = 32  # target vocabulary
VD = 24  # EAGLE-3 draft vocabulary
M = 12  # max_new_tokens
P_VALUE = 1e-3


def _gpt_oss() -> GptOss:
    """2 layers (sliding window 4, full), random sinks: the window matters within a dozen tokens."""
    model = GptOss(GptOssConfig.tiny(V, num_hidden_layers=2, sliding_window=4), rngs=nnx.Rngs(0))
    for layer in model.layers:
        sinks = layer.self_attn.sinks
        sinks.set_value(jax.random.normal(jax.random.PRNGKey(5), sinks.get_value().shape))
    return model


FAMILIES = {
    "llama": lambda: Llama(LlamaConfig.tiny(V), rngs=nnx.Rngs(0)),
    "qwen3": lambda: Llama(LlamaConfig.qwen3_tiny(V), rngs=nnx.Rngs(0)),
    "qwen3_moe": lambda: Qwen3Moe(Qwen3MoeConfig.tiny(V, num_hidden_layers=2, mlp_only_layers=(1,)),
                                  rngs=nnx.Rngs(0)),
    "deepseek_v3": lambda: DeepseekV3(DeepseekV3Config.tiny(V, num_hidden_layers=2, num_mtp_layers=1),
                                      rngs=nnx.Rngs(0)),
    "gpt_oss": _gpt_oss,
    "glm4_moe": lambda: Glm4Moe(Glm4MoeConfig.tiny(V, num_hidden_layers=2, num_mtp_layers=1), rngs=nnx.Rngs(0)),
}
_models: dict[str, nnx.Module] = {}


def family(name: str) -> nnx.Module:
    """One instance per family for the whole module (compiled shapes are reused across tests)."""
    if name not in _models:
        _models[name] = FAMILIES[name]()
    return _models[name]


def eagle3_for(target: nnx.Module, seed: int = 1) -> Eagle3Draft:
    """A random EAGLE-3 head on `target`, with a pruned draft vocabulary (every fourth id dropped)."""
    draft = Eagle3Draft(Eagle3Config.for_target(target.config, draft_vocab_size=VD), rngs=nnx.Rngs(seed))
    draft.load_embedding(target.embed_tokens.weight[...])
    counts = np.where(np.arange(V) % 4 == 3, 0, 100 + np.arange(V))
    d2t, t2d, _ = build_draft_vocab(counts, VD)
    draft.set_vocab(d2t, t2d)
    return draft


def peagle_for(target: nnx.Module, seed: int = 1, depths: int = 4) -> PEagleDraft:
    """A random P-EAGLE head on `target` (parallel drafting of up to `depths` tokens), pruned vocabulary."""
    base = Eagle3Config.for_target(target.config, draft_vocab_size=VD)
    draft = PEagleDraft(PEagleConfig.from_eagle3(base, mask_token_id=V - 1, num_depths=depths), rngs=nnx.Rngs(seed))
    draft.load_embedding(target.embed_tokens.weight[...])
    counts = np.where(np.arange(V) % 4 == 3, 0, 100 + np.arange(V))
    d2t, t2d, _ = build_draft_vocab(counts, VD)
    draft.set_vocab(d2t, t2d)
    return draft


def prompts(seed: int, batch: int = 2, length: int = 5) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, (batch, length)), jnp.int32)


# ------------------------------------------------------------------------------------------------
# Test draft heads: an oracle that proposes a known continuation, and Markov chains
# ------------------------------------------------------------------------------------------------


class OracleDraft(nnx.Module):
    """A strict DraftHead that knows the target's greedy sequence `seq` [R, L] (row r of the batch reads
    row r % R). Its entry at position p proposes seq[p + 2] (logit 4) - or, where `corrupt[p + 2]`, the
    wrong token seq + 1 first and seq[p + 2] as the runner-up (logit 3) - but only when its bookkeeping
    is right: the cache must hold token seq[s + 1] at every slot s it attends to, and `hidden` (its own
    previous output: the token that entry read) must be seq[p]; otherwise it proposes a wrong token. So
    acceptance is high only if extend / rollback / beam copies feed it exactly. The draft vocabulary is
    `draft_ids` (sorted target ids); tokens outside it cannot be proposed. Features are ignored."""

    def __init__(self, seq: np.ndarray, corrupt: np.ndarray, draft_ids: np.ndarray):
        t2d = np.zeros(V, np.int32)
        t2d[draft_ids] = np.arange(len(draft_ids))
        self.seq = nnx.Variable(jnp.asarray(seq, jnp.int32))  # [R, L]
        self.corrupt = nnx.Variable(jnp.asarray(corrupt, bool))  # [R, L]
        self.ids = nnx.Variable(jnp.asarray(draft_ids, jnp.int32))  # [Vd]
        self.t2d = nnx.Variable(jnp.asarray(t2d))  # [V]

    @property
    def target_layers(self) -> tuple[int, ...]:
        return (0,)

    @property
    def target_token_ids(self) -> jax.Array:
        return self.ids[...]

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache(k=jnp.zeros((1, batch, 1, max_len, 1)), v=jnp.zeros((1, batch, 1, max_len, 1)),
                       valid=jnp.zeros((batch, max_len), bool), length=jnp.zeros((batch,), jnp.int32))

    def __call__(self, input_ids, *, features=None, hidden=None, positions=None, segment_ids=None, cache=None):
        B, T = input_ids.shape
        ctx, cache = build_context(T, B, positions=positions, segment_ids=segment_ids, cache=cache, windows=set())
        seq, L = self.seq[...], self.seq.shape[1]
        row = (jnp.arange(B) % seq.shape[0])[:, None]  # [B, 1]
        tok = input_ids.astype(jnp.float32)[:, :, None, None]  # [B, T, 1, 1]
        cache = cache.write(0, ctx.slots, tok, tok)
        cached = cache.k[0, :, 0, :, 0]  # [B, S]: the token each slot read
        truth = seq[row, jnp.clip(jnp.arange(cache.max_len)[None, :] + 1, 0, L - 1)]  # [B, S]
        ok = jnp.all(~ctx.mask() | (cached == truth)[:, None, :], axis=-1)  # [B, T]
        if hidden is not None:
            ok &= hidden[..., 0] == seq[row, jnp.clip(ctx.positions, 0, L - 1)]
        at = jnp.clip(ctx.positions + 2, 0, L - 1)  # [B, T]
        right = seq[row, at]
        first = jnp.where(self.corrupt[...][row, at], (right + 1) % V, right)
        first, right = jnp.where(ok, first, (right + 7) % V), jnp.where(ok, right, (right + 7) % V)
        vd = jnp.arange(self.ids.shape[0])
        best, runner = self.t2d[...][first], self.t2d[...][right]
        logits = jnp.where(vd == best[..., None], 4.0, jnp.where(vd == runner[..., None], 3.0, -10.0))
        return logits, input_ids.astype(jnp.float32)[..., None], cache


class OracleBlockDraft(OracleDraft):
    """OracleDraft as a BlockDraft: `propose` drafts seq[P + 1 + i] for i < k in one call (first the wrong
    token where `corrupt`), but only if every cached slot s it holds read seq[s + 1] - so acceptance is
    high only if the pending-block writes and the rollbacks of the block path are exact."""

    max_block = 8

    def context(self, input_ids, features, *, positions, segment_ids=None, cache):
        return self(input_ids, features=features, positions=positions, segment_ids=segment_ids, cache=cache)[2]

    def propose(self, input_ids, features, num_valid, *, cache, k):
        B, W = input_ids.shape
        start = cache.length
        j = jnp.arange(W)[None, :]
        _, _, cache = self(input_ids, features=features, positions=start[:, None] + j,
                           segment_ids=(j < num_valid[:, None]).astype(jnp.int32), cache=cache)
        cache = cache.rollback(start + num_valid)
        seq, L = self.seq[...], self.seq.shape[1]
        row = (jnp.arange(B) % seq.shape[0])[:, None]  # [B, 1]
        slots = jnp.arange(cache.max_len)[None, :]
        truth = seq[row, jnp.clip(slots + 1, 0, L - 1)]  # [B, S]
        held = cache.valid & (slots < cache.length[:, None])
        ok = jnp.all(~held | (cache.k[0, :, 0, :, 0] == truth), axis=1)[:, None]  # [B, 1]
        at = jnp.clip(cache.length[:, None] + 1 + jnp.arange(k)[None, :], 0, L - 1)  # [B, k]: P + 1 + i
        right = seq[row, at]
        first = jnp.where(self.corrupt[...][row, at], (right + 1) % V, right)
        first, right = jnp.where(ok, first, (right + 7) % V), jnp.where(ok, right, (right + 7) % V)
        vd = jnp.arange(self.ids.shape[0])
        best, runner = self.t2d[...][first], self.t2d[...][right]
        logits = jnp.where(vd == best[..., None], 4.0, jnp.where(vd == runner[..., None], 3.0, -10.0))
        return logits, cache


def pruned_vocab(seq: np.ndarray) -> np.ndarray:
    """All target ids but the smallest one `seq` does not use: draft ids above it differ from target ids."""
    return np.setdiff1d(np.arange(V), [np.setdiff1d(np.arange(V), seq)[0]])


def oracle_for(seq: np.ndarray, corrupt_every: tuple[int, ...], draft_ids: np.ndarray,
               cls: type[OracleDraft] = OracleDraft) -> OracleDraft:
    """seq [R, L] = prompt + greedy continuation; in row r every `corrupt_every[r]`-th position gets the
    wrong token first and the right one second (0: never)."""
    corrupt = np.zeros(seq.shape, bool)
    for r, every in enumerate(corrupt_every):
        if every:
            corrupt[r] = np.arange(seq.shape[1]) % every == every - 1
    return cls(seq, corrupt, draft_ids)


@dataclasses.dataclass(frozen=True)
class MarkovConfig:
    vocab_size: int
    num_hidden_layers: int = 1
    num_key_value_heads: int = 1
    head_dim: int = 1
    pad_token_id: int | None = None


class MarkovLM(nnx.Module):
    """A target with the DecoderLM call signature whose next-token distribution is probs[t_p]."""

    def __init__(self, probs: np.ndarray):
        self.config = MarkovConfig(probs.shape[0])
        self.dtype = jnp.float32
        self.log_probs = nnx.Variable(jnp.log(jnp.asarray(probs, jnp.float32)))

    def __call__(self, input_ids, *, positions=None, segment_ids=None, cache=None, return_hidden=(), tree_mask=None):
        B, T = input_ids.shape
        _, cache = build_context(T, B, positions=positions, segment_ids=segment_ids, cache=cache, windows=set())
        out = (self.log_probs[...][input_ids],) + ((cache,) if cache is not None else ())
        if return_hidden:
            out += ([jax.nn.one_hot(input_ids, self.config.vocab_size)] * len(return_hidden),)
        return out[0] if len(out) == 1 else out


class MarkovDraft(nnx.Module):
    """A DraftHead proposing from probs[t_{p+1}] at entry p (the token it reads)."""

    def __init__(self, probs: np.ndarray):
        self.config = MarkovConfig(probs.shape[0])
        self.log_probs = nnx.Variable(jnp.log(jnp.asarray(probs, jnp.float32)))

    target_layers = (0,)

    @property
    def target_token_ids(self) -> jax.Array:
        return jnp.arange(self.config.vocab_size, dtype=jnp.int32)

    def init_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache.init(self.config, batch, max_len)

    def __call__(self, input_ids, *, features=None, hidden=None, positions=None, segment_ids=None, cache=None):
        B, T = input_ids.shape
        _, cache = build_context(T, B, positions=positions, segment_ids=segment_ids, cache=cache, windows=set())
        return self.log_probs[...][input_ids], jnp.zeros((B, T, 1)), cache


class MarkovBlockDraft(MarkovDraft):
    """A BlockDraft proposing, for the token i + 1 places after the newest token x, from probs^(i+1)[x]
    (the (i+1)-step chain: it never sees its own earlier drafts, as a parallel draft does not)."""

    max_block = 8

    def context(self, input_ids, features, *, positions, segment_ids=None, cache):
        return self(input_ids, features=features, positions=positions, segment_ids=segment_ids, cache=cache)[2]

    def propose(self, input_ids, features, num_valid, *, cache, k):
        B, W = input_ids.shape
        j = jnp.arange(W)[None, :]
        _, _, cache = self(input_ids, positions=cache.length[:, None] + j,
                           segment_ids=(j < num_valid[:, None]).astype(jnp.int32), cache=cache)
        x = jnp.take_along_axis(input_ids, (num_valid - 1)[:, None], axis=1)[:, 0]  # [B]
        probs, steps = jnp.exp(self.log_probs[...]), []
        power = probs
        for _ in range(k):
            steps.append(jnp.log(power[x]))  # [B, V]
            power = power @ probs
        return jnp.stack(steps, axis=1), cache.rollback(cache.length - W + num_valid)


def markov_matrix(seed: int, n: int) -> np.ndarray:
    """A random transition matrix with every entry >= 0.4 / n (chi-square cells stay well filled)."""
    rng = np.random.default_rng(seed)
    return 0.6 * rng.dirichlet(np.ones(n), size=n) + 0.4 / n


def nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Rows of probs restricted to their nucleus (generate.sample_token's rule) and renormalised."""
    order = np.argsort(-probs, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(probs, order, -1)
    keep_sorted = np.cumsum(sorted_p, -1) - sorted_p < top_p
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, -1)
    out = np.where(keep, probs, 0.0)
    return out / out.sum(-1, keepdims=True)


def chi_square_p(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """p-value of a chi-square goodness-of-fit test; cells expecting < 5 counts are pooled."""
    observed, expected = observed.ravel().astype(float), expected_probs.ravel() * observed.sum()
    if observed[expected == 0].sum() > 0:  # a count where the target has no mass
        return 0.0
    observed, expected = observed[expected > 0], expected[expected > 0]
    small = expected < 5
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return float(stats.chisquare(observed, expected).pvalue)


# ------------------------------------------------------------------------------------------------
# Pieces: verification functions, the tree mask, the MTP draft
# ------------------------------------------------------------------------------------------------


def test_verify_greedy_accepts_the_matching_prefix():
    logits = jax.nn.one_hot(jnp.array([[3, 1, 4, 1], [5, 9, 2, 6]]), 10)  # target argmax per position
    n, toks = verify_greedy(jnp.array([[3, 1, 0], [0, 9, 2]]), logits)
    assert n.tolist() == [2, 0]
    assert toks.tolist() == [[3, 1, 4, 1], [5, 9, 2, 6]]  # emitted: [3, 1, 4] and [5]


def test_verify_sampled_first_token_follows_target():
    """One verify call, drafts from Markov chain q, target p: the first emitted token is p_0-distributed
    whatever q is; emitting the first draft unverified is q_0-distributed and fails the same test."""
    n_rows, k, n = 40000, 3, 4
    P, Q = markov_matrix(0, n), markov_matrix(1, n)

    @jax.jit
    def run(key):
        key_d, key_v = jax.random.split(key)
        drafts, prev = [], jnp.zeros((n_rows,), jnp.int32)
        for key in jax.random.split(key_d, k):
            prev = jax.random.categorical(key, jnp.log(jnp.asarray(Q))[prev]).astype(jnp.int32)
            drafts.append(prev)
        drafts = jnp.stack(drafts, 1)  # [R, k]
        prefix = jnp.concatenate([jnp.zeros((n_rows, 1), jnp.int32), drafts], 1)  # what each position conditions on
        return drafts, *verify_sampled(drafts, jnp.asarray(Q)[prefix[:, :k]], jnp.asarray(P)[prefix], key_v)

    drafts, num, toks = (np.asarray(a) for a in run(jax.random.PRNGKey(0)))
    assert 0 < num.mean() < k and (num == k).any() and (num == 0).any()
    assert chi_square_p(np.bincount(toks[:, 0], minlength=n), P[0]) > P_VALUE
    assert chi_square_p(np.bincount(drafts[:, 0], minlength=n), P[0]) < P_VALUE  # control
    # the acceptance rate of the first draft is sum_v min(p, q)
    np.testing.assert_allclose((num > 0).mean(), np.minimum(P[0], Q[0]).sum(), atol=0.015)


TREE_PARENT = [-1, 0, 0, 1, 1, 3, 5]  # root, two children, two grandchildren under node 1, then a chain


def test_tree_mask_forward_equals_each_paths_forward():
    """A tree verified in one cached forward: node i's logits equal the plain forward over prefix + the
    path to i, with GPT-OSS's sliding window (4) and sinks (the window is measured in positions)."""
    model = family("gpt_oss")
    prefix = prompts(11, 1, 6)
    n_nodes, Tp = len(TREE_PARENT), prefix.shape[1]
    node_tok = np.asarray(prompts(12, 1, n_nodes))[0]
    paths = []
    for i in range(n_nodes):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = TREE_PARENT[j]
        paths.append(path[::-1])
    anc = np.zeros((n_nodes, n_nodes), bool)
    for i, path in enumerate(paths):
        anc[i, path] = True
    depth = np.array([len(p) - 1 for p in paths])
    width = Tp + depth.max() + 1
    rows = np.zeros((n_nodes, width), np.int32)  # prefix + path, right-padded (causal: padding is inert)
    for i, path in enumerate(paths):
        rows[i, :Tp] = np.asarray(prefix)[0]
        rows[i, Tp: Tp + len(path)] = node_tok[path]
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state):
        model = nnx.merge(graphdef, state)
        _, cache = model(prefix, cache=KVCache.init(model.config, 1, 24, model.dtype))
        tree, _ = model(jnp.asarray(node_tok)[None], positions=jnp.asarray(Tp + depth)[None], cache=cache,
                        tree_mask=jnp.asarray(anc)[None])
        return tree[0], model(jnp.asarray(rows))[np.arange(n_nodes), Tp + depth]  # [nodes, V] each

    tree_logits, ref = run(state)
    np.testing.assert_allclose(np.asarray(tree_logits), np.asarray(ref), atol=2e-5, rtol=1e-4)


def test_mtp_draft_is_the_mtp_head():
    """MTPDraft without a cache is DecoderLM.mtp_logits; with a cache (MLA's absorbed form, fed in two
    calls) the same. Any hidden state will do as the target feature."""
    model = family("deepseek_v3")
    ids = prompts(3, 2, 7)
    h = jax.random.normal(jax.random.PRNGKey(3), (2, 7, model.config.hidden_size))
    draft = MTPDraft(model)
    assert isinstance(draft, DraftHead) and draft.target_layers == (-1,)
    graphdef, state = nnx.split((model, draft))

    @jax.jit
    def run(state):
        model, draft = nnx.merge(graphdef, state)
        ref = model.mtp_logits(ids, h)  # [B, 6, V]
        logits, hidden_out, _ = draft(ids[:, 1:], features=h[:, :-1])
        a, _, cache = draft(ids[:, 1:4], features=h[:, :3], cache=draft.init_cache(2, 8))
        b, _, cache = draft(ids[:, 4:], features=h[:, 3:-1], cache=cache)
        return ref, logits, jnp.concatenate([a, b], 1), hidden_out

    ref, logits, cached, hidden_out = run(state)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref), atol=2e-5)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(ref), atol=2e-5)
    assert hidden_out.shape == (2, 6, model.config.hidden_size)
    with pytest.raises(ValueError, match="MTP layers"):
        MTPDraft(model, depth=1)


# ------------------------------------------------------------------------------------------------
# Greedy: lossless for every family, eos per row, high acceptance, MTP drafts
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_chain_is_lossless_with_eagle3(name):
    """B=2 with a random EAGLE-3 head (pruned vocabulary): tokens equal greedy generate; with an eos
    that row 0 meets early, row 0 stops there and row 1 runs on, both exactly like generate."""
    model = family(name)
    draft = eagle3_for(model)
    assert isinstance(draft, DraftHead)
    ids = prompts(0)
    ref = np.asarray(generate(model, ids, max_new_tokens=M).tokens)
    out = speculative_generate(model, draft, ids, max_new_tokens=M, k=3)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    assert out.lengths.tolist() == [M, M]
    assert out.emitted.shape == (out.num_target_calls, 2) and (out.emitted.sum(0) >= M - 1).all()
    assert 1.0 <= out.mean_acceptance_length <= 4.0

    eos = int(ref[0, 2])
    ref = generate(model, ids, max_new_tokens=M, eos_token_id=eos, pad_token_id=V - 1)
    out = speculative_generate(model, draft, ids, max_new_tokens=M, k=3, eos_token_id=eos, pad_token_id=V - 1)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert out.lengths.tolist() == ref.lengths.tolist() and int(out.lengths[0]) <= 3


@pytest.mark.parametrize("name", ["llama", "deepseek_v3", "gpt_oss"])
def test_greedy_chain_high_acceptance_rolls_back_per_row(name):
    """An oracle draft that knows the greedy continuation but errs at every 3rd (row 0) / 5th (row 1)
    position, over a pruned vocabulary: several tokens are accepted per call, rows accept different
    counts, and the output is still exactly greedy (cache rollback after multi-token acceptance)."""
    model = family(name)
    ids = prompts(1)
    ref = np.asarray(generate(model, ids, max_new_tokens=M).tokens)
    seq = np.concatenate([np.asarray(ids), ref, np.zeros((2, 8), np.int32)], 1)
    draft_ids = pruned_vocab(seq)
    out = speculative_generate(model, oracle_for(seq, (3, 5), draft_ids), ids, max_new_tokens=M, k=4)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    assert out.mean_acceptance_length > 1.5
    assert not np.array_equal(out.emitted[:, 0], out.emitted[:, 1])
    assert out.position_drafted.tolist() == [int((out.emitted > 0).sum())] * 4
    assert out.per_position_acceptance[0] >= out.per_position_acceptance[-1]


def test_chain_drafts_equal_a_fresh_draft_prefill():
    """Every call's k proposals (llama, EAGLE-3, B=2: the family test's run) are what the draft proposes
    when prefilled from scratch on the accepted sequence with features from one uncached target forward,
    then stepped on its own hidden output: the incremental extend / rollback / feature alignment is exact."""
    model, k = family("llama"), 3
    draft = eagle3_for(model)
    ids = prompts(0)
    out = speculative_generate(model, draft, ids, max_new_tokens=M, k=k)
    T, width = ids.shape[1], ids.shape[1] + M + k
    graphdef, state = nnx.split((model, draft))

    @jax.jit
    def reference(state, seq, P, proposals):
        """seq [1, width]: the sequence through x = seq[0, P], right-padded; proposals [k] (teacher-forced)
        -> the draft's logits [k, Vd] at each proposal step."""
        model, draft = nnx.merge(graphdef, state)
        _, hidden = model(seq, return_hidden=draft.target_layers)
        feats = jnp.concatenate(hidden, -1)  # [1, width, F]
        n = width - 1
        lg, h, cache = draft(seq[:, 1:], features=feats[:, :n], positions=jnp.arange(n)[None],
                             segment_ids=(jnp.arange(n) < P)[None].astype(jnp.int32),
                             cache=draft.init_cache(1, width + k))
        cache = cache.rollback(P[None])
        logits, h = [lg[0, P - 1]], h[0, P - 1]
        for i in range(1, k):
            lg, h_out, cache = draft(proposals[i - 1][None, None], hidden=h[None, None],
                                     positions=(P + i - 1)[None, None], cache=cache)
            logits.append(lg[0, 0])
            h = h_out[0, 0]
        return jnp.stack(logits)

    t2d = np.full(V, -1)
    t2d[np.asarray(draft.target_token_ids)] = np.arange(VD)
    tokens, checked = np.asarray(out.tokens), 0
    for b in range(2):
        n_before = 1
        for i in np.flatnonzero(out.emitted[:, b]):
            P = T + n_before - 1  # position of x, the newest token
            seq = np.zeros((1, width), np.int32)
            seq[0, :T], seq[0, T: T + n_before] = np.asarray(ids)[b], tokens[b, :n_before]
            ref = np.asarray(reference(state, jnp.asarray(seq), jnp.int32(P), jnp.asarray(out.drafts[i, b])))
            assert (t2d[out.drafts[i, b]] >= 0).all()
            chosen = ref[np.arange(k), t2d[out.drafts[i, b]]]
            np.testing.assert_array_less(ref.max(-1) - chosen, 1e-4)  # the proposal is the reference argmax
            n_before += out.emitted[i, b]
            checked += 1
    assert checked >= 2 * (M - 1) // (k + 1)


def test_greedy_perfect_draft_accepts_everything():
    """The oracle without errors: every draft is accepted, k + 1 tokens per verify call."""
    model = family("llama")
    ids = prompts(2, 2)
    ref = np.asarray(generate(model, ids, max_new_tokens=M).tokens)
    seq = np.concatenate([np.asarray(ids), ref, np.zeros((2, 8), np.int32)], 1)
    k = 4
    out = speculative_generate(model, oracle_for(seq, (0, 0), pruned_vocab(seq)), ids, max_new_tokens=M, k=k)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    assert out.num_target_calls == -(-(M - 1) // (k + 1))  # the prefill emits the first token
    assert (out.emitted[:-1] == k + 1).all()  # the oracle knows no tokens past M: the last call may stop early


@pytest.mark.parametrize("name", ["llama", "deepseek_v3", "gpt_oss"])
def test_greedy_is_lossless_with_a_parallel_draft(name):
    """A random P-EAGLE head drafts k tokens per forward: tokens equal greedy generate (B=2, with eos)."""
    model = family(name)
    draft = peagle_for(model)
    assert isinstance(draft, BlockDraft) and is_block_draft(draft) and not is_block_draft(eagle3_for(model))
    ids = prompts(5)
    ref = np.asarray(generate(model, ids, max_new_tokens=M).tokens)
    out = speculative_generate(model, draft, ids, max_new_tokens=M, k=4)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    eos = int(ref[1, 3])
    ref = generate(model, ids, max_new_tokens=M, eos_token_id=eos)
    out = speculative_generate(model, draft, ids, max_new_tokens=M, k=4, eos_token_id=eos)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    assert out.lengths.tolist() == ref.lengths.tolist()


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_block_draft_high_acceptance_rolls_back_per_row(name):
    """The oracle as a block draft (one proposal of k tokens per call, errors every 3rd / 5th position):
    several tokens per call, rows accept different counts, output exactly greedy; without errors every
    call emits k + 1 tokens."""
    model = family(name)
    ids = prompts(1)
    ref = np.asarray(generate(model, ids, max_new_tokens=M).tokens)
    seq = np.concatenate([np.asarray(ids), ref, np.zeros((2, 8), np.int32)], 1)
    out = speculative_generate(model, oracle_for(seq, (3, 5), pruned_vocab(seq), OracleBlockDraft), ids,
                               max_new_tokens=M, k=4)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)
    assert out.mean_acceptance_length > 1.5 and not np.array_equal(out.emitted[:, 0], out.emitted[:, 1])
    perfect = speculative_generate(model, oracle_for(seq, (0, 0), pruned_vocab(seq), OracleBlockDraft), ids,
                                   max_new_tokens=M, k=4)
    np.testing.assert_array_equal(np.asarray(perfect.tokens), ref)
    assert (perfect.emitted[:-1] == 5).all()


def test_block_draft_rejects_tree_mode_and_too_many_tokens():
    model = family("llama")
    draft = peagle_for(model, depths=3)
    with pytest.raises(ValueError, match="drafts at most 3 tokens"):
        speculative_generate(model, draft, prompts(0), max_new_tokens=4, k=4)
    with pytest.raises(ValueError, match="needs a chain draft"):
        speculative_generate(model, draft, prompts(0, 1), max_new_tokens=4, mode="tree")


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_greedy_chain_is_lossless_with_mtp(name):
    model = family(name)
    ids = prompts(4)
    ref = np.asarray(generate(model, ids, max_new_tokens=M).tokens)
    out = speculative_generate(model, MTPDraft(model), ids, max_new_tokens=M, k=3)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)


# ------------------------------------------------------------------------------------------------
# Tree mode
# ------------------------------------------------------------------------------------------------


def test_tree_with_one_child_per_node_is_the_chain():
    """tree_top_k 1 turns the tree into the chain: with an EAGLE-3 head (a real draft cache in the beam
    rows), the tree run of row 0 proposes and emits exactly what the batch-2 chain run did for row 0."""
    model = family("llama")
    draft = eagle3_for(model)
    chain = speculative_generate(model, draft, prompts(0), max_new_tokens=M, k=3)
    tree = speculative_generate(model, draft, prompts(0)[:1], max_new_tokens=M, mode="tree", tree_top_k=1,
                                tree_depth=3, tree_tokens=3)
    calls = int((chain.emitted[:, 0] > 0).sum())
    np.testing.assert_array_equal(np.asarray(tree.tokens), np.asarray(chain.tokens)[:1])
    np.testing.assert_array_equal(tree.emitted[:, 0], chain.emitted[:calls, 0])
    np.testing.assert_array_equal(tree.drafts[:, 0], chain.drafts[:calls, 0])


@pytest.mark.parametrize("name", ["llama", "deepseek_v3"])
def test_tree_recovers_where_the_chain_stops(name):
    """The strict oracle's runner-up is the right token where its first choice is wrong (every 3rd
    position): the tree follows that branch (whose beam cache must hold the right path) where the chain
    stops; both are greedy-exact, and the accepted path's KV entries are compacted (MLA latents for
    DeepSeek). The chain run is the high-acceptance test's (row 0 has the same oracle)."""
    model = family(name)
    ids = prompts(1)
    ref = np.asarray(generate(model, ids, max_new_tokens=M).tokens)
    seq = np.concatenate([np.asarray(ids), ref, np.zeros((2, 8), np.int32)], 1)
    tree = speculative_generate(model, oracle_for(seq[:1], (3,), pruned_vocab(seq)), ids[:1], max_new_tokens=M,
                                mode="tree", tree_top_k=3, tree_depth=4, tree_tokens=12)
    np.testing.assert_array_equal(np.asarray(tree.tokens), ref[:1])
    assert tree.mean_acceptance_length > 3.0
    chain = speculative_generate(model, oracle_for(seq, (3, 5), pruned_vocab(seq)), ids, max_new_tokens=M, k=4)
    chain_tau = chain.emitted[:, 0].sum() / (chain.emitted[:, 0] > 0).sum()
    assert tree.mean_acceptance_length > chain_tau
    print(f"{name}: τ chain {chain_tau:.2f}, tree {tree.mean_acceptance_length:.2f}")


def test_tree_rejects_what_it_does_not_support():
    model = family("llama")
    draft = OracleDraft(np.zeros((1, 4)), np.zeros((1, 4)), np.arange(V))
    with pytest.raises(ValueError, match="batch"):
        speculative_generate(model, draft, prompts(0), max_new_tokens=4, mode="tree")
    with pytest.raises(ValueError, match="temperature"):
        speculative_generate(model, draft, prompts(0, 1), max_new_tokens=4, mode="tree", temperature=1.0)
    with pytest.raises(ValueError, match="tree_tokens"):
        speculative_generate(model, draft, prompts(0, 1), max_new_tokens=4, mode="tree", tree_top_k=2,
                             tree_depth=2, tree_tokens=7)


# ------------------------------------------------------------------------------------------------
# Sampling: the emitted tokens follow the target distribution
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("top_p,drafting", [(1.0, "chain"), (0.8, "chain"), (1.0, "block"), (0.8, "block")])
def test_sampling_follows_the_target_markov_chain(top_p, drafting):
    """Target and draft are different Markov chains over 4 tokens; 20000 rows of one batched call. The
    joint distribution of the first three emitted tokens (one from the prefill, two through draft /
    verify / resample) is the target chain's; the draft chain's own samples (a target equal to the
    draft: every draft accepted unverified) fail the same test. `block`: all k drafts come from one
    parallel proposal that never sees the earlier drafts (P-EAGLE / DFlash) and stay exact."""
    n, rows, k = 4, 20000, 3
    P, Q = markov_matrix(10, n), markov_matrix(11, n)
    prompt = jnp.tile(jnp.array([[2, 1]] if top_p == 1.0 else [[1]], jnp.int32), (rows, 1))
    first = int(prompt[0, -1])

    def joint(probs):  # [n, n, n]: first three tokens after `first`
        return probs[first][:, None, None] * probs[:, :, None] * probs[None, :, :]

    def counts(target_probs):
        draft = MarkovDraft(Q) if drafting == "chain" else MarkovBlockDraft(Q)
        out = speculative_generate(MarkovLM(target_probs), draft, prompt, max_new_tokens=3, k=k,
                                   temperature=1.0, top_p=top_p, rng=jax.random.PRNGKey(1))
        toks = np.asarray(out.tokens)
        assert (np.asarray(out.lengths) == 3).all()
        return np.bincount(toks[:, 0] * n * n + toks[:, 1] * n + toks[:, 2], minlength=n ** 3), out

    target = nucleus(P, top_p)
    observed, out = counts(P)
    assert 1.0 < out.mean_acceptance_length < k + 1  # rejections happen
    assert chi_square_p(observed, joint(target)) > P_VALUE
    control, _ = counts(Q)
    if drafting == "chain":  # a block draft's unverified output is not the draft chain: no control here
        assert chi_square_p(control, joint(target)) < P_VALUE


@pytest.mark.parametrize("kind", ["eagle3", "peagle"])
def test_sampling_end_to_end_matches_target_softmax(kind):
    """Tiny Llama target (sharpened head) with a random EAGLE-3 (or P-EAGLE) head, temperature 1, 3000
    rows of one prompt: the first token (prefill) follows softmax(target logits), and the second (drafted
    and verified) follows its marginal sum_x p(x) p(. | x)."""
    model = Llama(LlamaConfig.tiny(V), rngs=nnx.Rngs(7))
    model.lm_head.kernel.set_value(model.lm_head.kernel.get_value() * 40.0)
    draft = eagle3_for(model, seed=8) if kind == "eagle3" else peagle_for(model, seed=8)
    rows, T = 3000, 4
    prompt = prompts(9, 1, T)
    out = speculative_generate(model, draft, jnp.tile(prompt, (rows, 1)), max_new_tokens=2, k=2, temperature=1.0,
                               rng=jax.random.PRNGKey(2))
    toks = np.asarray(out.tokens)
    every_x = jnp.concatenate([jnp.tile(prompt, (V, 1)), jnp.arange(V, dtype=jnp.int32)[:, None]], 1)  # [V, T+1]
    probs = np.asarray(jax.nn.softmax(jit_forward(model)(every_x), -1), np.float64)  # [V, T+1, V]
    p1 = probs[0, T - 1]  # p(x | prompt)
    p2 = p1 @ probs[:, T]  # sum_x p(x | prompt) p(. | prompt, x)
    assert chi_square_p(np.bincount(toks[:, 0], minlength=V), p1 / p1.sum()) > P_VALUE
    assert chi_square_p(np.bincount(toks[:, 1], minlength=V), p2 / p2.sum()) > P_VALUE
    assert chi_square_p(np.bincount(toks[:, 1], minlength=V), p1 / p1.sum()) < P_VALUE  # the test sees a change
