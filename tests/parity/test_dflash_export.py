"""DFlash draft exports checked against code nobody on this project wrote: vLLM `speculators` 0.9.0
(the library that trains and converts `DFlashSpeculator` drafts).

1. Its own config dispatch (`SpeculatorModelConfig.from_pretrained` -> `DFlashSpeculatorConfig`) and
   `DFlashDraftModel.from_pretrained` load our `save_dflash` output (a tiny Qwen3 target saved with
   `save_pretrained` is the verifier): every tensor lands, none is left over, and the config.json has
   exactly the keys its config class reads (and the ones its own `save_pretrained` writes).
2. Its anchored-block forward (`_backbone_forward`, `select_anchors` patched to our anchors, its
   dense-mask "eager" path) gives the same block logits as our `DFlashDraft` in fp32 on a packed row
   of two documents, with a reduced and with the full draft vocabulary.
3. Its per-slot losses (eager `kl_div_loss` / `tv_loss`, `dflash_loss_decay`, `compute_metrics`)
   on its own logits / targets / aligned loss mask equal our `block_loss` stats.

Reference: docs/formats/dflash.md. Install: see tests/parity/test_eagle3_export.py (SPECULATORS_INSTALL).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from parity_helpers import TINY, VARIANTS, rel_err

from models.dflash import DFlashConfig, DFlashDraft, block_loss, load_dflash, save_dflash, select_anchors
from models.eagle3 import build_draft_vocab
from models.llama import LlamaConfig

pytestmark = pytest.mark.parity

SPECULATORS_INSTALL = ("pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 openai==3.57.0 distro==1.9.0 "
                       "jiter==0.19.0 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 pandas==3.1.1")
TARGET_LAYERS = 8  # default aux ids (1, 3, 4): speculators' [2, 4, 5]
DRAFT_VOCAB = 48
BLOCK = 4
MASK_ID = 127
T = 24
DOCS = (13, 9)  # a packed row: two documents and 2 padding tokens
TOL = 1e-4
# keys transformers' PretrainedConfig adds to every to_dict() (bookkeeping, not read by the draft)
PRETRAINED_BOOKKEEPING = {"transformers_version", "output_hidden_states", "return_dict", "chunk_size_feed_forward",
                          "is_encoder_decoder", "id2label", "label2id", "problem_type", "output_attentions",
                          "_name_or_path", "torch_dtype"}
LEGACY_ROPE = {"rope_theta", "rope_scaling"}  # the transformers-4 spelling, folded into rope_parameters


def randomize(draft: DFlashDraft, seed: int) -> None:
    """Every trainable weight random (norm gains around 1) so each of them changes the logits."""
    state = nnx.state(draft, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [1.0 + 0.2 * jax.random.normal(k, x.shape, x.dtype) if x.ndim == 1
           else 0.08 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    nnx.update(draft, jax.tree.unflatten(treedef, new))


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Any]:
    """8-layer tiny Qwen3 and Llama (llama3 RoPE) targets saved with save_pretrained; our 2-layer drafts
    for them (Qwen3: reduced and full draft vocabulary; Llama: reduced), each with its target's
    embedding and LM head, and their fp32 exports."""
    root = tmp_path_factory.mktemp("dflash")
    targets = {
        "qwen3": transformers.Qwen3Config(**{**TINY, "num_hidden_layers": TARGET_LAYERS}, head_dim=16,
                                          tie_word_embeddings=False),
        "llama3": transformers.LlamaConfig(**{**TINY, "num_hidden_layers": TARGET_LAYERS},
                                           **VARIANTS["llama3_rope"][1]),
    }
    out: dict[str, Any] = {}
    for kind, config in targets.items():
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        hf.save_pretrained(root / kind)
        out[kind] = dict(hf=hf, dir=root / kind, config=json.loads((root / kind / "config.json").read_text()))
    out.update(target_dir=out["qwen3"]["dir"], target_config=out["qwen3"]["config"], hf_target=out["qwen3"]["hf"])
    for name, kind, vocab in (("reduced", "qwen3", DRAFT_VOCAB), ("full", "qwen3", None),
                              ("llama3_rope", "llama3", DRAFT_VOCAB)):
        hf, tdir, tconfig = out[kind]["hf"], out[kind]["dir"], out[kind]["config"]
        embed, head = hf.model.embed_tokens.weight.detach().numpy(), hf.lm_head.weight.detach().numpy()
        cfg = DFlashConfig.for_target(LlamaConfig.from_hf(tconfig), draft_vocab_size=vocab, num_layers=2,
                                      block_size=BLOCK, mask_token_id=MASK_ID)
        draft = DFlashDraft(cfg, rngs=nnx.Rngs(1))
        randomize(draft, 1)
        if vocab is not None:
            d2t, t2d, _ = build_draft_vocab(np.random.default_rng(0).integers(0, 1000, size=cfg.vocab_size), vocab)
            draft.set_vocab(d2t, t2d)
        draft.load_embedding(embed)
        draft.load_lm_head(head)
        folder = root / name
        save_dflash(draft, str(folder), target_config=tconfig, verifier_name_or_path=str(tdir), dtype="float32")
        out[name] = dict(draft=draft, folder=folder)
    return out


@pytest.fixture(scope="module")
def spx():
    try:
        import speculators
        from speculators.models.dflash import DFlashDraftModel  # noqa: F401
    except ImportError as e:
        pytest.fail(f"the speculators library is needed for this parity check ({e}); install it with\n"
                    f"    {SPECULATORS_INSTALL}")
    return speculators


def load_speculators_model(spx, folder: Path):
    """speculators' config dispatch + pydantic validation + from_pretrained, on its dense-mask eager
    attention (its flex-attention default compiles the mask), then its verifier-weight loader (the
    embedding, the verifier head / norm for targets, the full-vocabulary lm_head)."""
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    config = spx.SpeculatorModelConfig.from_pretrained(str(folder))
    assert type(config) is DFlashSpeculatorConfig
    config.transformer_layer_config._attn_implementation = "eager"
    model = DFlashDraftModel.from_pretrained(str(folder), config=config).eval()
    model.load_verifier_weights()
    return model, config


# ------------------------------------------------------------------------------------------------
# config.json and tensors
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", ["reduced", "full"])
def test_speculators_loads_every_tensor_and_key(spx, exported, vocab, tmp_path):
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.utils import resolve_target_layer_ids
    folder, draft = exported[vocab]["folder"], exported[vocab]["draft"]
    model, config = load_speculators_model(spx, folder)
    c = draft.config
    assert config.draft_vocab_size == c.draft_vocab_size and config.target_vocab_size == c.vocab_size
    assert (config.block_size, config.mask_token_id, config.sample_from_anchor) == (BLOCK, MASK_ID, False)
    assert model.target_layer_ids == [i + 1 for i in draft.target_layers]  # boundary ids
    with pytest.warns(UserWarning):  # its default for an N-layer verifier is our default + 1
        assert resolve_target_layer_ids(None, str(exported["target_dir"])) == model.target_layer_ids
    layer = config.transformer_layer_config
    assert (layer.model_type, layer.num_hidden_layers, layer.hidden_size, layer.head_dim, layer.vocab_size) == \
        ("qwen3", 2, c.hidden_size, c.head_dim, c.vocab_size)
    assert layer.rope_parameters["rope_theta"] == c.rope_theta and layer.rope_parameters["rope_type"] == "default"
    assert config.speculators_config.proposal_methods[0].speculative_tokens == BLOCK - 1
    assert config.speculators_config.verifier.name_or_path == str(exported["target_dir"])

    # config.json: every key is a field its config class reads; every field it reads is written
    ours = json.loads((folder / "config.json").read_text())
    theirs = config.to_dict()
    assert set(ours) <= set(theirs)  # nothing dropped
    assert set(theirs) - set(ours) <= PRETRAINED_BOOKKEEPING
    assert set(ours["transformer_layer_config"]) - set(theirs["transformer_layer_config"]) == LEGACY_ROPE
    for key in ("aux_hidden_state_layer_ids", "block_size", "mask_token_id", "draft_vocab_size", "sample_from_anchor",
                "sliding_window_non_causal", "speculators_model_type", "speculators_config", "architectures"):
        assert theirs[key] == ours[key], key
    # ... and the same keys its own training path writes (from_training_args' config, save_pretrained)
    verifier = transformers.AutoConfig.from_pretrained(str(exported["target_dir"]))
    verifier.num_hidden_layers = 2
    kw = DFlashDraftModel._build_base_config_kwargs(
        "dflash", verifier, draft_vocab_size=c.draft_vocab_size, block_size=BLOCK, mask_token_id=MASK_ID,
        verifier_name_or_path=str(exported["target_dir"]), target_layer_ids=[i + 1 for i in draft.target_layers])
    DFlashDraftModel(DFlashSpeculatorConfig(**kw)).save_pretrained(str(tmp_path / "native"))
    native = json.loads((tmp_path / "native" / "config.json").read_text())
    # torch_dtype: the legacy alias of dtype, still read by transformers-4 engines; auto_map: its
    # remote-code pointer (unused: engines dispatch on speculators_model_type)
    assert set(ours) - set(native) == {"torch_dtype"}
    assert set(native) - set(ours) == {"transformers_version", "auto_map"}
    for key in ("aux_hidden_state_layer_ids", "speculators_config", "sample_from_anchor", "block_size"):
        assert native[key] == ours[key], key

    # tensors: the model's own state minus what comes from the verifier, bit-equal
    from safetensors.torch import load_file
    tensors = load_file(folder / "model.safetensors")
    from_verifier = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    if vocab == "full":
        from_verifier |= {"lm_head.weight"}
    state = model.state_dict()
    assert sorted(tensors) == sorted(set(state) - from_verifier)
    for name, value in tensors.items():
        assert torch.equal(state[name], value), name
    hf_target = exported["hf_target"]
    assert torch.equal(model.embed_tokens.weight, hf_target.model.embed_tokens.weight)
    np.testing.assert_array_equal(model.lm_head.weight.detach().numpy(), np.asarray(draft.lm_head.kernel[...]).T)
    if vocab == "reduced":
        model.load_vocab_mappings(tensors["t2d"], tensors["d2t"])  # its own t2d / d2t consistency checks


def test_load_dflash_reads_a_speculators_checkpoint(spx, exported, tmp_path):
    """The other direction: speculators' own `save_pretrained` (its config spelling, boundary aux
    ids) loads with our `load_dflash` into the same draft."""
    model, _ = load_speculators_model(spx, exported["reduced"]["folder"])
    model.save_pretrained(str(tmp_path / "saved"))
    draft = exported["reduced"]["draft"]
    loaded = load_dflash(str(tmp_path / "saved"), exported["hf_target"].model.embed_tokens.weight.detach().numpy())
    assert loaded.config == draft.config
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(loaded)), nnx.to_flat_state(nnx.state(draft)),
                                 strict=True):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))


# ------------------------------------------------------------------------------------------------
# block logits and losses
# ------------------------------------------------------------------------------------------------


def packed_row(seed: int, num_aux: int, D: int, V: int) -> dict[str, np.ndarray]:
    """One packed row of two documents + padding: token ids, features, positions, document ids (-1 =
    padding, speculators), segment ids (ours, 0 = padding), a token-aligned loss mask (speculators:
    is t_p an answer token) and the verifier's last hidden states."""
    rng = np.random.default_rng(seed)
    doc = np.concatenate([np.full(n, i) for i, n in enumerate(DOCS)] + [np.full(T - sum(DOCS), -1)])
    positions = np.concatenate([np.arange(n) for n in DOCS] + [np.zeros(T - sum(DOCS), int)])
    token_mask = ((rng.random(T) < 0.85) & (doc >= 0) & (positions >= 2)).astype(np.int64)
    return dict(ids=rng.integers(0, V - 1, size=T), feats=rng.normal(size=(T, num_aux * D)).astype(np.float32),
                positions=positions, doc=doc, seg=doc + 1, token_mask=token_mask,
                last_hidden=rng.normal(size=(T, D)).astype(np.float32))


