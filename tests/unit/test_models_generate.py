"""Generation: jitted greedy / sampling loops, padding, hidden states (speculative decoding:
test_speculative.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import Llama, LlamaConfig, generate, jit_forward
from models.generate import sample_token

pytestmark = pytest.mark.unit
jax.config.update("jax_default_matmul_precision", "highest")

V = 96


@pytest.fixture(scope="module")
def target():
    return Llama(LlamaConfig.tiny(V), rngs=nnx.Rngs(0))


def naive_greedy(model, ids: np.ndarray, n: int, width: int = 16) -> np.ndarray:
    """Greedy by full forwards over a fixed-width right-padded buffer (one compile; causal => exact)."""
    forward = jit_forward(model)
    B, T = ids.shape
    seq = np.zeros((B, width), np.int32)
    seq[:, :T] = ids
    for t in range(T, T + n):
        seq[:, t] = np.asarray(jnp.argmax(forward(jnp.asarray(seq))[:, t - 1], -1))
    return seq[:, T : T + n]


def test_greedy_equals_full_forward_argmax(target):
    ids = np.random.default_rng(0).integers(0, V, (2, 5)).astype(np.int32)
    out = generate(target, jnp.asarray(ids), max_new_tokens=6)
    np.testing.assert_array_equal(np.asarray(out.tokens), naive_greedy(target, ids, 6))
    assert out.lengths.tolist() == [6, 6]


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_rows_equal_unpadded(target, side):
    rng = np.random.default_rng(1)
    short, long = rng.integers(1, V, (1, 3)).astype(np.int32), rng.integers(1, V, (1, 6)).astype(np.int32)
    pad = np.zeros((1, 3), np.int32)
    row0 = np.concatenate([pad, short], 1) if side == "left" else np.concatenate([short, pad], 1)
    batch = np.concatenate([row0, long], 0)
    out = generate(target, jnp.asarray(batch), prompt_lengths=jnp.array([3, 6]), padding_side=side,
                   max_new_tokens=5)
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), naive_greedy(target, short, 5)[0])
    np.testing.assert_array_equal(np.asarray(out.tokens[1]), naive_greedy(target, long, 5)[0])


@pytest.mark.parametrize("side", ["left", "right"])
def test_n_samples_per_prompt_equal_generating_from_the_repeated_prompts(target, side):
    """`num_samples` n (vLLM's `n`; GRPO's groups): each prompt prefilled once, its cache repeated for its n
    rows, gives the tokens of generating from every prompt repeated n times with the same rng, sampled and greedy,
    on padded prompts of different lengths, with rows stopping at eos; the samples of a prompt differ."""
    rng = np.random.default_rng(4)
    lengths = np.asarray([3, 6, 4], np.int32)
    ids = np.zeros((3, 6), np.int32)
    for i, m in enumerate(lengths):
        row = rng.integers(1, V, m)
        if side == "left":
            ids[i, 6 - m :] = row
        else:
            ids[i, :m] = row
    n = 4
    opts = dict(max_new_tokens=7, padding_side=side, eos_token_id=5, pad_token_id=0, rng=jax.random.PRNGKey(2))
    for temperature in (1.3, 0.0):
        grouped = generate(target, jnp.asarray(ids), prompt_lengths=jnp.asarray(lengths), num_samples=n,
                           temperature=temperature, **opts)
        repeated = generate(target, jnp.asarray(np.repeat(ids, n, 0)), prompt_lengths=jnp.asarray(
            np.repeat(lengths, n)), temperature=temperature, **opts)
        np.testing.assert_array_equal(np.asarray(grouped.tokens), np.asarray(repeated.tokens))
        np.testing.assert_array_equal(np.asarray(grouped.lengths), np.asarray(repeated.lengths))
        assert grouped.tokens.shape == (12, 7)
        stopped = np.asarray(grouped.lengths).min() < 7  # a row that met eos (greedy: prompt 1's rows)
    assert stopped
    sampled = np.asarray(generate(target, jnp.asarray(ids), prompt_lengths=jnp.asarray(lengths), num_samples=n,
                                  temperature=1.3, **opts).tokens).reshape(3, n, 7)
    assert all(len({tuple(r) for r in group}) > 1 for group in sampled)
    with pytest.raises(ValueError, match="num_samples"):
        generate(target, jnp.asarray(ids), max_new_tokens=2, num_samples=2, return_hidden=(0,))


def test_eos_stops_row_and_pads(target):
    ids = np.random.default_rng(2).integers(0, V, (1, 4)).astype(np.int32)
    ref = naive_greedy(target, ids, 8)[0]
    eos = int(ref[2])
    stop = int(np.argmax(ref == eos))
    out = generate(target, jnp.asarray(ids), max_new_tokens=8, eos_token_id=[eos, V + 5], pad_token_id=V - 1)
    assert int(out.lengths[0]) == stop + 1
    np.testing.assert_array_equal(np.asarray(out.tokens[0, : stop + 1]), ref[: stop + 1])
    assert np.all(np.asarray(out.tokens[0, stop + 1 :]) == V - 1)


def test_return_hidden_matches_forward_over_generated_sequence(target):
    ids = np.random.default_rng(3).integers(0, V, (2, 4)).astype(np.int32)
    out = generate(target, jnp.asarray(ids), max_new_tokens=5, return_hidden=(0, -1))
    full = jnp.concatenate([jnp.asarray(ids), out.tokens], axis=1)
    _, hidden = jit_forward(target)(full, return_hidden=(0, -1))
    assert [h.shape for h in out.hidden] == [(2, 9, 64), (2, 9, 64)]
    for ours, ref in zip(out.hidden, hidden, strict=True):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), atol=1e-5)


def test_sampling_is_reproducible_and_uses_rng(target):
    ids = jnp.zeros((2, 3), jnp.int32)
    a = generate(target, ids, max_new_tokens=8, temperature=1.5, rng=jax.random.PRNGKey(7))
    b = generate(target, ids, max_new_tokens=8, temperature=1.5, rng=jax.random.PRNGKey(7))
    c = generate(target, ids, max_new_tokens=8, temperature=1.5, rng=jax.random.PRNGKey(8))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))


def test_top_p_only_draws_from_the_nucleus():
    probs = np.array([0.45, 0.25, 0.15, 0.08, 0.04, 0.03])  # top_p 0.8 -> {0, 1, 2}
    logits = jnp.log(jnp.asarray(probs, jnp.float32))[None].repeat(4000, 0)
    draws = sample_token(logits, jax.random.PRNGKey(0), temperature=1.0, top_p=0.8, use_top_p=True)
    counts = np.bincount(np.asarray(draws), minlength=6)
    assert counts[3:].sum() == 0 and np.all(counts[:3] > 0)
    np.testing.assert_allclose(counts[:3] / 4000, probs[:3] / probs[:3].sum(), atol=0.03)
    # through generate: with a tiny nucleus sampling is greedy
    draws = sample_token(logits[:8], jax.random.PRNGKey(1), temperature=1.0, top_p=0.1, use_top_p=True)
    assert np.all(np.asarray(draws) == 0)


def test_top_p_generate_tiny_nucleus_is_greedy(target):
    ids = jnp.ones((1, 4), jnp.int32)
    greedy = generate(target, ids, max_new_tokens=6)
    nucleus = generate(target, ids, max_new_tokens=6, temperature=1.0, top_p=1e-6, rng=jax.random.PRNGKey(3))
    np.testing.assert_array_equal(np.asarray(greedy.tokens), np.asarray(nucleus.tokens))


def test_jit_forward_shares_one_program_per_structure():
    """Two models of one structure (different weights) run one compiled program and each gets its own
    logits; a model whose graphdef cannot be hashed gets a program of its own instead of an error."""
    from models.generate import _shared_forward

    config = LlamaConfig.tiny(num_hidden_layers=1)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 6)), jnp.int32)
    a, b = Llama(config, rngs=nnx.Rngs(11)), Llama(config, rngs=nnx.Rngs(12))
    before = _shared_forward._cache_size()
    out_a, out_b = np.asarray(jit_forward(a)(ids)), np.asarray(jit_forward(b)(ids))
    assert _shared_forward._cache_size() == before + 1
    np.testing.assert_allclose(out_a, np.asarray(a(ids)), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out_b, np.asarray(b(ids)), rtol=1e-5, atol=1e-5)
    assert np.abs(out_a - out_b).max() > 1e-3

    class Unhashable(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.arange(3.0))
            self.meta = {"kind": ["static", "but", "a", "dict"]}  # static, unhashable

        def __call__(self, x, **kw):
            return x * self.w

    got = jit_forward(Unhashable())(jnp.ones((3,)))
    np.testing.assert_array_equal(np.asarray(got), [0.0, 1.0, 2.0])
