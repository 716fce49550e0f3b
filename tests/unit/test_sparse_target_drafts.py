"""P-EAGLE, DFlash and MTP drafts on the DSA / mHC targets: DeepSeek-V3.2, GLM-5 (docs/models/deepseek-v32.md,
glm-moe-dsa.md) and DeepSeek-V4 (deepseek-v4.md).

- P-EAGLE and DFlash, built and trained as the draft stage builds and trains them (tasks/draft.py `build_draft`,
  `DraftTrainee` on the target's features: the stream means for V4), decode through the real speculative decoder
  exactly the target's greedy continuation (computed without a cache), past the indexer's top-k (V3.2, GLM-5) and
  past V4's window and both compression rates, with several tokens accepted per verify (the DSA selection and V4's
  hash routing / compressed caches run inside verification and rollback); the speculators layout they export
  reads back to the same draft.
- The MTP layers V3.2 and GLM-5 ship (`num_nextn_predict_layers`; built on the V3 decoder, with their own DSA
  indexer) are drafts: MTPDraft is `mtp_logits` with a one-layer cache of the target's geometry (GLM-5's per-layer
  `indexer_types` do not fit a one-layer config), fine-tuning moves only the MTP layer and keeps decoding lossless,
  and the layer survives save_pretrained / from_pretrained. DeepSeek-V4 builds none: transformers drops its
  published `mtp.*` layer and defines no structure for it (docs/models/deepseek-v4.md).

    pytest -m 'slow or not slow' tests/unit/test_sparse_target_drafts.py
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models import from_pretrained, save_pretrained
from models.deepseek_v4 import DeepseekV4
from models.deepseek_v32 import DeepseekV32, DeepseekV32Config
from models.drafts import load_draft, save_draft, target_head
from models.eagle3 import build_draft_vocab, default_aux_layer_ids
from models.generate import KVCache
from models.glm_moe_dsa import GlmMoeDsa, GlmMoeDsaConfig
from models.mtp_finetune import mtp_loss, mtp_state_dict, mtp_trainable
from models.speculative import MTPDraft, speculative_generate
from tasks.configs import DraftCandidate, DraftConfig
from tasks.data.features import target_features
from tasks.draft import TRAINABLE, TRAINING, DraftTrainee, build_draft
from tests.unit.test_deepseek_v4_drafts import perturbed_v4

pytestmark = pytest.mark.unit
jax.config.update("jax_default_matmul_precision", "highest")

V, VD, K = 32, 24, 4  # target vocabulary, draft vocabulary, draft tokens per verify
PROMPT, NEW = 5, 14  # 19 positions: past the indexer's top 8 (V3.2, GLM-5) and V4's window 8 and rates 4 / 8


def _v4() -> DeepseekV4:
    """The tiny V4 with its mHC weights perturbed (tests/unit/test_deepseek_v4_drafts.py)."""
    return perturbed_v4(V)


TARGETS = {  # V3.2 and GLM-5 with the MTP layer their checkpoints ship (the main stack does not read it)
    "deepseek_v32": lambda: DeepseekV32(DeepseekV32Config.tiny(V, num_mtp_layers=1), rngs=nnx.Rngs(0)),
    "glm_moe_dsa": lambda: GlmMoeDsa(GlmMoeDsaConfig.tiny(V, num_mtp_layers=1), rngs=nnx.Rngs(0)),  # layer 1 shared
    "deepseek_v4": _v4,
}
_cache: dict[str, dict] = {}


def packed(seq: jax.Array) -> dict[str, jax.Array]:
    """data_prep's packed columns of one sequence per row [B, T] (every next token scored but the last)."""
    B, T = seq.shape
    return {"input_ids": seq, "target_ids": jnp.roll(seq, -1, axis=1),
            "positions": jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)),
            "segment_ids": jnp.ones((B, T), jnp.int32), "loss_mask": jnp.ones((B, T), jnp.int32).at[:, -1].set(0)}


