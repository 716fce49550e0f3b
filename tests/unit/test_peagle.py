"""P-EAGLE (models/peagle): one-forward parallel drafting against explicit references.

- `propose` (pending block + k − 1 mask entries through the cache, per-row lengths) equals the draft's
  plain no-cache forward over the same entries;
- the training view (`parallel_unroll`, every anchor at every depth in one pass) equals what `propose`
  drafts at inference from the same prefix;
- training updates exactly the draft's parameters (mask_hidden included, the target embedding frozen);
- the speculators layout round-trips and a bad file is named.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models.eagle3 import Eagle3Config, build_draft_vocab, ttt_loss
from models.peagle import PEagleConfig, PEagleDraft, load_peagle, parallel_unroll, save_peagle

V, VD, DT = 96, 64, 48  # target vocab, draft vocab, target width
AUX = (0, 1, 2)
DEPTHS = 4


def make_draft(seed: int = 0) -> PEagleDraft:
    base = Eagle3Config.tiny(vocab_size=V, draft_vocab_size=VD, hidden_size=DT, head_dim=12, aux_layer_ids=AUX)
    draft = PEagleDraft(PEagleConfig.from_eagle3(base, mask_token_id=V - 1, num_depths=DEPTHS), rngs=nnx.Rngs(seed))
    draft.load_embedding(np.random.default_rng(seed).normal(0, 0.5, (V, DT)).astype(np.float32))
    counts = np.where(np.arange(V) % 3 == 2, 0, 1000 - np.arange(V))
    d2t, t2d, _ = build_draft_vocab(counts, VD)
    draft.set_vocab(d2t, t2d)
    return draft


def features(rng: np.random.Generator, B: int, T: int) -> jax.Array:
    return jnp.asarray(rng.normal(size=(B, T, len(AUX) * DT)).astype(np.float32))


def test_propose_equals_the_plain_forward_of_the_same_entries():
    """Two rows with different cached prefixes and pending counts: the k logits `propose` returns equal the
    draft's no-cache forward over [prefix entries, real pending entries, k − 1 mask entries]."""
    draft = make_draft(1)
    rng = np.random.default_rng(2)
    B, W, k = 2, 5, 3
    prefix = (4, 7)  # cached entries per row
    n_valid = np.array([2, 4])
    ids = jnp.asarray(rng.integers(0, V, (B, 12)), jnp.int32)
    feats = features(rng, B, 12)

    cache = draft.init_cache(B, 32)
    for b in range(B):  # fill each row's cache with its own prefix (rows of different lengths)
        row_cache = draft.init_cache(1, 32)
        row_cache = draft.context(ids[b:b + 1, :prefix[b]], feats[b:b + 1, :prefix[b]],
                                  positions=jnp.arange(prefix[b])[None], cache=row_cache)
        cache = jax.tree.map(lambda full, one, b=b: full.at[b].set(one[0]) if full.ndim == 2 or full.ndim == 1
                             else full.at[:, b].set(one[:, 0]), cache, row_cache)
    pend_tok = jnp.stack([jnp.pad(ids[b, prefix[b]:prefix[b] + n_valid[b]], (0, W - n_valid[b])) for b in range(B)])
    pend_feat = jnp.stack([jnp.pad(feats[b, prefix[b]:prefix[b] + n_valid[b]], ((0, W - n_valid[b]), (0, 0)))
                           for b in range(B)])
    logits, new_cache = nnx.jit(lambda d, t, f, n, c: d.propose(t, f, n, cache=c, k=k))(
        draft, pend_tok, pend_feat, jnp.asarray(n_valid, jnp.int32), cache)
    assert logits.shape == (B, k, VD)
    np.testing.assert_array_equal(np.asarray(new_cache.length), np.add(prefix, n_valid))

    for b in range(B):
        n_real = prefix[b] + n_valid[b]
        tok = jnp.concatenate([ids[b, :n_real], jnp.full((k - 1,), V - 1, jnp.int32)])[None]
        mask_rows = jnp.broadcast_to(draft.mask_hidden[...], (k - 1, len(AUX) * DT))
        f = jnp.concatenate([feats[b, :n_real], mask_rows])[None]
        ref, _, _ = draft(tok, features=f, positions=jnp.arange(n_real + k - 1)[None])
        np.testing.assert_allclose(np.asarray(logits[b]), np.asarray(ref[0, n_real - 1:]), rtol=2e-5, atol=2e-5)


