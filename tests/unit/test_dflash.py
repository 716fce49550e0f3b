"""DFlash block drafter (models/dflash/): `propose` against a plain-numpy reference with an explicitly
built mask, the cached `context` / `propose` path against the cache-free training forward, the block
loss against a loop reference, trainability, the speculators export round trip and `for_target`.

    pytest tests/unit/test_dflash.py
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
import safetensors.numpy
from flax import nnx

from models.dflash import DFlashConfig, DFlashDraft, block_loss, load_dflash, save_dflash, select_anchors
from models.draft_losses import TargetHead
from models.eagle3 import build_draft_vocab
from models.layers import Buffer
from models.qwen3 import qwen3_config

pytestmark = pytest.mark.unit
jax.config.update("jax_default_matmul_precision", "highest")

V, VD, D, NA = 96, 40, 32, 3  # target vocab, draft vocab, width, aux layers
N, K, H, F = 4, 2, 8, 64
BS = 4  # block size: the anchor + 3 proposed tokens
MASK = V - 1


def make_draft(seed: int = 0, layers: int = 2, draft_vocab: int = VD) -> DFlashDraft:
    cfg = DFlashConfig.tiny(V, draft_vocab, hidden_size=D, intermediate_size=F, num_attention_heads=N,
                            num_key_value_heads=K, head_dim=H, num_hidden_layers=layers, aux_layer_ids=(1, 3, 4),
                            block_size=BS, mask_token_id=MASK)
    draft = nnx.jit(lambda: DFlashDraft(cfg, rngs=nnx.Rngs(seed)))()
    # matrices 8× the 0.02 init and norm gains around 1, so that every piece matters in the comparisons
    params = nnx.state(draft, nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 100), len(leaves))
    new = [x * 8.0 if x.ndim == 2 else 1.0 + 0.2 * jax.random.normal(k, x.shape)
           for k, x in zip(keys, leaves, strict=True)]
    nnx.update(draft, jax.tree.unflatten(treedef, new))
    rng = np.random.default_rng(seed)
    draft.load_embedding(rng.normal(size=(V, D)).astype(np.float32))
    if draft_vocab < V:
        d2t, t2d, _ = build_draft_vocab(rng.integers(0, 50, size=V), draft_vocab)
        draft.set_vocab(d2t, t2d)
    draft.load_lm_head(0.3 * rng.normal(size=(V, D)).astype(np.float32))
    return draft


@pytest.fixture(scope="module")
def draft() -> DFlashDraft:
    return make_draft()


# ------------------------------------------------------------------------------------------------
# a plain-numpy reference of one block (float64)
# ------------------------------------------------------------------------------------------------


def np_weights(draft: DFlashDraft) -> dict:
    a = lambda x: np.asarray(x, np.float64)
    layers = []
    for layer in draft.layers:
        sa = layer.self_attn
        layers.append(dict(ln1=a(layer.input_layernorm.weight[...]), ln2=a(layer.post_attention_layernorm.weight[...]),
                           q=a(sa.q_proj.kernel[...]), k=a(sa.k_proj.kernel[...]), v=a(sa.v_proj.kernel[...]),
                           o=a(sa.o_proj.kernel[...]), qn=a(sa.q_norm.weight[...]), kn=a(sa.k_norm.weight[...]),
                           gate=a(layer.mlp.gate_proj.kernel[...]), up=a(layer.mlp.up_proj.kernel[...]),
                           down=a(layer.mlp.down_proj.kernel[...])))
    return dict(fc=a(draft.fc.kernel[...]), hn=a(draft.hidden_norm.weight[...]), norm=a(draft.norm.weight[...]),
                head=a(draft.lm_head.kernel[...]), embed=a(draft.embed_tokens.weight[...]), layers=layers,
                eps=draft.config.rms_norm_eps, theta=draft.config.rope_theta)


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x, pos, theta):
    """x [T, n, H] rotated at integer positions [T] (NeoX halves)."""
    inv = 1.0 / theta ** (np.arange(0, H, 2) / H)
    ang = np.asarray(pos, np.float64)[:, None] * inv[None]
    ang = np.concatenate([ang, ang], -1)[:, None, :]  # [T, 1, H]
    x1, x2 = x[..., : H // 2], x[..., H // 2:]
    return x * np.cos(ang) + np.concatenate([-x2, x1], -1) * np.sin(ang)


def ref_block(W: dict, ctx_feats, ctx_pos, ctx_allowed, block_ids, block_pos) -> np.ndarray:
    """Logits [bs, Vd] of one block over a context of S features (ctx_allowed [S]: which ones the
    block may read), attention over [context; block] under an explicitly built [bs, S + bs] mask."""
    eps, th = W["eps"], W["theta"]
    S, bs = len(ctx_pos), len(block_ids)
    mask = np.zeros((bs, S + bs), bool)
    for i in range(bs):
        for s in range(S):
            mask[i, s] = bool(ctx_allowed[s])
        for j in range(bs):
            mask[i, S + j] = True  # bidirectional inside the block
    c = rms(np.asarray(ctx_feats, np.float64) @ W["fc"], W["hn"], eps)  # [S, D]
    h = W["embed"][np.asarray(block_ids)]  # [bs, D]
    for L in W["layers"]:
        x = rms(h, L["ln1"], eps)
        q = rope(rms((x @ L["q"]).reshape(bs, N, H), L["qn"], eps), block_pos, th)
        kb = rope(rms((x @ L["k"]).reshape(bs, K, H), L["kn"], eps), block_pos, th)
        kc = rope(rms((c @ L["k"]).reshape(S, K, H), L["kn"], eps), ctx_pos, th)
        k = np.concatenate([kc, kb])  # [S + bs, K, H]
        v = np.concatenate([(c @ L["v"]).reshape(S, K, H), (x @ L["v"]).reshape(bs, K, H)])
        out = np.zeros((bs, N, H))
        for n in range(N):
            s = q[:, n] @ k[:, n // (N // K)].T / np.sqrt(H)  # [bs, S + bs]
            s = np.where(mask, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[:, n] = p @ v[:, n // (N // K)]
        h = h + out.reshape(bs, N * H) @ L["o"]
        y = rms(h, L["ln2"], eps)
        g = y @ L["gate"]
        h = h + ((g / (1 + np.exp(-g))) * (y @ L["up"])) @ L["down"]
    return rms(h, W["norm"], eps) @ W["head"]


def sequence(seed: int, B: int, L: int):
    """Tokens t_0..t_L and features f_0..f_{L-1} per row."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, V - 1, size=(B, L + 1)).astype(np.int32)
    feats = rng.normal(size=(B, L, NA * D)).astype(np.float32)
    return toks, feats


