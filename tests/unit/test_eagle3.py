"""EAGLE-3 draft head (models/eagle3/): forward and KV-cache decode, the TTT loss against explicit
step-by-step references, trainability, the draft vocabulary, both export layouts and `for_target`.

    pytest tests/unit/test_eagle3.py
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

from models.deepseek_v3 import DeepseekV3Config
from models.deepseek_v4 import DeepseekV4Config
from models.deepseek_v32 import DeepseekV32Config
from models.draft_losses import TargetHead, restricted_targets
from models.eagle3 import (
    Eagle3Config,
    Eagle3Draft,
    build_draft_vocab,
    default_aux_layer_ids,
    load_eagle3,
    save_sglang,
    save_speculators,
    ttt_loss,
)
from models.glm4_moe import Glm4MoeConfig
from models.glm_moe_dsa import GlmMoeDsaConfig
from models.gpt_oss import GptOssConfig
from models.layers import Buffer, attention
from models.llama import Llama, LlamaConfig
from models.qwen3 import qwen3_config
from models.qwen3_moe import Qwen3MoeConfig

pytestmark = pytest.mark.unit
jax.config.update("jax_default_matmul_precision", "highest")

V, VD, D, DT = 96, 40, 32, 24  # target vocab, draft vocab, draft width, target width (≠ D: fc is 3·24 -> 32)
forward = nnx.jit(lambda model, ids, **kw: model(ids, **kw))  # one compile per (graph, shapes)


def make_draft(seed: int = 0) -> Eagle3Draft:
    cfg = Eagle3Config.tiny(V, VD, hidden_size=D, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, target_hidden_size=DT, aux_layer_ids=(1, 3, 4))
    # one compiled init; matrices 8× the 0.02 init, so that attention and the MLP matter in the comparisons
    draft = nnx.jit(lambda: Eagle3Draft(cfg, rngs=nnx.Rngs(seed)))()
    params = nnx.state(draft, nnx.Param)
    nnx.update(draft, jax.jit(lambda p: jax.tree.map(lambda x: x * 8.0 if x.ndim == 2 else x, p))(params))
    rng = np.random.default_rng(seed)
    draft.load_embedding(rng.normal(size=(V, D)).astype(np.float32))
    counts = rng.integers(0, 50, size=V)
    d2t, t2d, _ = build_draft_vocab(counts, VD)
    draft.set_vocab(d2t, t2d)
    return draft


@pytest.fixture(scope="module")
def draft() -> Eagle3Draft:
    return make_draft()


def packed_batch(seed: int = 0, B: int = 2, T: int = 12, density: float = 0.8):
    """Two rows: [seg 1 ×5, seg 2 ×5, padding ×2] and one full segment; random tokens and masks (each
    in-segment position a label with probability `density`)."""
    rng = np.random.default_rng(seed)
    seg = np.array([[1] * 5 + [2] * 5 + [0] * 2, [1] * T], np.int32)[:B]
    positions = np.zeros_like(seg)
    for b in range(B):
        for p in range(1, T):
            positions[b, p] = positions[b, p - 1] + 1 if seg[b, p] == seg[b, p - 1] else 0
    target_ids = rng.integers(0, V, size=(B, T)).astype(np.int32)
    loss_mask = ((rng.random((B, T)) < density) & (seg != 0)).astype(np.int32)
    batch = {"input_ids": np.roll(target_ids, 1, axis=1), "target_ids": target_ids, "positions": positions,
             "segment_ids": seg, "loss_mask": loss_mask}
    features = rng.normal(size=(B, T, 3 * DT)).astype(np.float32)
    target_logits = 3.0 * rng.normal(size=(B, T, V)).astype(np.float32)
    return {k: jnp.asarray(v) for k, v in batch.items()}, jnp.asarray(features), jnp.asarray(target_logits)


# ------------------------------------------------------------------------------------------------
# forward and cache
# ------------------------------------------------------------------------------------------------


def test_forward_shapes_and_variable_kinds(draft):
    B, T = 2, 5
    ids = jnp.zeros((B, T), jnp.int32)
    logits, hidden, cache = nnx.eval_shape(lambda m: m(ids, features=jnp.ones((B, T, 3 * DT))), draft)
    assert logits.shape == (B, T, VD) and hidden.shape == (B, T, D) and cache is None
    logits2, _, _ = nnx.eval_shape(lambda m: m(ids, hidden=jnp.ones((B, T, D))), draft)
    assert logits2.shape == (B, T, VD)
    with pytest.raises(ValueError, match="exactly one"):
        draft(ids)
    with pytest.raises(ValueError, match="exactly one"):
        draft(ids, features=jnp.ones((B, T, 3 * DT)), hidden=jnp.ones((B, T, D)))
    assert draft.target_layers == (1, 3, 4)
    ids_map = np.asarray(draft.target_token_ids)
    assert ids_map.dtype == np.int32 and ids_map.shape == (VD,)
    np.testing.assert_array_equal(ids_map, np.flatnonzero(np.asarray(draft.t2d[...])))
    # trainable = fc, midlayer, norm, lm_head; the embedding and the vocab maps are buffers
    params = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(draft, nnx.Param))}
    assert {p.split(".")[0] for p in params} == {"fc", "midlayer", "norm", "lm_head"}
    buffers = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(draft, Buffer))}
    assert buffers == {"embed_tokens.weight", "d2t", "t2d"}
    sa = draft.midlayer.self_attn
    assert sa.q_proj.weight().T.shape == (4 * 8, 2 * D) and sa.k_proj.weight().T.shape == (2 * 8, 2 * D)
    assert sa.o_proj.weight().T.shape == (D, 4 * 8) and draft.fc.weight().T.shape == (D, 3 * DT)


def test_cache_decode_matches_full_forward(draft):
    """Prefill T0 tokens from features, then decode one token at a time feeding back the previous
    hidden_out; a cache-free forward over the same per-position inputs gives the same outputs."""
    rng = np.random.default_rng(1)
    B, T, T0 = 2, 8, 3
    ids = jnp.asarray(rng.integers(0, V, size=(B, T)), jnp.int32)
    feats = jnp.asarray(rng.normal(size=(B, T0, 3 * DT)), jnp.float32)
    positions = jnp.asarray(np.arange(T)[None, :] + np.array([[0], [5]]), jnp.int32)

    cache = draft.init_cache(B, 16)
    assert cache.k.shape == (1, B, 2, 16, 8)
    logits, hidden, cache = forward(draft, ids[:, :T0], features=feats, positions=positions[:, :T0], cache=cache)
    all_logits, all_hidden, fed = [logits], [hidden], [draft.fuse(feats)]
    prev = hidden[:, -1:]
    for t in range(T0, T):
        fed.append(prev)
        logits, prev, cache = forward(draft, ids[:, t:t + 1], hidden=prev, positions=positions[:, t:t + 1], cache=cache)
        all_logits.append(logits)
        all_hidden.append(prev)
    assert np.asarray(cache.length).tolist() == [T, T]

    ref_logits, ref_hidden, _ = forward(draft, ids, hidden=jnp.concatenate(fed, axis=1), positions=positions)
    np.testing.assert_allclose(np.concatenate(all_logits, 1), ref_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.concatenate(all_hidden, 1), ref_hidden, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# TTT loss
# ------------------------------------------------------------------------------------------------


def reference_step_loss(logits: np.ndarray, batch, target_logits: np.ndarray, t2d: np.ndarray, k: int):
    """Σ m·KL(P‖Q), correct, count for step k from per-position loops (labels at p + 1 + k)."""
    seg, lm = np.asarray(batch["segment_ids"]), np.asarray(batch["loss_mask"])
    B, T = seg.shape
    loss = correct = count = 0.0
    for b in range(B):
        for p in range(T):
            q = p + 1 + k
            if q >= T or seg[b, p] == 0 or seg[b, q] != seg[b, p] or not lm[b, q]:
                continue
            full = target_logits[b, q].astype(np.float64)
            if not t2d[np.argmax(full)]:
                continue
            sub = full[t2d]  # boolean selection: ascending target ids
            P = np.exp(sub - sub.max())
            P /= P.sum()
            lq = logits[b, p].astype(np.float64)
            logq = lq - lq.max() - np.log(np.exp(lq - lq.max()).sum())
            loss += (P * (np.log(P) - logq)).sum()  # forward KL(P || Q), the default objective
            correct += float(np.argmax(lq) == np.argmax(sub))
            count += 1
    return loss, correct, count


def test_ttt_loss_one_step_equals_plain_forward(draft):
    batch, feats, tl = packed_batch(0)
    loss, stats = nnx.jit(lambda m, b, f, t: ttt_loss(m, b, f, t, steps=1))(draft, batch, feats, tl)
    logits, _, _ = nnx.jit(lambda m, b, f: m(b["target_ids"], features=f, positions=b["positions"],
                                             segment_ids=b["segment_ids"]))(draft, batch, feats)
    ref, correct, count = reference_step_loss(np.asarray(logits), batch, np.asarray(tl), np.asarray(draft.t2d[...]), 0)
    assert count > 5  # the batch has scored positions and also drops some (argmax outside the draft vocab)
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(stats["loss"]), [ref], rtol=1e-5)
    assert np.asarray(stats["acc_num"]).tolist() == [correct] and np.asarray(stats["acc_den"]).tolist() == [count]


def unrolled_reference(draft: Eagle3Draft, batch, feats, tl, steps: int, decay: float):
    """TTT by an explicit loop: each step runs the draft's layers over the tokens shifted by k, attends
    with models.layers.attention over the keys of ALL steps so far, under an explicitly built mask
    (step-0 block causal within the segment, later blocks the identity)."""
    ids = np.asarray(batch["target_ids"])
    seg = np.asarray(batch["segment_ids"])
    B, T = ids.shape
    step0 = np.zeros((B, T, T), bool)
    for b in range(B):
        for p in range(T):
            for j in range(p + 1):
                step0[b, p, j] = seg[b, p] != 0 and seg[b, j] == seg[b, p]
    tokens = np.zeros((steps, B, T), np.int32)
    masks = []
    for k in range(steps):
        tokens[k, :, : T - k] = ids[:, k:]
        masks.append(np.concatenate([step0] + [np.broadcast_to(np.eye(T, dtype=bool), (B, T, T))] * k, axis=-1))

    @nnx.jit
    def all_logits(draft, tokens, masks, pos, feats):
        layer, attn = draft.midlayer, draft.midlayer.self_attn
        f = draft.fuse(feats)
        keys, values, out_logits = [], [], []
        for k in range(steps):
            a = layer.attn_input(draft.embed_tokens(tokens[k]), f)
            q, kk, vv = attn.project(a, *draft.rope(pos + k))
            keys.append(kk)
            values.append(vv)
            K_all = jnp.concatenate(keys, axis=1).transpose(0, 2, 1, 3)  # [B, K, (k+1)T, H]
            V_all = jnp.concatenate(values, axis=1).transpose(0, 2, 1, 3)
            o = attention(q, K_all, V_all, masks[k])  # [B, T, N, H]
            f = layer.finish(f, attn.o_proj(o.reshape(B, T, -1)))
            out_logits.append(draft.lm_head(draft.norm(f)))
        return out_logits

    logits = all_logits(draft, jnp.asarray(tokens), [jnp.asarray(m) for m in masks], batch["positions"], feats)
    t2d, tl_np = np.asarray(draft.t2d[...]), np.asarray(tl)
    per_step = [reference_step_loss(np.asarray(logits[k]), batch, tl_np, t2d, k) for k in range(steps)]
    return sum(decay**k * s[0] for k, s in enumerate(per_step)), per_step


# scored positions per step, of B·T = 24: > 12 (every row computed), 7..12 (packed into half the rows), <= 6
# (a quarter): ttt_loss picks among the three at run time (`_scored_positions`); the sums must not change.
# (seed, loss-mask density, the target's argmax always in the draft vocabulary)
CASES = [(3, 0.8, False), (8, 0.8, False), (3, 1.0, True)]


def case_batch(draft: Eagle3Draft, seed: int, density: float, in_draft: bool):
    batch, feats, tl = packed_batch(seed, density=density)
    if in_draft:  # every in-segment label scored: no position drops out for a target argmax outside the draft
        tl = tl.at[..., np.asarray(draft.target_token_ids)].add(100.0)
    return batch, feats, tl


def assert_equals_step_loop(draft: Eagle3Draft, batch, feats, target, full_logits, steps: int = 4, decay: float = 0.8):
    """ttt_loss on `target` (full logits or a TargetHead) equals `unrolled_reference` on the full logits: the
    total, the per-step sums, the agreements and the counts. Returns the reference's per-step tuples."""
    loss, stats = jax.jit(lambda b, f, t: ttt_loss(draft, b, f, t, steps=steps, decay=decay))(batch, feats, target)
    ref_total, per_step = unrolled_reference(draft, batch, feats, full_logits, steps, decay)
    np.testing.assert_allclose(float(loss), ref_total, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(stats["loss"]), [s[0] for s in per_step], rtol=1e-5)
    assert np.asarray(stats["acc_num"]).tolist() == [s[1] for s in per_step]
    assert np.asarray(stats["acc_den"]).tolist() == [s[2] for s in per_step]
    return per_step


