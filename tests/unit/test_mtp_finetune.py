"""Fine-tuning a target's own MTP layer (models/mtp_finetune.py), on tiny DeepSeek-V3 and GLM-4.5 models with
one MTP layer: the recursive loss at one step is the MTPDraft head, at three steps an explicit per-segment
loop over MTPDraft's own feedback (hard CE, kl_div, tv; exact accuracy counts), training with the real
Trainer moves only the MTP layer's parameters and leaves speculative decoding lossless, and the MTP tensors
round-trip under the names save_pretrained writes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from models import generate, save_pretrained
from models.deepseek_v3 import DeepseekV3, DeepseekV3Config
from models.glm4_moe import Glm4Moe, Glm4MoeConfig
from models.mtp_finetune import (
    load_mtp_state,
    mtp_loss,
    mtp_loss_fn,
    mtp_state_dict,
    mtp_trainable,
    mtp_unroll,
    step_weights,
)
from models.speculative import MTPDraft, speculative_generate
from tasks.data.features import target_features
from tasks.training.config import TrainConfig
from tasks.training.trainer import Trainer

pytestmark = pytest.mark.unit
jax.config.update("jax_default_matmul_precision", "highest")

V = 32
FAMILIES = {
    "deepseek_v3": lambda seed=0: DeepseekV3(DeepseekV3Config.tiny(V, num_hidden_layers=2, num_mtp_layers=1),
                                             rngs=nnx.Rngs(seed)),
    "glm4_moe": lambda seed=0: Glm4Moe(Glm4MoeConfig.tiny(V, num_hidden_layers=2, num_mtp_layers=1),
                                       rngs=nnx.Rngs(seed)),
}
_models: dict[str, nnx.Module] = {}
SEGMENTS = ((7, 6), (9, 7))  # two packed sequences per row; row 0 ends with 3 padding tokens
T = 16


def family(name: str) -> nnx.Module:
    """One (never trained) instance per family for the read-only tests."""
    if name not in _models:
        _models[name] = FAMILIES[name]()
    return _models[name]


def packed_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """data_prep's packed columns: target_ids[p] = t_{p+1} (the segment's last one: the next token of its
    sequence, not in the row), positions restarting per segment, prompt tokens and a few others unmasked."""
    g = np.random.default_rng(seed)
    B = len(SEGMENTS)
    cols = {c: np.zeros((B, T), np.int32) for c in ("input_ids", "target_ids", "positions", "segment_ids",
                                                     "loss_mask")}
    for b, lens in enumerate(SEGMENTS):
        off = 0
        for s, n in enumerate(lens, 1):
            seq = g.integers(1, V, n + 1)
            sl = slice(off, off + n)
            cols["input_ids"][b, sl], cols["target_ids"][b, sl] = seq[:n], seq[1:]
            cols["positions"][b, sl], cols["segment_ids"][b, sl] = np.arange(n), s
            mask = (g.random(n) > 0.15).astype(np.int32)
            mask[:2] = 0  # the prompt
            cols["loss_mask"][b, sl] = mask
            off += n
    return cols


def segments(batch: dict[str, np.ndarray]):
    """(row, start, length) of every packed segment."""
    for b, lens in enumerate(SEGMENTS):
        off = 0
        for n in lens:
            yield b, off, n
            off += n


@jax.jit
def _features(graphdef, state, batch):
    model = nnx.merge(graphdef, state)
    final = target_features(model, batch, (0,))[1]
    return final, model.lm_logits(final)  # [B, T, D], [B, T, V]


def features(model, batch):
    graphdef, state = nnx.split(model)
    return _features(graphdef, state, {k: jnp.asarray(batch[k]) for k in ("input_ids", "positions", "segment_ids")})


def _np_objective(name: str, logits: np.ndarray, target: np.ndarray) -> np.ndarray:
    """kl_div / tv per row in float64 numpy (the speculators definitions)."""
    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    log_q, log_p = log_softmax(logits), log_softmax(target)
    p, q = np.exp(log_p), np.exp(log_q)
    if name == "kl_div":
        return (p * (log_p - log_q)).sum(-1)
    assert name == "tv"
    return 1.0 - np.minimum(p, q).sum(-1)


@jax.jit
def _draft_step(graphdef, state, tokens, h, first):
    """MTPDraft without a cache over one segment per row: the target feature (`first`) or its own feedback."""
    draft = MTPDraft(nnx.merge(graphdef, state))
    lg_f, h_f, _ = draft(tokens, features=h)
    lg_h, h_h, _ = draft(tokens, hidden=h)
    return jnp.where(first, lg_f, lg_h), jnp.where(first, h_f, h_h)


def reference_steps(model, batch, final, target_logits, steps: int):
    """The recursion with MTPDraft (no cache) and its own `hidden_out` feedback, unpacked: one segment per
    row, left-aligned (what follows a segment's rows cannot reach them: attention is causal). Step k over
    rows p = 0..n-2-k reads t_{p+1+k} and h_k[p] (h_0 = f) and is labelled at p+1+k.
    -> per step a list over segments of (logits [R, V], hard labels [R], soft labels [R, V], mask [R])."""
    segs = list(segments(batch))
    graphdef, state = nnx.split(model)
    h = np.zeros((len(segs), T, final.shape[-1]), np.float32)  # [S, T, D]
    for i, (b, off, n) in enumerate(segs):
        h[i, :n] = final[b, off:off + n]
    h = jnp.asarray(h)
    out = [[] for _ in range(steps)]
    for k in range(steps):
        tokens = np.zeros((len(segs), T), np.int32)  # [S, T]: row i holds t_{p+1+k} of segment i
        for i, (b, off, n) in enumerate(segs):
            tokens[i, :n - 1 - k] = batch["input_ids"][b, off + 1 + k:off + n]
        lg, h = _draft_step(graphdef, state, jnp.asarray(tokens), h, k == 0)
        for i, (b, off, n) in enumerate(segs):
            R, sl = n - 1 - k, slice(off + 1 + k, off + n)
            out[k].append((np.asarray(lg[i, :R]), batch["target_ids"][b, sl], np.asarray(target_logits[b, sl]),
                           batch["loss_mask"][b, sl] != 0))
    return out


# ------------------------------------------------------------------------------------------------
# The loss
# ------------------------------------------------------------------------------------------------


def test_step_weights_are_fastmtp_eq2():
    np.testing.assert_allclose(step_weights(0.6, 3), np.array([1, 0.6, 0.36]) / 1.96)
    assert step_weights(0.5, 1) == [1.0]
    with pytest.raises(ValueError):
        step_weights(0.6, 0)


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_one_step_is_the_mtp_draft_head(name):
    """steps=1: the per-position logits are MTPDraft's (no cache, one segment per row) and, for a row's first
    segment, DecoderLM.mtp_logits'; the loss is the masked hard CE of those logits."""
    model = family(name)
    batch = packed_batch(1)
    final, _ = features(model, batch)
    jb = {k: jnp.asarray(v) for k, v in batch.items()}

    @jax.jit
    def ours(b, f):  # one program: the unrolled logits, the loss, the head over the packed rows
        (logits,) = mtp_unroll(model, b["input_ids"], f, positions=b["positions"], segment_ids=b["segment_ids"],
                               steps=1)
        return logits, mtp_loss(model, b, final_hidden=f, steps=1), model.mtp_logits(b["input_ids"], f)

    logits, (total, stats), head = ours(jb, final)
    (ref,) = reference_steps(model, batch, final, final, 1)
    ref_loss, n_masked = 0.0, 0
    for (b, off, n), (lg, labels, _, mask) in zip(segments(batch), ref, strict=True):
        np.testing.assert_allclose(np.asarray(logits[b, off:off + n - 1]), lg, atol=2e-5, rtol=1e-5)
        if off == 0:  # mtp_logits knows no segments: a row's first segment only (causal: the rest is unseen)
            np.testing.assert_allclose(np.asarray(head[b, :n - 1]), lg, atol=2e-5, rtol=1e-5)
        logp = np.asarray(jax.nn.log_softmax(jnp.asarray(lg, jnp.float32), axis=-1), np.float64)
        ref_loss += -(logp[np.arange(n - 1), labels] * mask).sum()
        n_masked += int(mask.sum())
    np.testing.assert_allclose(float(total), ref_loss, rtol=1e-5)
    assert float(stats["acc_den"][0]) == n_masked and stats["loss"].shape == (1,)


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_three_steps_match_an_explicit_recursive_loop(name):
    """steps=3 over a packed batch (2 segments per row, padding): per-step loss sums, the weighted total and
    the exact accuracy counts equal a per-segment loop over MTPDraft's own feedback, for hard CE and the
    soft kl_div / tv objectives."""
    model = family(name)
    batch = packed_batch(2)
    final, target_logits = features(model, batch)
    jb = {k: jnp.asarray(v) for k, v in batch.items()}
    steps, beta = 3, 0.6
    ref = reference_steps(model, batch, final, target_logits, steps)
    w = step_weights(beta, steps)

    @jax.jit
    def run(b, f, tl):  # one program for the three objectives
        kw = dict(final_hidden=f, steps=steps, step_weight_beta=beta)
        return {"hard": mtp_loss(model, b, **kw), "kl_div": mtp_loss(model, b, target_logits=tl, **kw),
                "tv": mtp_loss(model, b, target_logits=tl, objective="tv", **kw)}

    results = run(jb, final, target_logits)
    for objective in ("hard", "kl_div", "tv"):
        soft = objective != "hard"
        total, stats = results[objective]
        ref_loss, ref_num, ref_den = np.zeros(steps), np.zeros(steps), np.zeros(steps)
        for k in range(steps):
            for lg, labels, tl, mask in ref[k]:
                if soft:
                    per = _np_objective(objective, lg, tl)
                    label = tl.argmax(-1)
                else:
                    lg64 = lg.astype(np.float64)
                    logz = np.log(np.exp(lg64 - lg64.max(-1, keepdims=True)).sum(-1)) + lg64.max(-1)
                    per = logz - lg64[np.arange(len(labels)), labels]
                    label = labels
                ref_loss[k] += (per * mask).sum()
                ref_num[k] += ((lg.argmax(-1) == label) & mask).sum()
                ref_den[k] += mask.sum()
        np.testing.assert_allclose(np.asarray(stats["loss"]), ref_loss, rtol=2e-5, atol=1e-6, err_msg=objective)
        np.testing.assert_array_equal(np.asarray(stats["acc_num"]), ref_num, err_msg=objective)
        np.testing.assert_array_equal(np.asarray(stats["acc_den"]), ref_den, err_msg=objective)
        np.testing.assert_allclose(float(total), float(np.dot(w, ref_loss)), rtol=2e-5, err_msg=objective)
        assert ref_den.min() > 0 and stats["loss"].dtype == jnp.float32


def test_loss_is_jit_and_grad_friendly_and_reaches_only_the_mtp_layer():
    """The gradient w.r.t. the trainable filter is finite and nonzero; the trainable set is exactly the
    MTP layer's Params (no embedding, LM head, Buffer or main-stack variable)."""
    model = family("deepseek_v3")
    L = model.config.num_hidden_layers
    trainable = mtp_trainable(model)
    params = nnx.state(model, trainable)
    paths = ["/".join(map(str, p)) for p, _ in nnx.to_flat_state(params)]
    assert paths and all(p.startswith(f"layers/{L}/") for p in paths)
    assert {"layers/2/eh_proj/kernel", "layers/2/enorm/weight", "layers/2/hnorm/weight",
            "layers/2/shared_head/norm/weight"} <= set(paths)
    every = {"/".join(map(str, p)) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
             if p[:2] == ("layers", L)}
    assert set(paths) == every  # every Param of the MTP layer
    assert not any("e_score_correction_bias" in p for p in paths)  # a Buffer: frozen

    batch = {k: jnp.asarray(v) for k, v in packed_batch(3).items()}
    final, target_logits = features(model, batch)
    graphdef, params, rest = nnx.split(model, trainable, ...)

    @jax.jit
    def grad(params, rest):
        def f(params):
            m = nnx.merge(graphdef, params, rest)
            return mtp_loss(m, batch, final_hidden=final, target_logits=target_logits, objective="lk_hybrid")[0]
        return jax.value_and_grad(f)(params)

    value, g = grad(params, rest)
    norms = [float(jnp.abs(x).max()) for x in jax.tree.leaves(g)]
    assert np.isfinite(float(value)) and all(np.isfinite(norms)) and max(norms) > 0


# ------------------------------------------------------------------------------------------------
# Training with the Trainer
# ------------------------------------------------------------------------------------------------


def _flat(model) -> dict[str, np.ndarray]:
    """Every variable of `model` (RNG state aside) as a host array, by its nnx path."""
    return {"/".join(map(str, p)): np.array(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))
            if not isinstance(v, nnx.RngState)}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_trainer_updates_only_the_mtp_layer_and_decoding_stays_lossless(name):
    """The real Trainer (AdamW, the MTP filter, `mtp_loss_fn`: features and soft labels online from the
    frozen target) lowers the loss; every main-stack variable, the embedding and the LM head stay
    bit-identical, the MTP layer moves; greedy speculative decoding with the trained MTP draft still equals
    greedy generate, token for token."""
    model = FAMILIES[name](seed=4)
    L = model.config.num_hidden_layers
    before = _flat(model)
    cfg = TrainConfig(steps=8, batch_size=2, learning_rate=2e-2, warmup_steps=0, weight_decay=0.0,
                      aux_loss_coef=0.01)
    trainer = Trainer(model, cfg, trainable=mtp_trainable(model), loss_fn=mtp_loss_fn(steps=3, objective="kl_div"))
    batch = packed_batch(5)
    stats = [trainer.step(batch) for _ in range(cfg.steps)]
    losses = [float(x["loss"]) for x in stats]
    assert losses[-1] < 0.8 * losses[0], losses
    assert float(stats[0]["aux_loss"]) > 0  # the MTP layer's MoE load-balancing loss, as it sowed it

    trained = trainer.model()
    after = _flat(trained)
    assert before.keys() == after.keys()
    mtp = [k for k in before if k.startswith(f"layers/{L}/")]
    frozen = [k for k in before if k not in mtp]
    assert any(k.startswith("embed_tokens/") for k in frozen)
    for k in frozen:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    moved = [k for k in mtp if not np.array_equal(after[k], before[k])]
    assert {f"layers/{L}/eh_proj/kernel", f"layers/{L}/shared_head/norm/weight"} <= set(moved)
    assert not any("e_score_correction_bias" in k for k in moved)

    ids = jnp.asarray(np.random.default_rng(6).integers(1, V, (2, 6)), jnp.int32)
    ref = np.asarray(generate(trained, ids, max_new_tokens=10).tokens)
    out = speculative_generate(trained, MTPDraft(trained), ids, max_new_tokens=10, k=3)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref)