# ------------------------------------------------------------------------------------------------
# forward, cache and propose
# ------------------------------------------------------------------------------------------------


def test_shapes_variable_kinds_and_interface(draft):
    assert draft.target_layers == (1, 3, 4) and draft.max_block == BS - 1
    ids_map = np.asarray(draft.target_token_ids)
    assert ids_map.dtype == np.int32 and ids_map.shape == (VD,)
    np.testing.assert_array_equal(ids_map, np.flatnonzero(np.asarray(draft.t2d[...])))
    params = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(draft, nnx.Param))}
    assert {p.split(".")[0] for p in params} == {"fc", "hidden_norm", "layers", "norm"}
    assert {p for p in params if p.startswith("layers.1.self_attn")} == {
        f"layers.1.self_attn.{n}" for n in ("q_proj.kernel", "k_proj.kernel", "v_proj.kernel", "o_proj.kernel",
                                            "q_norm.weight", "k_norm.weight")}
    buffers = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(draft, Buffer))}
    assert buffers == {"embed_tokens.weight", "lm_head.kernel", "d2t", "t2d"}
    trainable_head = DFlashDraft(DFlashConfig.tiny(V, VD, train_lm_head=True), rngs=nnx.Rngs(0))
    assert "lm_head" in {p[0] for p, _ in nnx.to_flat_state(nnx.state(trainable_head, nnx.Param))}
    cache = draft.init_cache(3, 16)
    assert cache.k.shape == (2, 3, K, 16, H)
    logits = nnx.eval_shape(lambda m: m(jnp.zeros((2, 10), jnp.int32), jnp.ones((2, 10, NA * D)),
                                        jnp.zeros((2, 5), jnp.int32)), draft)
    assert logits.shape == (2, 5, BS, VD)
    with pytest.raises(ValueError, match="k=4"):
        draft.propose(jnp.zeros((1, 2), jnp.int32), jnp.ones((1, 2, NA * D)), jnp.ones((1,), jnp.int32),
                      cache=draft.init_cache(1, 8), k=4)