@pytest.mark.parametrize(("seed", "density", "in_draft"), CASES)
def test_ttt_unroll_equals_explicit_step_loop(draft, seed, density, in_draft):
    batch, feats, tl = case_batch(draft, seed, density, in_draft)
    dens = [s[2] for s in assert_equals_step_loop(draft, batch, feats, tl, tl)]
    assert dens[0] > dens[-1] > 0  # later steps lose the positions whose label leaves the segment


def test_the_step_loop_cases_cover_every_scoring_path(draft):
    """The cases above put TTT steps in each of `_scored_positions`' three paths (every row, half, quarter)."""
    paths = set()
    for case in CASES:
        batch, feats, tl = case_batch(draft, *case)
        _, stats = ttt_loss(draft, batch, feats, tl, steps=4, decay=0.8)
        n = batch["target_ids"].size
        paths |= {"every" if c > n // 2 else "half" if c > n // 4 else "quarter" for c in np.asarray(stats["acc_den"])}
    assert paths == {"every", "half", "quarter"}, paths


def target_head_case(seed: int):
    """A factored target (hidden [B, T, DT], head [V, DT]) for packed_batch(seed), its argmax outside the draft
    vocabulary at some positions, and its full logits hidden @ head.T."""
    rng = np.random.default_rng(100 + seed)
    batch, feats, _ = packed_batch(seed)
    hidden = jnp.asarray(rng.normal(size=(*batch["target_ids"].shape, DT)).astype(np.float32))
    head = jnp.asarray(rng.normal(size=(V, DT)).astype(np.float32))
    return batch, feats, TargetHead(hidden, head), jnp.einsum("btd,vd->btv", hidden, head)


def test_restricted_targets_from_the_head_equal_them_from_the_full_logits(draft):
    """The draft stage passes the target as its final hidden states and head (`TargetHead`: two matmuls over the
    head's rows, no [B, T, V] gather); the columns and the in-vocabulary test equal those of the full logits,
    for a pruned draft vocabulary and for the target's own."""
    _, _, factored, full = target_head_case(0)
    ids, t2d = draft.target_token_ids, draft.t2d[...]
    (r1, in1), (r0, in0) = restricted_targets(factored, ids, t2d), restricted_targets(full, ids, t2d)
    np.testing.assert_allclose(np.asarray(r1), np.asarray(r0), rtol=1e-5, atol=1e-5)
    assert np.asarray(in1).tolist() == np.asarray(in0).tolist() and 0 < np.asarray(in0).mean() < 1
    every = (jnp.arange(V, dtype=jnp.int32), jnp.ones(V, bool))  # the draft vocabulary is the target's
    (r1, in1), (r0, in0) = restricted_targets(factored, *every), restricted_targets(full, *every)
    np.testing.assert_allclose(np.asarray(r1), np.asarray(r0), rtol=1e-5, atol=1e-5)
    assert np.asarray(in1).all() and np.asarray(in0).all()


def test_ttt_loss_from_the_target_head_equals_the_explicit_step_loop(draft):
    batch, feats, factored, full = target_head_case(3)
    assert assert_equals_step_loop(draft, batch, feats, factored, full)[0][2] > 0


def test_training_updates_only_trainable_params():
    draft = make_draft(seed=5)
    batch, feats, tl = packed_batch(4)
    frozen = {k: np.asarray(v) for k, v in (("embed", draft.embed_tokens.weight[...]), ("d2t", draft.d2t[...]),
                                            ("t2d", draft.t2d[...]))}
    before = jax.tree.map(np.asarray, nnx.state(draft, nnx.Param))
    optimizer = nnx.Optimizer(draft, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(draft, optimizer, batch, feats, tl):
        def objective(model):
            loss, stats = ttt_loss(model, batch, feats, tl, steps=3)
            return loss / jnp.sum(batch["loss_mask"]), stats

        (loss, _), grads = nnx.value_and_grad(objective, argnums=nnx.DiffState(0, nnx.Param), has_aux=True)(draft)
        optimizer.update(draft, grads)
        return loss, grads

    losses = []
    for i in range(12):
        loss, grads = step(draft, optimizer, batch, feats, tl)
        if i == 0:
            grad_norms = {".".join(map(str, p)): float(jnp.linalg.norm(v.get_value()))
                          for p, v in nnx.to_flat_state(grads)}
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses
    assert set(grad_norms) == {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(draft, nnx.Param))}
    assert all(n > 0 for n in grad_norms.values()), grad_norms
    np.testing.assert_array_equal(draft.embed_tokens.weight[...], frozen["embed"])
    np.testing.assert_array_equal(draft.d2t[...], frozen["d2t"])
    np.testing.assert_array_equal(draft.t2d[...], frozen["t2d"])
    after = jax.tree.map(np.asarray, nnx.state(draft, nnx.Param))
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, b), before, after))
    assert all(changed)