def speculators_forward(model, row: dict[str, np.ndarray], anchors: np.ndarray, valid: np.ndarray, monkeypatch):
    """The library's `_backbone_forward` with `select_anchors` returning our anchors."""
    import speculators.models.dflash.core as core
    monkeypatch.setattr(core, "select_anchors",
                        lambda loss_mask, n, bs: (torch.tensor(anchors, dtype=torch.long), torch.tensor(valid)))
    t = lambda x, dtype=torch.long: torch.tensor(x, dtype=dtype)[None]
    with torch.no_grad():
        _, logits, targets, mask, indices = model._backbone_forward(
            t(row["feats"], torch.float32), t(row["ids"]), t(row["token_mask"]), t(row["last_hidden"], torch.float32),
            t(row["doc"]), t(row["positions"]), max_anchors=len(anchors))
    return logits, targets, mask, indices


def our_batch(row: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Our packed columns: loss_mask aligned with target_ids (loss_mask[p]: is t_{p+1} an answer)."""
    loss_mask = np.concatenate([row["token_mask"][1:], [0]])
    return {k: jnp.asarray(v[None], jnp.int32) for k, v in dict(
        input_ids=row["ids"], target_ids=np.roll(row["ids"], -1), positions=row["positions"], segment_ids=row["seg"],
        loss_mask=loss_mask).items()}


@pytest.mark.parametrize("vocab", ["reduced", "full", "llama3_rope"])
def test_block_logits_match_speculators(spx, exported, monkeypatch, vocab):
    """Anchors in both documents (one block runs past its document's end, one sits at a document's
    first answer token): the context is each anchor's document before it, the block bidirectional."""
    model, _ = load_speculators_model(spx, exported[vocab]["folder"])
    draft = exported[vocab]["draft"]
    c = draft.config
    row = packed_row(1, c.num_aux, c.hidden_size, c.vocab_size)
    anchors = np.array([2, 5, 11, 13, 15, 18])  # 11: runs into document 2; 13, 15, 18: document 2
    logits, _, _, _ = speculators_forward(model, row, anchors, np.ones(len(anchors), bool), monkeypatch)
    ours = draft(jnp.asarray(row["ids"][None]), jnp.asarray(row["feats"][None]), jnp.asarray(anchors[None]),
                 positions=jnp.asarray(row["positions"][None]), segment_ids=jnp.asarray(row["seg"][None]))
    assert ours.shape == (1, len(anchors), BLOCK, c.draft_vocab_size)
    assert rel_err(ours.reshape(1, -1, c.draft_vocab_size), logits.numpy()) <= TOL


@pytest.mark.parametrize(("vocab", "objective"), [("reduced", "kl_div"), ("full", "kl_div"), ("reduced", "tv")])
def test_block_loss_matches_speculators(spx, exported, monkeypatch, vocab, objective):
    """Random anchors (ours, fed to the library). Per slot: the library's eager objective on its own
    logits and targets (the verifier's restricted head on its normed last hidden states) under its
    aligned loss mask, decayed by `dflash_loss_decay`, reduced by its `compute_metrics`; our mask adds
    two conditions (docs/formats/dflash.md): the label token inside the anchor's document, the
    target's full-vocabulary argmax inside the draft vocabulary."""
    from speculators.losses import dflash_loss_decay, eager
    from speculators.models.dflash.metrics import compute_metrics
    model, _ = load_speculators_model(spx, exported[vocab]["folder"])
    draft = exported[vocab]["draft"]
    c = draft.config
    row = packed_row(2, c.num_aux, c.hidden_size, c.vocab_size)
    hf = exported["hf_target"]
    used = np.asarray(draft.target_token_ids)
    # most verifier hidden states point at a draft-vocabulary row of its head, so that most (not all)
    # full-vocabulary argmaxes fall inside the draft vocabulary
    rng = np.random.default_rng(5)
    head = hf.lm_head.weight.detach().numpy()
    steer = rng.random(T) < 0.8
    row["last_hidden"][steer] += 20.0 * head[rng.choice(used, steer.sum())]
    batch = our_batch(row)
    n, gamma = 8, 3.0
    anchors, valid = select_anchors(batch, n, BLOCK, jax.random.key(3))
    anchors, valid = np.asarray(anchors[0]), np.asarray(valid[0])
    assert valid.sum() >= 6 and (anchors[valid] > DOCS[0]).any()  # anchors in both documents
    logits, targets, mask, indices = speculators_forward(model, row, anchors, valid, monkeypatch)

    # our target logits: the verifier's full head on its normed last hidden states
    with torch.no_grad():
        full = hf.lm_head(hf.model.norm(torch.tensor(row["last_hidden"][None]))).numpy()  # [1, T, V]
    total, stats = block_loss(draft, batch, jnp.asarray(row["feats"][None]), jnp.asarray(full), num_anchors=n,
                              objective=objective, gamma=gamma, rng=jax.random.key(3))

    # the library's targets are our restricted labels at a + j - 1
    label_pos = (indices.numpy() - 1) % T
    np.testing.assert_allclose(targets[0].numpy(), full[0][label_pos][:, used], rtol=1e-5, atol=1e-5)
    # our extra mask conditions, from the library's own block indices
    anchor_of = np.repeat(anchors, BLOCK)
    same_doc = row["doc"][indices.numpy()] == row["doc"][anchor_of]
    in_draft = np.isin(full[0].argmax(-1)[label_pos], used)
    combined = mask[0].numpy() * same_doc * in_draft  # [n·bs]
    outside = (mask[0].numpy() * same_doc * ~in_draft).sum()  # slots only our in-draft condition drops
    assert combined.sum() > 10 and (outside == 0 if vocab == "full" else outside > 0)
    assert (mask[0].numpy() * ~same_doc).sum() > 0  # the library scores a block past its document's end

    fn = {"kl_div": eager.kl_div_loss, "tv": eager.tv_loss}[objective]
    per = fn(logits, targets)[0].numpy()  # [n·bs]
    slot = np.arange(n * BLOCK) % BLOCK
    for j in range(1, BLOCK):
        np.testing.assert_allclose(float(stats["loss"][j - 1]), (per * combined)[slot == j].sum(), rtol=TOL, atol=1e-6)
    decay = dflash_loss_decay(torch.tensor(slot, dtype=torch.float32), gamma=gamma).numpy()
    np.testing.assert_allclose(float(total), (per * combined * decay).sum(), rtol=TOL)
    # the library's reduction and accuracy counts under the combined mask
    loss, metrics = compute_metrics(logits, targets, torch.tensor(combined)[None], BLOCK, gamma=gamma,
                                    loss_config={objective: (fn, 1.0)})
    np.testing.assert_allclose(float(total), float(loss) * (combined.sum() + 1e-5), rtol=TOL)
    for j in range(1, BLOCK):
        assert float(stats["acc_num"][j - 1]) == float(metrics[f"position_{j}_acc_sum"])
        assert float(stats["acc_den"][j - 1]) == float(metrics[f"position_{j}_acc_total"])
