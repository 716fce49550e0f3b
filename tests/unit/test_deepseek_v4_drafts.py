"""DeepSeek-V4 as a speculative-decoding target (docs/models/deepseek-v4.md): `return_hidden` gives each layer's
feature [B, T, D] (the mean of its mHC streams), the LM head is `lm_head` to every reader (untied), and an EAGLE-3
draft sized for V4 trains on those features and verifies losslessly against the tiny target, past its sliding
window and both compression rates, untrained (rolling the compressed cache back at nearly every call) and trained.

    pytest tests/unit/test_deepseek_v4_drafts.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models import generate
from models.decoder import DecoderLM
from models.deepseek_v4 import DeepseekV4, DeepseekV4Config
from models.drafts import target_head
from models.eagle3 import Eagle3Config, Eagle3Draft, build_draft_vocab, default_aux_layer_ids, ttt_loss
from models.quant import quant_units
from models.speculative import speculative_generate

pytestmark = pytest.mark.unit
jax.config.update("jax_default_matmul_precision", "highest")

V, VD = 32, 24  # target vocabulary, draft vocabulary


def perturbed_v4(vocab: int = V) -> DeepseekV4:
    """The tiny V4 (sliding, CSA, HCA layers; 2 streams; window 8, rates 4 and 8) with mHC weights perturbed as the
    parity tests do, so that the streams differ from each other and the stream mean is not any one stream."""
    model = DeepseekV4(DeepseekV4Config.tiny(vocab), rngs=nnx.Rngs(0))
    for i, layer in enumerate(model.layers):
        for part in ("attn", "ffn"):
            base, fn = getattr(layer, f"hc_{part}_base"), getattr(layer, f"hc_{part}_fn")
            base.set_value(0.5 * jax.random.normal(jax.random.PRNGKey(i), base.get_value().shape))
            fn.set_value(10 * fn.get_value())
    return model


@pytest.fixture(scope="module")
def target() -> DeepseekV4:
    return perturbed_v4()


def test_layer_features_are_the_stream_means_and_the_head_is_untied(target, monkeypatch):
    ids = jnp.asarray(np.random.default_rng(0).integers(0, V, (2, 20)), jnp.int32)
    L = target.config.num_hidden_layers
    logits, hidden = target(ids, return_hidden=(0, 1, 2, -1))
    assert [h.shape for h in hidden] == [(2, 20, 64)] * 4
    with monkeypatch.context() as m:  # the raw residual: the streams [B, T, n, D]
        m.setattr(DeepseekV4, "layer_feature", DecoderLM.layer_feature)
        _, streams = target(ids, return_hidden=tuple(range(L)))
    assert streams[0].shape == (2, 20, 2, 64)
    for got, s in zip(hidden[:L], streams, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(jnp.mean(s, axis=2)), rtol=1e-6, atol=1e-6)
        spread = float(jnp.max(jnp.abs(s[:, :, 0] - s[:, :, 1])) / jnp.max(jnp.abs(s)))
        assert spread > 0.05, spread  # the streams differ: which reduction is the feature matters
    # the LM head: `head` on disk, `lm_head` to every reader; the drafts' target head is it, not the embedding
    assert target.lm_head is target.head and target.lm_head is not None
    np.testing.assert_array_equal(np.asarray(target_head(target)), np.asarray(target.head.weight()).T)
    assert not np.array_equal(np.asarray(target_head(target)), np.asarray(target.embed_tokens.weight[...]))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(target.head(hidden[-1])), rtol=1e-6, atol=1e-6)
    assert "head" not in [u.name for u in quant_units(target)]  # the head stays float, as lm_head does
    tied = DeepseekV4(DeepseekV4Config.tiny(V, tie_word_embeddings=True), rngs=nnx.Rngs(0))
    assert tied.lm_head is None and tied.head is None


def test_eagle3_draft_trains_on_v4_features_and_verifies_losslessly(target):
    cfg = Eagle3Config.for_target(target.config, draft_vocab_size=VD)
    assert cfg.aux_layer_ids == default_aux_layer_ids(target.config.num_hidden_layers)  # chosen as for the others
    assert cfg.target_hidden_size == target.config.hidden_size
    draft = Eagle3Draft(cfg, rngs=nnx.Rngs(1))
    draft.load_embedding(target.embed_tokens.weight[...])
    d2t, t2d, _ = build_draft_vocab(np.where(np.arange(V) % 4 == 3, 0, 100 + np.arange(V)), VD)
    draft.set_vocab(d2t, t2d)

    # one packed batch of the target's own greedy continuations; features and logits from the target
    prompt = jnp.asarray(np.random.default_rng(1).integers(0, V, (2, 5)), jnp.int32)
    ref = generate(target, prompt, max_new_tokens=14).tokens  # [2, 14]
    # the untrained draft first (the same compiled program as the trained one's below): most drafts are rejected,
    # so the verify calls roll the compressed cache back mid-window, and the tokens are still greedy's
    out = speculative_generate(target, draft, prompt, max_new_tokens=14, k=3)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref))
    assert out.mean_acceptance_length < 2.0, out.mean_acceptance_length
    seq = jnp.concatenate([prompt, ref], axis=1)  # [2, 19]
    logits, hidden = target(seq, return_hidden=draft.target_layers)
    feats = jnp.concatenate(hidden, axis=-1)  # [2, 20, 3·D]
    T = seq.shape[1]
    batch = {"input_ids": seq, "target_ids": jnp.roll(seq, -1, axis=1),
             "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T)),
             "segment_ids": jnp.ones((2, T), jnp.int32), "loss_mask": jnp.ones((2, T), jnp.int32).at[:, -1].set(0)}
    optimizer = nnx.Optimizer(draft, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(draft, optimizer):
        def objective(model):
            loss, _ = ttt_loss(model, batch, feats, logits, steps=3)
            return loss / jnp.sum(batch["loss_mask"])

        loss, grads = nnx.value_and_grad(objective, argnums=nnx.DiffState(0, nnx.Param))(draft)
        optimizer.update(draft, grads)
        return loss

    losses = [float(step(draft, optimizer)) for _ in range(6)]
    assert losses[-1] < 0.9 * losses[0], losses

    # lossless: token for token greedy generate, over 19 positions (past the window 8 and both rates)
    out = speculative_generate(target, draft, prompt, max_new_tokens=14, k=3)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref))
    assert out.lengths.tolist() == [14, 14] and 1.0 <= out.mean_acceptance_length <= 4.0
    with pytest.raises(NotImplementedError, match="tree"):  # a tree's branches would mix in compressed windows
        speculative_generate(target, draft, prompt[:1], max_new_tokens=4, mode="tree")