def target(name: str) -> dict:
    """Per family, once: the target, a prompt [2, PROMPT], its greedy continuation `ref` [2, NEW] and the packed batch
    of prompt + continuation with the draft stage's offline columns (`aux`: the features at the default layers,
    `final`). The continuation is computed without a cache, by NEW full forwards over one [2, T] buffer whose
    unfilled tail the causal mask, the indexer's causal top-k and V4's closed-window rule keep out of every position
    read (one compiled program: tasks/data/features.py `target_features` and the LM head), with no near-tie that
    the cached decoders' ≤ 1e-5 logit error could flip."""
    if name not in _cache:
        model = TARGETS[name]()
        aux = default_aux_layer_ids(model.config.num_hidden_layers)

        @nnx.jit
        def forward(m, b):
            feats, final = target_features(m, b, aux)
            return feats, final, m.lm_logits(final)

        prompt = np.random.default_rng(1).integers(0, V, (2, PROMPT)).astype(np.int32)
        seq = np.concatenate([prompt, np.zeros((2, NEW), np.int32)], axis=1)  # [2, T]
        for p in range(PROMPT, PROMPT + NEW):
            logits = np.asarray(forward(model, packed(jnp.asarray(seq)))[2][:, p - 1])  # [2, V]
            top2 = np.sort(logits, axis=-1)[:, -2:]
            assert np.all(top2[:, 1] - top2[:, 0] > 1e-4), (name, p)
            seq[:, p] = logits.argmax(-1)
        batch = packed(jnp.asarray(seq))
        batch["aux"], batch["final"], _ = forward(model, batch)
        _cache[name] = dict(model=model, prompt=jnp.asarray(prompt), ref=seq[:, PROMPT:], batch=batch, aux=list(aux))
    return _cache[name]


def train(trainee: nnx.Module, loss_of, steps: int, lr: float, wrt) -> list[float]:
    """`steps` Adam steps of loss_of(trainee) on the parameters `wrt` selects -> the losses."""
    opt = nnx.Optimizer(trainee, optax.adam(lr), wrt=wrt)

    @nnx.jit
    def step(trainee, opt):
        loss, grads = nnx.value_and_grad(loss_of, argnums=nnx.DiffState(0, wrt))(trainee)
        opt.update(trainee, grads)
        return loss

    return [float(step(trainee, opt)) for _ in range(steps)]


# ------------------------------------------------------------------------------------------------
# P-EAGLE and DFlash
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["peagle", "dflash"])
@pytest.mark.parametrize("family", list(TARGETS))
def test_block_draft_trains_decodes_losslessly_and_exports(family, kind, tmp_path):
    """The draft stage's build and offline loss on the target's features (the serving temperature 0.1: the tiny
    random target is nearly flat), a few Adam steps on the target's own continuation: the loss falls, greedy
    speculative decoding equals the target's greedy continuation token for token, with calls that accept several
    drafts, and the speculators folder (verifier = this architecture) loads back to a draft that proposes the same
    logits."""
    t = target(family)
    model, batch = t["model"], t["batch"]
    counts = np.bincount(np.asarray(batch["input_ids"]).ravel(), minlength=V) + 1  # the text's tokens first
    cfg = DraftConfig(k=K, draft_vocab_size=VD, seed=1, candidates=[DraftCandidate(kind=kind)])
    draft, info = build_draft(cfg.candidates[0], cfg, model, t["aux"], build_draft_vocab(counts, VD), None)
    assert list(draft.target_layers) == t["aux"] and info["warm_start"] is False
    trainee = DraftTrainee(draft, model, online=False, steps=TRAINING[kind].steps(draft, cfg), decay=cfg.ttt_decay,
                           objective="kl_div", temperature=0.1, num_anchors=8)
    tokens = jnp.sum(batch["loss_mask"])
    losses = train(trainee, lambda tr: tr.loss(batch)[0] / tokens, 40, 1e-2, TRAINABLE)
    assert losses[-1] < 0.5 * losses[0], losses

    out = speculative_generate(model, draft, t["prompt"], max_new_tokens=NEW, k=K)
    np.testing.assert_array_equal(np.asarray(out.tokens), t["ref"])
    assert out.lengths.tolist() == [NEW, NEW]
    print(f"{family} {kind}: tau {out.mean_acceptance_length:.3f}, emitted per call {out.emitted.T.tolist()}")
    assert out.emitted.max() >= 3 and out.mean_acceptance_length > 1.2  # calls that accepted 2+ drafts verified

    target_config = model.config.to_hf()
    save_draft(draft, tmp_path, target_config=target_config, verifier_name_or_path="../model",
               num_speculative_tokens=K, dtype="float32")
    written = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert written["speculators_model_type"] == kind
    assert written["speculators_config"]["verifier"]["architectures"] == target_config["architectures"]
    loaded = load_draft(tmp_path, model.embed_tokens.weight[...], target_head(model))
    assert type(loaded) is type(draft) and loaded.config == draft.config
    cache = lambda d: d.context(batch["input_ids"][:, 1:9], batch["aux"][:, :8], cache=d.init_cache(2, 32),
                                positions=jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8)))
    pending = (batch["input_ids"][:, 9:12], batch["aux"][:, 8:11], jnp.array([3, 2], jnp.int32))
    want, _ = draft.propose(*pending, cache=cache(draft), k=K)
    got, _ = loaded.propose(*pending, cache=cache(loaded), k=K)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ------------------------------------------------------------------------------------------------