# ------------------------------------------------------------------------------------------------
# draft vocabulary
# ------------------------------------------------------------------------------------------------


def test_build_draft_vocab_ascending_offsets_and_coverage():
    counts = np.array([5, 0, 9, 9, 1, 7, 0, 3, 9, 2])
    d2t, t2d, coverage = build_draft_vocab(counts, 4)
    used = np.arange(4) + d2t
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_ and t2d.shape == (10,)
    # top 4 by count are ids 2, 3, 8 (9 each) and 5 (7), kept in ascending id order
    assert used.tolist() == [2, 3, 5, 8]
    assert d2t.tolist() == [2, 2, 3, 5]
    assert np.flatnonzero(t2d).tolist() == used.tolist()
    assert coverage == pytest.approx(34 / 45)
    # ties at the cut go to the lower id; a vocabulary with every id is the identity
    d2t, t2d, coverage = build_draft_vocab(np.array([1, 1, 1, 1]), 2)
    assert (np.arange(2) + d2t).tolist() == [0, 1] and coverage == 0.5
    d2t, t2d, coverage = build_draft_vocab(counts, 10)
    assert d2t.tolist() == [0] * 10 and t2d.all() and coverage == 1.0
    with pytest.raises(ValueError):
        build_draft_vocab(counts, 11)
    draft = nnx.eval_shape(lambda: Eagle3Draft(Eagle3Config.tiny(10, 4), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="t2d"):
        draft.set_vocab(np.array([2, 2, 3, 5]), np.arange(10) < 4)


# ------------------------------------------------------------------------------------------------
# export / import
# ------------------------------------------------------------------------------------------------

TARGET_HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "bos_token_id": 1,
             "eos_token_id": 2}