propose = nnx.jit(lambda m, ids, f, nv, cache, k: m.propose(ids, f, nv, cache=cache, k=k), static_argnames="k")
context = nnx.jit(lambda m, ids, f, pos, seg, cache: m.context(ids, f, positions=pos, segment_ids=seg, cache=cache))


def test_propose_matches_plain_reference(draft):
    """Two rows with different cache lengths (3 and 5 after a rollback over stale slots) and
    different numbers of real pending entries (2 and 4): per-row anchors, positions and contexts."""
    toks, feats = sequence(0, 2, 12)
    W_ = np_weights(draft)
    cache = draft.init_cache(2, 16)
    cache = context(draft, jnp.asarray(toks[:, 1:6]), jnp.asarray(feats[:, :5]), jnp.arange(5)[None].repeat(2, 0),
                    None, cache)
    cache = cache.rollback(jnp.array([3, 5]))  # row 0's slots 3, 4 now stale
    lens, nv, W, k = np.array([3, 5]), np.array([2, 4]), 4, 2
    ids = np.stack([toks[b, lens[b] + 1: lens[b] + 1 + W] for b in range(2)])  # entry j: t_{p+1}
    fts = np.stack([feats[b, lens[b]: lens[b] + W] for b in range(2)])  # entry j: f_p
    logits, new = propose(draft, jnp.asarray(ids), jnp.asarray(fts), jnp.asarray(nv), cache, k)
    assert logits.shape == (2, k, VD)
    P = lens + nv
    assert np.asarray(new.length).tolist() == P.tolist()
    for b in range(2):
        # the reference sees the whole written cache (stale / pending-invalid slots included) and
        # an explicit mask: slots < P are the row's real context, the rest must not be read
        S = lens[b] + W
        ctx = np.concatenate([feats[b, : lens[b]], fts[b]])  # [S, F]
        ref = ref_block(W_, ctx, np.arange(S), np.arange(S) < P[b], [ids[b, nv[b] - 1]] + [MASK] * k,
                        P[b] + np.arange(k + 1))
        np.testing.assert_allclose(np.asarray(logits[b]), ref[1:], rtol=2e-5, atol=2e-5)


def test_context_then_propose_equals_cache_free_forward(draft):
    """A prompt cached with `context`, then two `propose` rounds with per-row accepted counts; each
    round equals the training forward (no cache) anchored at the row's P, and the cache holds exactly
    the real entries (same keys as one `context` call over them, every slot < length valid)."""
    B, L = 2, 14
    toks, feats = sequence(1, B, L)
    cache = draft.init_cache(B, 16)
    cache = context(draft, jnp.asarray(toks[:, 1:5]), jnp.asarray(feats[:, :4]), jnp.arange(4)[None].repeat(B, 0),
                    None, cache)
    forward = nnx.jit(lambda m, ids, f, a: m(ids, f, a))
    full_ids = jnp.asarray(toks[:, :L])  # input_ids[p] = t_p
    full_feats = jnp.asarray(feats)  # f_p
    lens = np.array([4, 4])
    for nv in (np.array([3, 1]), np.array([2, 3])):
        W = 3
        ids = np.stack([toks[b, lens[b] + 1: lens[b] + 1 + W] for b in range(B)])
        fts = np.stack([feats[b, lens[b]: lens[b] + W] for b in range(B)])
        logits, cache = propose(draft, jnp.asarray(ids), jnp.asarray(fts), jnp.asarray(nv), cache, BS - 1)
        lens = lens + nv
        assert np.asarray(cache.length).tolist() == lens.tolist()
        want = forward(draft, full_ids, full_feats, jnp.asarray(lens[:, None], jnp.int32))  # [B, 1, BS, Vd]
        np.testing.assert_allclose(np.asarray(logits), np.asarray(want[:, 0, 1:]), rtol=2e-5, atol=2e-5)
    # the cache holds exactly the real entries
    ref = context(draft, full_ids, full_feats[:, :L], jnp.arange(L)[None].repeat(B, 0), None, draft.init_cache(B, 16))
    for b in range(B):
        n = lens[b]
        assert np.asarray(cache.valid[b, :n]).all()
        np.testing.assert_allclose(np.asarray(cache.k[:, b, :, :n]), np.asarray(ref.k[:, b, :, :n]), rtol=1e-6,
                                   atol=1e-6)
        np.testing.assert_allclose(np.asarray(cache.v[:, b, :, :n]), np.asarray(ref.v[:, b, :, :n]), rtol=1e-6,
                                   atol=1e-6)