# MTP layers (V3.2, GLM-5)
# ------------------------------------------------------------------------------------------------


MTP_FAMILIES = ["deepseek_v32", "glm_moe_dsa"]


def test_mtp_draft_is_the_dsa_targets_mtp_head():
    """GLM-5 (V3.2's graph, plus per-layer `indexer_types` a one-layer config would not fit) built with one MTP
    layer: it is an MTP layer with its own (full) DSA indexer, the draft's cache has the target's per-token geometry
    for one layer, and the draft (cached, over every position at once, past the indexer's top-k) equals
    `mtp_logits`. V3.2 decodes with its MTP layer in the slow test below."""
    model = TARGETS["glm_moe_dsa"]()
    L = model.config.num_hidden_layers
    assert model.num_mtp_layers == 1 and model.layers[L].self_attn.indexer is not None
    draft = MTPDraft(model)
    cache = draft.init_cache(2, 24)
    full = KVCache.init(model.config, 2, 24, model.dtype)  # the target's own: [L, B, ·, S, ·]
    assert (cache.k.shape, cache.v.shape) == ((1, *full.k.shape[1:]), (1, *full.v.shape[1:]))
    ids = jnp.asarray(np.random.default_rng(2).integers(0, V, (2, 20)), jnp.int32)

    @nnx.jit
    def both(model, ids, cache):
        _, hidden = model(ids, return_hidden=(-1,))
        got, _, cache = MTPDraft(model)(ids[:, 1:], features=hidden[0][:, :-1], cache=cache,
                                        positions=jnp.broadcast_to(jnp.arange(19, dtype=jnp.int32), (2, 19)))
        return model.mtp_logits(ids, hidden[0]), got, cache  # [2, 19, V] each

    want, got, cache = both(model, ids, cache)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert cache.length.tolist() == [19, 19]


@pytest.mark.slow
@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_mtp_layer_fine_tunes_decodes_losslessly_and_round_trips(family, tmp_path):
    """mtp_loss (3 recursive steps, soft labels from the frozen target at temperature 0.1) on the target's own
    continuation lowers the loss and moves only the MTP layer; greedy speculative decoding with the fine-tuned layer
    equals the target's greedy continuation token for token, with calls that accept several drafts; save_pretrained
    / from_pretrained keeps the layer (num_nextn_predict_layers, its tensors, the indexer's included)."""
    t = target(family)
    model, batch = nnx.clone(t["model"]), t["batch"]  # the shared target stays untrained
    L = model.config.num_hidden_layers
    logits = model.lm_logits(batch["final"])
    before = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    losses = train(model, lambda m: mtp_loss(m, batch, final_hidden=batch["final"], target_logits=logits, steps=3,
                                             temperature=0.1)[0] / jnp.sum(batch["loss_mask"]),
                   20, 1e-2, mtp_trainable(model))
    assert losses[-1] < 0.5 * losses[0], losses
    after = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    moved = {"/".join(map(str, k)) for k in before if not np.array_equal(before[k], after[k])}
    assert moved and all(k.startswith(f"layers/{L}/") for k in moved), sorted(moved)
    assert f"layers/{L}/eh_proj/kernel" in moved

    out = speculative_generate(model, MTPDraft(model), t["prompt"], max_new_tokens=NEW, k=3)
    np.testing.assert_array_equal(np.asarray(out.tokens), t["ref"])  # the main stack did not move: the same greedy
    print(f"{family} mtp: tau {out.mean_acceptance_length:.3f}, emitted per call {out.emitted.T.tolist()}")
    assert out.emitted.max() >= 3

    save_pretrained(model, str(tmp_path), dtype=jnp.float32)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    back = from_pretrained(str(tmp_path))
    assert type(back) is type(model) and back.num_mtp_layers == 1
    want, got = mtp_state_dict(model, "float32"), mtp_state_dict(back, "float32")
    assert sorted(want) == sorted(got) and any(".self_attn.indexer." in k for k in want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