# ------------------------------------------------------------------------------------------------
# Export / import
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["deepseek_v3", "glm4_moe"])
def test_state_dict_names_match_save_pretrained_and_round_trip(name, tmp_path):
    """mtp_state_dict is exactly what save_pretrained writes under model.layers.{L}.* (names and values, fp32);
    load_mtp_state installs it bit-exactly into another model, touching nothing else."""
    src = family(name)
    L = src.config.num_hidden_layers
    tensors = mtp_state_dict(src, "float32")
    save_pretrained(src, str(tmp_path), dtype=jnp.float32)
    written = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    saved = {k: v for k, v in written.items() if k.startswith(f"model.layers.{L}.")}
    assert sorted(tensors) == sorted(saved)
    for k, v in saved.items():
        assert tensors[k].dtype == v.dtype, k
        np.testing.assert_array_equal(tensors[k], v, err_msg=k)
    assert f"model.layers.{L}.embed_tokens.weight" in tensors  # the shared copies, as published
    lean = mtp_state_dict(src, "float32", include_shared=False)
    assert set(tensors) - set(lean) == {f"model.layers.{L}.embed_tokens.weight",
                                        f"model.layers.{L}.shared_head.head.weight"}
    assert mtp_state_dict(src)[f"model.layers.{L}.eh_proj.weight"].dtype == jnp.bfloat16

    dst = FAMILIES[name](seed=9)
    dst_before = _flat(dst)
    src_flat = _flat(src)
    load_mtp_state(dst, tensors)
    dst_after = _flat(dst)
    for k in dst_after:
        expect = src_flat[k] if k.startswith(f"layers/{L}/") else dst_before[k]
        np.testing.assert_array_equal(dst_after[k], expect, err_msg=k)
    again = mtp_state_dict(dst, "float32")
    for k in tensors:
        if k.endswith(("embed_tokens.weight", "shared_head.head.weight")):
            continue  # dst's own (frozen) embedding / head
        np.testing.assert_array_equal(again[k], tensors[k], err_msg=k)

    with pytest.raises(ValueError, match="outside the MTP layers"):
        load_mtp_state(dst, {"model.norm.weight": np.ones(64, np.float32), **tensors})
    missing = dict(tensors)
    missing.pop(f"model.layers.{L}.eh_proj.weight")
    with pytest.raises(ValueError, match="missing"):
        load_mtp_state(dst, missing)