def test_parallel_unroll_is_what_propose_drafts():
    """Training view == inference view: depth d at anchor p of `parallel_unroll` equals logits[d] of
    `propose` run after the entries 0..p-1 were written to the cache, with entry p pending."""
    draft = make_draft(3)
    rng = np.random.default_rng(4)
    T = 10
    ids = jnp.asarray(rng.integers(0, V, (1, T)), jnp.int32)
    feats = features(rng, 1, T)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    depth_logits = list(parallel_unroll(draft, ids, feats, positions=pos, segment_ids=jnp.ones((1, T), jnp.int32),
                                        steps=DEPTHS))
    assert len(depth_logits) == DEPTHS
    for p in (0, 3, 8):
        cache = draft.init_cache(1, 32)
        if p:
            cache = draft.context(ids[:, :p], feats[:, :p], positions=pos[:, :p], cache=cache)
        logits, _ = draft.propose(ids[:, p:p + 1], feats[:, p:p + 1], jnp.array([1], jnp.int32), cache=cache,
                                  k=DEPTHS)
        for d in range(DEPTHS):
            np.testing.assert_allclose(np.asarray(logits[0, d]), np.asarray(depth_logits[d][0, p]), rtol=2e-5,
                                       atol=2e-5, err_msg=f"anchor {p} depth {d}")


def test_parallel_training_updates_the_draft_only():
    draft = make_draft(5)
    rng = np.random.default_rng(6)
    B, T = 2, 16
    seg = np.array([[1] * 9 + [2] * 7, [1] * 12 + [0] * 4])
    positions = np.where(seg == 2, np.arange(T) - 9, np.arange(T)) * (seg != 0)
    batch = {"target_ids": jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32),
             "positions": jnp.asarray(positions, jnp.int32), "segment_ids": jnp.asarray(seg, jnp.int32),
             "loss_mask": jnp.asarray((seg != 0).astype(np.int32))}
    feats = features(rng, B, T)
    target_logits = jnp.asarray(4.0 * rng.normal(size=(B, T, V)).astype(np.float32))
    embed_before = np.asarray(draft.embed_tokens.weight[...])
    before = jax.tree.map(np.asarray, nnx.state(draft, nnx.Param))
    opt = nnx.Optimizer(draft, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(draft, opt):
        def objective(m):
            loss, stats = ttt_loss(m, batch, feats, target_logits, steps=DEPTHS, decay=1.0, objective="lk_hybrid",
                                   unroll=parallel_unroll)
            return loss / jnp.sum(batch["loss_mask"]), stats

        (loss, stats), grads = nnx.value_and_grad(objective, has_aux=True)(draft)
        opt.update(draft, grads)
        return loss, stats

    losses = [float(step(draft, opt)[0]) for _ in range(15)]
    assert losses[-1] < 0.7 * losses[0], losses
    after = jax.tree.map(np.asarray, nnx.state(draft, nnx.Param))
    changed = {"/".join(map(str, p)) for (p, a), (_, b) in zip(nnx.to_flat_state(before), nnx.to_flat_state(after),
                                                                strict=True) if not np.array_equal(a, b)}
    assert "mask_hidden" in changed and len(changed) == len(list(nnx.to_flat_state(before)))
    np.testing.assert_array_equal(np.asarray(draft.embed_tokens.weight[...]), embed_before)


def test_speculators_layout_round_trip(tmp_path):
    draft = make_draft(7)
    target_config = {"vocab_size": V, "architectures": ["LlamaForCausalLM"], "eos_token_id": 2}
    save_peagle(draft, str(tmp_path / "fp32"), target_config=target_config, verifier_name_or_path="../model",
                dtype="float32")
    cfg = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle" and cfg["architectures"] == ["PEagleSpeculator"]
    assert cfg["mask_token_id"] == V - 1 and cfg["speculators_config"]["proposal_methods"][0][
        "speculative_tokens"] == DEPTHS
    loaded = load_peagle(str(tmp_path / "fp32"), draft.embed_tokens.weight[...])
    assert loaded.config == draft.config
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(draft)), nnx.to_flat_state(nnx.state(loaded)),
                                 strict=True):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))

    save_peagle(draft, str(tmp_path / "bf16"), target_config=target_config, verifier_name_or_path="../model")
    assert load_peagle(str(tmp_path / "bf16"), draft.embed_tokens.weight[...]).config == draft.config

    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    del tensors["mask_hidden"]
    save_file(tensors, str(tmp_path / "fp32" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensors do not match the PEagleDraft: 1 missing: "
                                         r"mask_hidden"):
        load_peagle(str(tmp_path / "fp32"), draft.embed_tokens.weight[...])