def test_context_segment_ids_mark_invalid_entries(draft):
    toks, feats = sequence(2, 1, 6)
    seg = jnp.array([[1, 1, 1, 0, 0, 0]])
    cache = context(draft, jnp.asarray(toks[:, 1:7]), jnp.asarray(feats), jnp.arange(6)[None], seg,
                    draft.init_cache(1, 8))
    assert np.asarray(cache.length).tolist() == [6]
    assert np.asarray(cache.valid[0]).tolist() == [True] * 3 + [False] * 5


# ------------------------------------------------------------------------------------------------
# block loss
# ------------------------------------------------------------------------------------------------


def packed_batch(seed: int = 0, T: int = 16):
    """Row 0: [seg 1 ×8, seg 2 ×6, padding ×2]; row 1: one segment. Labels peaked inside the draft
    vocabulary at most positions (some argmaxes outside it)."""
    rng = np.random.default_rng(seed)
    seg = np.array([[1] * 8 + [2] * 6 + [0] * 2, [1] * T], np.int32)
    positions = np.zeros_like(seg)
    for b in range(2):
        for p in range(1, T):
            positions[b, p] = positions[b, p - 1] + 1 if seg[b, p] == seg[b, p - 1] else 0
    input_ids = rng.integers(0, V - 1, size=(2, T)).astype(np.int32)
    target_ids = np.roll(input_ids, -1, axis=1)
    loss_mask = ((rng.random((2, T)) < 0.85) & (seg != 0)).astype(np.int32)
    loss_mask[0, 7] = 0  # the last token of segment 1 has no next token in it
    batch = {"input_ids": input_ids, "target_ids": target_ids, "positions": positions, "segment_ids": seg,
             "loss_mask": loss_mask}
    features = rng.normal(size=(2, T, NA * D)).astype(np.float32)
    target_logits = 3.0 * rng.normal(size=(2, T, V)).astype(np.float32)
    return {k: jnp.asarray(v) for k, v in batch.items()}, jnp.asarray(features), jnp.asarray(target_logits)


def reference_block_loss(draft: DFlashDraft, batch, feats, tl, num_anchors: int, objective: str, gamma: float):
    """Loops: anchors = the first candidates (speculators' rule in our alignment), per-block logits
    from `ref_block`, labels / masks per slot, the objective in numpy."""
    b_ = {k: np.asarray(v) for k, v in batch.items()}
    seg, pos, lm, ids = b_["segment_ids"], b_["positions"], b_["loss_mask"], b_["input_ids"]
    feats, tl = np.asarray(feats, np.float64), np.asarray(tl, np.float64)
    t2d = np.asarray(draft.t2d[...])
    W_ = np_weights(draft)
    B, T = seg.shape
    loss, num, den = np.zeros(BS - 1), np.zeros(BS - 1), np.zeros(BS - 1)
    for b in range(B):
        cands = [a for a in range(1, T - BS) if lm[b, a - 1] and seg[b, a] != 0 and seg[b, a - 1] == seg[b, a]]
        for a in cands[:num_anchors]:
            allowed = (np.arange(T) < a) & (seg[b] == seg[b, a])
            block = [ids[b, a]] + [MASK] * (BS - 1)
            logits = ref_block(W_, feats[b], pos[b], allowed, block, pos[b, a] + np.arange(BS))
            for j in range(1, BS):
                q = a + j - 1  # label position: target logits that predict t_{a+j}
                if not lm[b, q] or seg[b, a + j] != seg[b, a] or not t2d[np.argmax(tl[b, q])]:
                    continue
                lab = tl[b, q][t2d]
                P = np.exp(lab - lab.max())
                P /= P.sum()
                Q = np.exp(logits[j] - logits[j].max())
                Q /= Q.sum()
                loss[j - 1] += (P * np.log(P / Q)).sum() if objective == "kl_div" else 1.0 - np.minimum(P, Q).sum()
                num[j - 1] += float(np.argmax(logits[j]) == np.argmax(lab))
                den[j - 1] += 1
    w = np.exp(-np.arange(BS - 1) / gamma)
    return (w * loss).sum(), loss, num, den