LAYER = ["input_layernorm", "hidden_norm", "post_attention_layernorm"]


def expected_shapes(prefix: str) -> dict[str, tuple[int, ...]]:
    N, K, H, F = 4, 2, 8, 64
    shapes = {"fc.weight": (D, 3 * DT), "norm.weight": (D,), "lm_head.weight": (VD, D), "d2t": (VD,), "t2d": (V,),
              f"{prefix}self_attn.q_proj.weight": (N * H, 2 * D), f"{prefix}self_attn.k_proj.weight": (K * H, 2 * D),
              f"{prefix}self_attn.v_proj.weight": (K * H, 2 * D), f"{prefix}self_attn.o_proj.weight": (D, N * H),
              f"{prefix}mlp.gate_proj.weight": (F, D), f"{prefix}mlp.up_proj.weight": (F, D),
              f"{prefix}mlp.down_proj.weight": (D, F)}
    shapes.update({f"{prefix}{n}.weight": (D,) for n in LAYER})
    return shapes


@pytest.mark.parametrize("layout", ["sglang", "speculators"])
def test_export_round_trip(draft, tmp_path, layout):
    prefix = "midlayer." if layout == "sglang" else "layers.0."

    def save(path, dtype):
        if layout == "sglang":
            save_sglang(draft, str(path), target_config=TARGET_HF, dtype=dtype)
        else:
            save_speculators(draft, str(path), target_config=TARGET_HF, verifier_name_or_path="org/target",
                             num_speculative_tokens=5, dtype=dtype)

    save(tmp_path / "bf16", "bfloat16")
    tensors = safetensors.numpy.load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert {k: v.shape for k, v in tensors.items()} == expected_shapes(prefix)
    assert tensors["d2t"].dtype == np.int64 and tensors["t2d"].dtype == np.bool_
    assert all(v.dtype == ml_dtypes.bfloat16 for k, v in tensors.items() if k.endswith(".weight"))
    np.testing.assert_array_equal(tensors["d2t"], np.asarray(draft.d2t[...]))
    np.testing.assert_array_equal(tensors["fc.weight"],
                                  np.asarray(draft.fc.kernel[...]).T.astype(ml_dtypes.bfloat16))

    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    if layout == "sglang":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
        assert cfg["vocab_size"] == V and cfg["draft_vocab_size"] == VD and cfg["num_hidden_layers"] == 1
        assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
        assert cfg["target_hidden_size"] == DT and cfg["torch_dtype"] == "bfloat16"
        assert (cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]) == (D, 8, 64)
        assert cfg["tie_word_embeddings"] is False and cfg["rope_theta"] == 10000.0
    else:
        assert cfg["architectures"] == ["Eagle3Speculator"] and cfg["speculators_model_type"] == "eagle3"
        layer = cfg["transformer_layer_config"]
        assert layer["model_type"] == "llama" and layer["vocab_size"] == V and layer["hidden_size"] == D
        # boundary ids (the residual stream entering layer i), one above our output-of-layer ids
        assert cfg["draft_vocab_size"] == VD and cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
        assert not any(cfg[k] for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"))
        assert cfg["target_hidden_size"] == DT
        spec = cfg["speculators_config"]
        assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
        assert spec["proposal_methods"][0]["proposal_type"] == "greedy"
        assert spec["proposal_methods"][0]["speculative_tokens"] == 5
        assert spec["verifier"] == {"name_or_path": "org/target", "architectures": ["LlamaForCausalLM"]}

    # float32 export: load_eagle3 reproduces the logits exactly
    save(tmp_path / "f32", "float32")
    embed = np.asarray(draft.embed_tokens.weight[...])
    loaded = load_eagle3(str(tmp_path / "f32"), embed)
    assert loaded.config == draft.config
    batch, feats, _ = packed_batch(0)
    want = forward(draft, batch["target_ids"], features=feats, positions=batch["positions"])
    got = forward(loaded, batch["target_ids"], features=feats, positions=batch["positions"])
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(loaded.target_token_ids, draft.target_token_ids)
    # bf16 export: weights come back as the bf16-rounded values
    loaded16 = load_eagle3(str(tmp_path / "bf16"), embed)
    np.testing.assert_array_equal(loaded16.lm_head.kernel[...],
                                  np.asarray(draft.lm_head.kernel[...]).astype(ml_dtypes.bfloat16).astype(np.float32))

    # a missing d2t is an error naming it (the silent-acceptance-collapse pitfall, docs/formats/eagle3.md)
    del tensors["d2t"]
    safetensors.numpy.save_file(tensors, str(tmp_path / "bf16" / "model.safetensors"))
    with pytest.raises(ValueError, match="missing: d2t"):
        load_eagle3(str(tmp_path / "bf16"), embed)


def numpy_draft_forward(t: dict[str, np.ndarray], embed: np.ndarray, ids: np.ndarray, feats: np.ndarray,
                        eps: float, theta: float, N: int, K: int, H: int) -> np.ndarray:
    """The draft forward (docs/speculative-decoding.md) written out in numpy from the SGLang tensors, one
    causal sequence: logits [T, Vd]."""
    def rms(x, w):
        return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)

    def rope(x):  # [T, heads, H], NeoX halves, positions 0..T-1
        inv = 1.0 / theta ** (np.arange(0, H, 2) / H)
        ang = np.arange(x.shape[0])[:, None] * inv[None]  # [T, H/2]
        cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
        x1, x2 = x[..., : H // 2], x[..., H // 2:]
        return x * cos + np.concatenate([-x2, x1], -1) * sin

    T = ids.shape[0]
    m = "midlayer."
    f = feats @ t["fc.weight"].T  # [T, D]
    a = np.concatenate([rms(embed[ids], t[m + "input_layernorm.weight"]), rms(f, t[m + "hidden_norm.weight"])], -1)
    q = rope((a @ t[m + "self_attn.q_proj.weight"].T).reshape(T, N, H))
    k = rope((a @ t[m + "self_attn.k_proj.weight"].T).reshape(T, K, H))
    v = (a @ t[m + "self_attn.v_proj.weight"].T).reshape(T, K, H)
    k, v = np.repeat(k, N // K, axis=1), np.repeat(v, N // K, axis=1)  # [T, N, H]
    scores = np.einsum("tnh,snh->nts", q, k) / np.sqrt(H) + np.triu(np.full((T, T), -np.inf), 1)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    h = f + np.einsum("nts,snh->tnh", p, v).reshape(T, N * H) @ t[m + "self_attn.o_proj.weight"].T
    x = rms(h, t[m + "post_attention_layernorm.weight"])
    gate, up = x @ t[m + "mlp.gate_proj.weight"].T, x @ t[m + "mlp.up_proj.weight"].T
    out = h + (gate / (1 + np.exp(-gate)) * up) @ t[m + "mlp.down_proj.weight"].T
    return rms(out, t["norm.weight"]) @ t["lm_head.weight"].T


def test_forward_matches_numpy_reference_of_the_exported_tensors(draft, tmp_path):
    """The module math (embedding first, un-normalised residual, 2D-wide q/k/v, GQA, RoPE) against a
    from-scratch numpy version that only sees the exported SGLang tensors and config.json."""
    save_sglang(draft, str(tmp_path), target_config=TARGET_HF, dtype="float32")
    t = {k: v.astype(np.float64) for k, v in safetensors.numpy.load_file(str(tmp_path / "model.safetensors")).items()}
    cfg = json.loads((tmp_path / "config.json").read_text())
    rng = np.random.default_rng(7)
    ids = rng.integers(0, V, size=9)
    feats = rng.normal(size=(9, 3 * DT))
    embed = np.asarray(draft.embed_tokens.weight[...], np.float64)
    want = numpy_draft_forward(t, embed, ids, feats, cfg["rms_norm_eps"], cfg["rope_theta"],
                               cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"])
    got, _, _ = forward(draft, jnp.asarray(ids[None], jnp.int32), features=jnp.asarray(feats[None], jnp.float32))
    np.testing.assert_allclose(np.asarray(got[0]), want, rtol=2e-4, atol=2e-4)


def test_export_rejects_a_foreign_target(draft, tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        save_sglang(draft, str(tmp_path), target_config={**TARGET_HF, "vocab_size": V + 1})


# ------------------------------------------------------------------------------------------------
# for_target on every family
# ------------------------------------------------------------------------------------------------

FAMILIES = {
    "llama": (LlamaConfig.tiny(V), 128),  # dense width
    "qwen3": (qwen3_config("tiny", vocab_size=V), 128),
    "qwen3_moe": (Qwen3MoeConfig.tiny(V), 96),  # has a dense layer (mlp_only_layers=(1,))
    "qwen3_moe_all_sparse": (Qwen3MoeConfig.tiny(V, mlp_only_layers=()), 2 * 32),  # top_k × expert width
    "deepseek_v3": (DeepseekV3Config.tiny(V), 160),
    "gpt_oss": (GptOssConfig.tiny(V), 2 * 64),  # every layer MoE: top_k × per-expert width
    "glm4_moe": (Glm4MoeConfig.tiny(V), 96),
    "deepseek_v32": (DeepseekV32Config.tiny(V), 160),
    "glm_moe_dsa": (GlmMoeDsaConfig.tiny(V), 160),
    "deepseek_v4": (DeepseekV4Config.tiny(V), 2 * 32),  # every layer MoE: top_k × expert width
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_for_target_every_family(family):
    t, ffn = FAMILIES[family]
    cfg = Eagle3Config.for_target(t, draft_vocab_size=32)
    assert cfg.hidden_size == cfg.target_hidden_size == t.hidden_size
    assert cfg.vocab_size == V and cfg.draft_vocab_size == 32 and cfg.intermediate_size == ffn
    assert cfg.aux_layer_ids == default_aux_layer_ids(t.num_hidden_layers)
    assert cfg.num_attention_heads == t.num_attention_heads
    if family in ("deepseek_v3", "deepseek_v32", "glm_moe_dsa"):  # MLA -> plain MHA with H = D / N
        assert cfg.num_key_value_heads == t.num_attention_heads and cfg.head_dim == t.hidden_size // 4
    else:
        assert (cfg.num_key_value_heads, cfg.head_dim) == (t.num_key_value_heads, t.head_dim)
    if family == "gpt_oss":  # YaRN target -> plain RoPE, theta 10000
        assert cfg.rope_scaling is None and cfg.rope_theta == 10000.0
    else:
        assert cfg.rope_theta == t.rope_theta and cfg.rope_scaling is None
    abstract = nnx.eval_shape(lambda: Eagle3Draft(cfg, rngs=nnx.Rngs(0)))
    assert abstract.fc.kernel.get_value().shape == (3 * t.hidden_size, t.hidden_size)
    # a narrower draft reading two target layers: fc maps 2·D_t -> D
    narrow = Eagle3Config.for_target(t, draft_vocab_size=32, aux_layer_ids=(0, 1), hidden_size=48, head_dim=12)
    assert (narrow.hidden_size, narrow.target_hidden_size, narrow.aux_layer_ids) == (48, t.hidden_size, (0, 1))
    abstract = nnx.eval_shape(lambda: Eagle3Draft(narrow, rngs=nnx.Rngs(0)))
    assert abstract.fc.kernel.get_value().shape == (2 * t.hidden_size, 48)


def test_for_target_llama3_rope_overrides_and_end_to_end():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    target_cfg = LlamaConfig.tiny(V, num_hidden_layers=6, rope_theta=5e5, rope_scaling=scaling)
    cfg = Eagle3Config.for_target(target_cfg, draft_vocab_size=VD, intermediate_size=48)
    assert cfg.rope_theta == 5e5 and dict(cfg.rope_scaling) == scaling and cfg.intermediate_size == 48
    assert cfg.aux_layer_ids == (1, 3, 5)  # 6 layers: the formula repeats layer 2, spread instead
    ids = jnp.asarray(np.random.default_rng(0).integers(0, V, (1, 6)), jnp.int32)

    @jax.jit
    def run(ids):
        target = Llama(target_cfg, rngs=nnx.Rngs(0))
        draft = Eagle3Draft(cfg, rngs=nnx.Rngs(1))
        draft.load_embedding(target.embed_tokens.weight[...])
        _, hidden = target(ids, return_hidden=draft.target_layers)
        return draft(ids, features=jnp.concatenate(hidden, axis=-1))[:2]

    logits, out = run(ids)
    assert logits.shape == (1, 6, VD) and out.shape == (1, 6, target_cfg.hidden_size)
    assert np.isfinite(np.asarray(logits)).all()
