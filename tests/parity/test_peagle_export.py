"""P-EAGLE exports checked against vLLM `speculators` 0.9.0, code nobody on this project wrote.

`save_peagle` output is loaded by the library's own config dispatch (`PEagleSpeculatorConfig`) and
`PEagleDraftModel.from_pretrained`; every tensor lands (mask_hidden included, nothing left over). Its
parallel-group forward (anchors at every depth, the P-EAGLE mask of `models/peagle/attention.py`, mask
token + mask_hidden at depths >= 1, its dense "eager" attention) gives the same logits as our
`parallel_unroll` in fp32, and the per-depth loss of our `ttt_loss(..., unroll=parallel_unroll)` equals
the one computed from the library's logits, for the forward KL and the LK hybrid objective (its eager
`kl_div_loss` / `lk_hybrid_loss`). speculators installs as in tests/parity/test_eagle3_export.py.
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
from parity_helpers import TINY, rel_err

from models.eagle3 import Eagle3Config, build_draft_vocab, ttt_loss
from models.llama import LlamaConfig
from models.peagle import PEagleConfig, PEagleDraft, load_peagle, parallel_unroll, save_peagle

pytestmark = pytest.mark.parity

SPECULATORS_INSTALL = ("pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 openai==3.57.0 distro==1.9.0 "
                       "jiter==0.19.0 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 pandas==3.1.1")
TARGET_LAYERS = 8
DRAFT_VOCAB = 48
T = 12
DEPTHS = 4
TOL = 1e-4


@pytest.fixture(scope="module")
def spx():
    try:
        import speculators
        from speculators.models.peagle import PEagleDraftModel  # noqa: F401
    except ImportError as e:
        pytest.fail(f"the speculators library is needed for this parity check ({e}); install it with\n"
                    f"    {SPECULATORS_INSTALL}")
    return speculators


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, Any]:
    """An 8-layer tiny Llama target saved with save_pretrained, a random P-EAGLE draft for it, its fp32 export."""
    root = tmp_path_factory.mktemp("peagle")
    torch.manual_seed(0)
    hf_target = transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**{**TINY, "num_hidden_layers": TARGET_LAYERS}), dtype=torch.float32).eval()
    target_dir = root / "target"
    hf_target.save_pretrained(target_dir)
    target_config = json.loads((target_dir / "config.json").read_text())
    V = target_config["vocab_size"]
    base = Eagle3Config.for_target(LlamaConfig.from_hf(target_config), draft_vocab_size=DRAFT_VOCAB)
    draft = PEagleDraft(PEagleConfig.from_eagle3(base, mask_token_id=V - 3, num_depths=DEPTHS), rngs=nnx.Rngs(0))
    state = nnx.state(draft, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    nnx.update(draft, jax.tree.unflatten(treedef, [
        1.0 + 0.2 * jax.random.normal(k, x.shape) if x.ndim == 1 and x.shape[0] == base.hidden_size
        else (0.08 if x.ndim > 1 else 1.0) * jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)]))
    d2t, t2d, _ = build_draft_vocab(np.random.default_rng(0).integers(0, 1000, size=V), DRAFT_VOCAB)
    draft.set_vocab(d2t, t2d)
    draft.load_embedding(hf_target.model.embed_tokens.weight.detach().numpy())
    folder = root / "peagle"
    save_peagle(draft, str(folder), target_config=target_config, verifier_name_or_path=str(target_dir),
                dtype="float32")
    return dict(draft=draft, folder=folder, target_dir=target_dir, hf_target=hf_target)


def load_speculators_model(spx, folder: Path):
    """The library's config dispatch + from_pretrained on its dense-mask ("eager") attention path."""
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
    config = spx.SpeculatorModelConfig.from_pretrained(str(folder))
    assert type(config) is PEagleSpeculatorConfig
    config.transformer_layer_config._attn_implementation = "eager"
    model = PEagleDraftModel.from_pretrained(str(folder), config=config).eval()
    with torch.no_grad():  # re-arm the verifier-embedding sentinel (see test_eagle3_export.load_speculators_model)
        model.embed_tokens.weight.fill_(float("nan"))
    model.load_verifier_weights()
    return model, config