def assert_matches_loop_reference(draft: DFlashDraft, batch, feats, target, full_logits, objective: str = "kl_div"):
    """block_loss on `target` (full logits or a TargetHead) equals `reference_block_loss` on the full logits: the
    per-slot sums, the total, the agreements and the counts (which must hold enough scored slots)."""
    n, gamma = 4, 3.0
    total, stats = jax.jit(lambda b, f, t: block_loss(draft, b, f, t, num_anchors=n, objective=objective,
                                                      gamma=gamma))(batch, feats, target)
    ref_total, loss, num, den = reference_block_loss(draft, batch, feats, full_logits, n, objective, gamma)
    assert den.sum() > 10 and den[-1] > 0
    np.testing.assert_allclose(np.asarray(stats["loss"]), loss, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(float(total), ref_total, rtol=2e-5)
    assert np.asarray(stats["acc_num"]).tolist() == num.tolist()
    assert np.asarray(stats["acc_den"]).tolist() == den.tolist()


@pytest.mark.parametrize("objective", ["kl_div", "tv"])
def test_block_loss_matches_loop_reference(draft, objective):
    batch, feats, tl = packed_batch(0)
    used = np.asarray(draft.target_token_ids)
    tl = tl.at[:, ::2, used[::3]].add(6.0)  # most (not all) argmaxes inside the draft vocabulary
    assert_matches_loop_reference(draft, batch, feats, tl, tl, objective)


def test_block_loss_from_the_target_head_matches_the_loop_reference(draft):
    """The draft stage's factored target (`TargetHead`: final hidden states and LM head, the labels computed at
    the label positions only) gives the loop reference's sums on its full logits."""
    batch, feats, _ = packed_batch(1)
    rng = np.random.default_rng(7)
    hidden = jnp.asarray(rng.normal(size=(*batch["input_ids"].shape, 12)).astype(np.float32))
    head = np.asarray(rng.normal(size=(V, 12)).astype(np.float32))
    used = np.asarray(draft.target_token_ids)
    head[used[::3]] *= 3.0  # most (not all) argmaxes inside the draft vocabulary
    head = jnp.asarray(head)
    tl = jnp.einsum("btd,vd->btv", hidden, head)
    in_vocab = np.asarray(draft.t2d[...])[np.asarray(tl).argmax(-1)]
    assert 0 < in_vocab.mean() < 1
    assert_matches_loop_reference(draft, batch, feats, TargetHead(hidden, head), tl)


def test_select_anchors_rule_and_randomness():
    batch, _, _ = packed_batch(1)
    seg, lm = np.asarray(batch["segment_ids"]), np.asarray(batch["loss_mask"])
    T = seg.shape[1]
    cands = [{a for a in range(1, T - BS) if lm[b, a - 1] and seg[b, a] and seg[b, a - 1] == seg[b, a]}
             for b in range(2)]
    first, valid = select_anchors(batch, 3, BS)
    assert np.asarray(valid).all()
    assert [np.asarray(first[b]).tolist() for b in range(2)] == [sorted(c)[:3] for c in cands]
    seen = set()
    for s in range(6):
        anchors, valid = select_anchors(batch, T, BS, jax.random.key(s))
        for b in range(2):
            got = np.asarray(anchors[b])[np.asarray(valid[b])].tolist()
            assert set(got) == cands[b] and got == sorted(got)  # all candidates, each once, ascending
        small, valid = select_anchors(batch, 2, BS, jax.random.key(s))
        assert np.asarray(valid).all() and all(set(np.asarray(small[b]).tolist()) <= cands[b] for b in range(2))
        seen.add(tuple(np.asarray(small).ravel().tolist()))
    assert len(seen) > 1
    assert int(np.asarray(valid).sum()) == 4
    assert np.asarray(select_anchors(batch, T, BS)[1]).sum() == sum(len(c) for c in cands)


def test_training_updates_only_trainable_params():
    draft = make_draft(seed=5, layers=1)
    batch, feats, tl = packed_batch(4)
    frozen = {k: np.asarray(v) for k, v in (("embed", draft.embed_tokens.weight[...]), ("d2t", draft.d2t[...]),
                                            ("t2d", draft.t2d[...]), ("head", draft.lm_head.kernel[...]))}
    before = jax.tree.map(np.asarray, nnx.state(draft, nnx.Param))
    optimizer = nnx.Optimizer(draft, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(draft, optimizer, batch, feats, tl, key):
        def objective(model):
            loss, stats = block_loss(model, batch, feats, tl, num_anchors=4, rng=key)
            return loss / jnp.sum(batch["loss_mask"]), stats

        (loss, _), grads = nnx.value_and_grad(objective, argnums=nnx.DiffState(0, nnx.Param), has_aux=True)(draft)
        optimizer.update(draft, grads)
        return loss, grads

    losses = []
    for i in range(10):
        loss, grads = step(draft, optimizer, batch, feats, tl, jax.random.key(0))  # same anchors every step
        if i == 0:
            grad_norms = {".".join(map(str, p)): float(jnp.linalg.norm(v.get_value()))
                          for p, v in nnx.to_flat_state(grads)}
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses
    assert set(grad_norms) == {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(draft, nnx.Param))}
    assert all(n > 0 for n in grad_norms.values()), grad_norms
    for name, value in (("embed", draft.embed_tokens.weight[...]), ("d2t", draft.d2t[...]), ("t2d", draft.t2d[...]),
                        ("head", draft.lm_head.kernel[...])):
        np.testing.assert_array_equal(value, frozen[name])
    after = jax.tree.map(np.asarray, nnx.state(draft, nnx.Param))
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, b), before, after)))


# ------------------------------------------------------------------------------------------------
# export / import
# ------------------------------------------------------------------------------------------------

TARGET_HF = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": V, "bos_token_id": 1,
             "eos_token_id": 2}


def expected_shapes(layers: int, reduced: bool) -> dict[str, tuple[int, ...]]:
    shapes = {"fc.weight": (D, NA * D), "hidden_norm.weight": (D,), "norm.weight": (D,)}
    if reduced:
        shapes.update({"lm_head.weight": (VD, D), "d2t": (VD,), "t2d": (V,)})
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({f"{p}input_layernorm.weight": (D,), f"{p}post_attention_layernorm.weight": (D,),
                       f"{p}self_attn.q_proj.weight": (N * H, D), f"{p}self_attn.k_proj.weight": (K * H, D),
                       f"{p}self_attn.v_proj.weight": (K * H, D), f"{p}self_attn.o_proj.weight": (D, N * H),
                       f"{p}self_attn.q_norm.weight": (H,), f"{p}self_attn.k_norm.weight": (H,),
                       f"{p}mlp.gate_proj.weight": (F, D), f"{p}mlp.up_proj.weight": (F, D),
                       f"{p}mlp.down_proj.weight": (D, F)})
    return shapes


def all_arrays(draft: DFlashDraft) -> dict[str, np.ndarray]:
    out = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(draft))}
    return dict(sorted(out.items()))