def test_speculators_loads_every_tensor(spx, exported):
    model, config = load_speculators_model(spx, exported["folder"])
    draft = exported["draft"]
    assert config.mask_token_id == draft.config.mask_token_id and config.draft_vocab_size == DRAFT_VOCAB
    assert config.speculators_config.algorithm == "peagle"
    assert config.speculators_config.proposal_methods[0].speculative_tokens == DEPTHS
    assert model.target_layer_ids == [i + 1 for i in draft.target_layers]
    from safetensors.torch import load_file
    tensors = load_file(exported["folder"] / "model.safetensors")
    from_verifier = {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"}
    state = model.state_dict()
    assert sorted(tensors) == sorted(set(state) - from_verifier)
    for name, value in tensors.items():
        assert torch.equal(state[name], value), name
    np.testing.assert_array_equal(model.mask_hidden.detach().numpy().reshape(-1), np.asarray(draft.mask_hidden[...]))
    assert torch.equal(model.embed_tokens.weight, exported["hf_target"].model.embed_tokens.weight)
    # and back: the library's own save_pretrained output loads into the same draft
    model.save_pretrained(str(exported["folder"].parent / "resaved"))
    again = load_peagle(str(exported["folder"].parent / "resaved"), draft.embed_tokens.weight[...])
    assert again.config == draft.config


def speculators_parallel_logits(model, ids: np.ndarray, feats: np.ndarray,
                                monkeypatch) -> dict[tuple[int, int], np.ndarray]:
    """The library's forward with every anchor kept at every depth (its COD sampler replaced by the full
    set; anchor + depth stays inside the sequence) -> {(anchor, depth): logits [Vd]}."""
    import speculators.models.peagle.core as core
    from speculators.losses import eager
    anchors = np.concatenate([np.arange(T - d) for d in range(DEPTHS)])
    depth = np.concatenate([np.full(T - d, d) for d in range(DEPTHS)])
    monkeypatch.setattr(core, "generate_cod_sample_indices",
                        lambda **kw: (torch.tensor(anchors), torch.tensor(depth)))
    out = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: out.append(o.detach().numpy()))
    try:
        with torch.no_grad():
            model(hidden_states=torch.tensor(feats), input_ids=torch.tensor(ids, dtype=torch.long),
                  document_ids=torch.zeros((1, T), dtype=torch.long),
                  verifier_last_hidden_states=torch.zeros((1, T, model.hidden_size)), num_depths=DEPTHS,
                  loss_config={"kl_div": (eager.kl_div_loss, 1.0)})  # its fused default needs Triton
    finally:
        hook.remove()
    assert len(out) == 1
    return {(int(a), int(d)): out[0][0, i] for i, (a, d) in enumerate(zip(anchors, depth, strict=True))}


@pytest.mark.parametrize("objective", ["kl_div", "lk_hybrid"])
def test_parallel_forward_and_loss_match_speculators(spx, exported, monkeypatch, objective):
    from speculators.losses import eager
    model, _ = load_speculators_model(spx, exported["folder"])
    draft = exported["draft"]
    rng = np.random.default_rng(2)
    V, F = draft.config.vocab_size, draft.fc.in_features
    ids = rng.integers(0, V, size=(1, T))  # position p consumes t_{p+1} at depth 0
    feats = rng.normal(size=(1, T, F)).astype(np.float32)
    ref = speculators_parallel_logits(model, ids, feats, monkeypatch)

    positions = jnp.arange(T, dtype=jnp.int32)[None]
    ours = [np.asarray(x[0]) for x in parallel_unroll(draft, jnp.asarray(ids, jnp.int32), jnp.asarray(feats),
                                                        positions=positions, segment_ids=jnp.ones((1, T), jnp.int32),
                                                        steps=DEPTHS)]
    for (a, d), want in ref.items():
        assert rel_err(ours[d][a], want) <= TOL, f"anchor {a} depth {d}"

    # the loss: labels for depth d at p are the target's logits at p + 1 + d over the draft vocabulary
    target_logits = (3.0 * rng.normal(size=(1, T, V))).astype(np.float32)
    used = np.asarray(draft.target_token_ids)
    target_logits[0, :, used[::5]] += 9.0  # every argmax inside the draft vocabulary
    loss_mask = (rng.random((1, T)) < 0.8).astype(np.int32)
    batch = dict(target_ids=jnp.asarray(ids, jnp.int32), positions=positions,
                 segment_ids=jnp.ones((1, T), jnp.int32), loss_mask=jnp.asarray(loss_mask))
    total, stats = ttt_loss(draft, batch, jnp.asarray(feats), jnp.asarray(target_logits), steps=DEPTHS, decay=1.0,
                            objective=objective, unroll=parallel_unroll)
    fn = {"kl_div": eager.kl_div_loss, "lk_hybrid": eager.lk_hybrid_loss}[objective]
    restricted = target_logits[0][:, used]  # [T, Vd]
    for d in range(DEPTHS):
        nodes = [a for a in range(T - 1 - d) if loss_mask[0, a + 1 + d]]
        logits = torch.tensor(np.stack([ref[(a, d)] for a in nodes]))[None]
        targets = torch.tensor(np.stack([restricted[a + 1 + d] for a in nodes]))[None]
        want = float(fn(logits, targets).sum())
        np.testing.assert_allclose(float(stats["loss"][d]), want, rtol=TOL, atol=1e-6)
        assert float(stats["acc_den"][d]) == len(nodes)