def test_export_round_trip_reduced_vocab(draft, tmp_path):
    save_dflash(draft, str(tmp_path / "f32"), target_config=TARGET_HF, verifier_name_or_path="org/target",
                dtype="float32")
    tensors = safetensors.numpy.load_file(str(tmp_path / "f32" / "model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == expected_shapes(2, True)
    assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == np.bool_
    cfg = json.loads((tmp_path / "f32" / "config.json").read_text())
    assert cfg["aux_hidden_state_layer_ids"] == [2, 4, 5]  # boundary ids: ours + 1
    assert (cfg["block_size"], cfg["mask_token_id"], cfg["draft_vocab_size"]) == (BS, MASK, VD)
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BS - 1
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    assert cfg["transformer_layer_config"]["vocab_size"] == V

    embed = np.asarray(draft.embed_tokens.weight[...])
    loaded = load_dflash(str(tmp_path / "f32"), embed)
    assert loaded.config == draft.config
    want, got = all_arrays(draft), all_arrays(loaded)
    assert list(got) == list(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)

    save_dflash(draft, str(tmp_path / "bf16"), target_config=TARGET_HF, verifier_name_or_path="org/target")
    tensors = safetensors.numpy.load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert tensors["fc.weight"].dtype == ml_dtypes.bfloat16 and tensors["d2t"].dtype == np.int64
    low = load_dflash(str(tmp_path / "bf16"), embed)
    batch, feats, _ = packed_batch(2)
    anchors = jnp.array([[2, 9], [3, 5]])
    a = nnx.jit(lambda m: m(batch["input_ids"], feats, anchors, positions=batch["positions"],
                            segment_ids=batch["segment_ids"]))
    ref, approx = np.asarray(a(draft)), np.asarray(a(low))
    assert np.abs(approx - ref).max() / np.abs(ref).max() < 0.1


def test_export_full_vocab_omits_head_and_maps(tmp_path):
    draft = make_draft(seed=3, layers=1, draft_vocab=V)
    save_dflash(draft, str(tmp_path / "full"), target_config=TARGET_HF, verifier_name_or_path="org/target",
                dtype="float32")
    tensors = safetensors.numpy.load_file(str(tmp_path / "full" / "model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == expected_shapes(1, False)
    embed = np.asarray(draft.embed_tokens.weight[...])
    with pytest.raises(ValueError, match="lm_head"):
        load_dflash(str(tmp_path / "full"), embed)
    head = np.asarray(draft.lm_head.kernel[...]).T  # [V, D]: the target's head (identity vocabulary)
    loaded = load_dflash(str(tmp_path / "full"), embed, lm_head=head)
    for name, value in all_arrays(draft).items():
        np.testing.assert_array_equal(all_arrays(loaded)[name], value, err_msg=name)
    trained = DFlashDraft(DFlashConfig.tiny(V, V, train_lm_head=True), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="full-vocabulary lm_head"):
        save_dflash(trained, str(tmp_path / "x"), target_config=TARGET_HF, verifier_name_or_path="org/target")


def test_load_errors_name_every_bad_tensor(draft, tmp_path):
    save_dflash(draft, str(tmp_path / "ok"), target_config=TARGET_HF, verifier_name_or_path="org/target",
                dtype="float32")
    tensors = safetensors.numpy.load_file(str(tmp_path / "ok" / "model.safetensors"))
    del tensors["layers.1.self_attn.k_norm.weight"]
    tensors["fc.weight"] = tensors["fc.weight"][:, :-1]
    tensors["layers.2.mlp.up_proj.weight"] = np.zeros((F, D), np.float32)
    bad = tmp_path / "bad"
    bad.mkdir()
    safetensors.numpy.save_file(tensors, str(bad / "model.safetensors"))
    (bad / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    with pytest.raises(ValueError) as err:
        load_dflash(str(bad), np.asarray(draft.embed_tokens.weight[...]))
    msg = str(err.value)
    assert "missing: layers.1.self_attn.k_norm.weight" in msg
    assert "unexpected: layers.2.mlp.up_proj.weight" in msg
    assert "mis-shaped: fc.weight [32, 95] (expected [32, 96])" in msg
    with pytest.raises(ValueError, match="vocab_size"):
        save_dflash(draft, str(tmp_path / "x"), target_config={**TARGET_HF, "vocab_size": V + 1},
                    verifier_name_or_path="org/target")


# ------------------------------------------------------------------------------------------------
# for_target
# ------------------------------------------------------------------------------------------------


def test_for_target_and_config_round_trip():
    t = qwen3_config("tiny", vocab_size=V)
    cfg = DFlashConfig.for_target(t, draft_vocab_size=VD, num_layers=2, block_size=6, mask_token_id=MASK)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == \
        (t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim)
    assert cfg.num_hidden_layers == 2 and cfg.block_size == 6 and cfg.vocab_size == V and cfg.draft_vocab_size == VD
    assert cfg.target_hidden_size == t.hidden_size and cfg.rope_theta == t.rope_theta
    assert cfg.aux_layer_ids == DFlashConfig.for_target(t, mask_token_id=0).aux_layer_ids
    assert DFlashConfig.for_target(t, mask_token_id=0).draft_vocab_size == V
    from models.dflash.config import speculators_config
    d = speculators_config(cfg, target_config=TARGET_HF, verifier_name_or_path="org/t")
    assert DFlashConfig.from_hf(json.loads(json.dumps(d))) == cfg
    with pytest.raises(ValueError, match="target_hidden_size"):
        DFlashConfig.tiny(target_hidden_size=32)
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashConfig.tiny(mask_token_id=256)
    with pytest.raises(NotImplementedError, match="sample_from_anchor"):
        DFlashConfig.from_hf({**d, "sample_from_anchor": True})
