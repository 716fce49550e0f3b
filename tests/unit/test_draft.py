"""tasks/draft.py: the EAGLE-3 draft stage trains on traces (offline features == online features), learns
(held-out TTT loss falls), exports both serving layouts, and warm-starts a refresh with the same vocabulary."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tasks import draft as dr
from tasks import traces as tr
from tasks.layout import draft_candidates
from tasks.training.config import TrainConfig

pytestmark = pytest.mark.unit

TRACES = tr.TracesConfig(num_prompts=16, num_valid_prompts=4, shard_prompts=8, batch_size=8, max_new_tokens=16,
                         max_prompt_len=48, seq_len=64, temperature=0.0, aux_layer_ids=[0, 1, 2],
                         hidden_dtype="float32")
DRAFT = dr.DraftConfig(k=3, ttt_steps=3, draft_vocab_size=256, export_dtype="float32",
                       train=TrainConfig(steps=12, batch_size=4, learning_rate=3e-3, warmup_steps=2, log_every=4,
                                         eval_batches=2))


@pytest.fixture(scope="module")
def target(tiny_target):
    return tiny_target


@pytest.fixture(scope="module")
def traces(target, tmp_path_factory):
    """(offline traces dir, online traces dir) of the same prompts and answers."""
    model, data = target
    off, on = tmp_path_factory.mktemp("traces_off"), tmp_path_factory.mktemp("traces_on")
    tr.traces(TRACES, model, data, off)
    tr.traces(TRACES.model_copy(update={"hidden_states": "online"}), model, data, on)
    return off, on


@pytest.fixture(scope="module")
def offline_run(target, traces, tmp_path_factory):
    out = tmp_path_factory.mktemp("draft_off")
    return out, dr.train_draft(DRAFT, target[0], traces[0], out)


def test_offline_and_online_features_train_the_same_draft(target, traces, offline_run, tmp_path):
    _, off_metrics = offline_run
    on_metrics = dr.train_draft(DRAFT, target[0], traces[1], tmp_path)
    assert on_metrics["hidden_states"] == "online" and off_metrics["hidden_states"] == "offline"
    off_losses = np.array([loss for _, loss in off_metrics["train_losses"]])
    on_losses = np.array([loss for _, loss in on_metrics["train_losses"]])
    np.testing.assert_allclose(on_losses, off_losses, rtol=2e-4)  # fp32 stored features: same up to rounding


def test_the_draft_learns_and_exports_both_layouts(target, offline_run):
    out, metrics = offline_run
    assert metrics["valid_loss_after"] < metrics["valid_loss_before"]
    assert len(metrics["valid_step_accuracy"]) == DRAFT.ttt_steps
    assert 0 < metrics["draft_vocab_coverage"] <= 1
    sg = json.loads((out / "draft" / "eagle3" / "sglang" / "config.json").read_text())
    sp = json.loads((out / "draft" / "eagle3" / "speculators" / "config.json").read_text())
    assert sg["architectures"] == ["LlamaForCausalLMEagle3"] and sg["draft_vocab_size"] == 256
    assert sg["vocab_size"] == 512 and sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert sp["speculators_model_type"] == "eagle3"
    assert sp["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == DRAFT.k
    meta = json.loads((out / "draft" / "eagle3" / "draft_config.json").read_text())
    assert meta["method"] == "eagle3" and meta["aux_layer_ids"] == [0, 1, 2] and meta["objective"] == "kl_div"
    assert json.loads((out / "draft" / "drafts.json").read_text()) == {"candidates": ["eagle3"]}
    assert draft_candidates(out) == {"eagle3": out / "draft" / "eagle3"}


def test_warm_start_keeps_the_vocabulary_and_continues_from_the_weights(target, traces, offline_run, tmp_path):
    import models
    from models.eagle3 import load_eagle3

    out, metrics = offline_run
    cfg = DRAFT.model_copy(update={"draft_vocab_size": 128, "train": DRAFT.train.model_copy(update={"steps": 4})})
    warm = dr.train_draft(cfg, target[0], traces[0], tmp_path, init_dir=out)
    assert warm["warm_start"] and warm["draft_vocab_size"] == 256  # the init's vocabulary, not the config's
    embed = models.from_pretrained(str(target[0])).embed_tokens.weight[...]
    before = load_eagle3(str(out / "draft" / "eagle3" / "sglang"), embed_tokens=embed)
    after = load_eagle3(str(tmp_path / "draft" / "eagle3" / "sglang"), embed_tokens=embed)
    np.testing.assert_array_equal(np.asarray(before.d2t[...]), np.asarray(after.d2t[...]))
    assert warm["valid_loss_before"] == pytest.approx(metrics["valid_loss_after"], rel=1e-5)


def test_warm_start_from_a_draft_on_other_layers_is_refused(target, traces, offline_run, tmp_path):
    out, _ = offline_run
    other = tmp_path / "traces"
    other.mkdir()
    for f in traces[0].iterdir():
        (other / f.name).symlink_to(f)
    meta = json.loads((traces[0] / "traces.json").read_text())
    (other / "traces.json").unlink()
    (other / "traces.json").write_text(json.dumps({**meta, "aux_layer_ids": [0, 1, 1]}))
    with pytest.raises(ValueError, match="aux layers"):
        dr.train_draft(DRAFT, target[0], other, tmp_path / "out", init_dir=out)


def test_candidates_of_each_kind_and_selection_by_measured_acceptance(target, traces, tmp_path):
    """Three candidates (EAGLE-3 with the forward KL, P-EAGLE with the LK hybrid, DFlash with TV and its own
    step budget) trained in one stage run, each exported in its layouts; with `select_every` the exported
    weights are the checkpoint whose held-out τ (the real speculative engine) was highest, and decoding the
    same prompts with the exported draft measures that τ again."""
    from models.drafts import load_draft, target_head
    from models.speculative import speculative_generate
    from tasks.configs import DraftCandidate

    cfg = DRAFT.model_copy(update={
        "candidates": [DraftCandidate(), DraftCandidate(kind="peagle", loss="lk_hybrid"),
                       DraftCandidate(kind="dflash", loss="tv", num_anchors=8, steps=8)], "select_every": 4,
        "select_prompts": 2, "select_prompt_len": 24, "select_max_new_tokens": 8})
    metrics = dr.train_draft(cfg, target[0], traces[0], tmp_path)
    assert list(metrics["candidates"]) == ["eagle3", "peagle-lk_hybrid", "dflash-tv"]
    found = draft_candidates(tmp_path)
    assert list(found) == ["eagle3", "peagle-lk_hybrid", "dflash-tv"]
    assert (found["eagle3"] / "sglang" / "config.json").exists()
    assert not (found["peagle-lk_hybrid"] / "sglang").exists()
    spec = json.loads((found["peagle-lk_hybrid"] / "speculators" / "config.json").read_text())
    assert spec["speculators_model_type"] == "peagle" and spec["mask_token_id"] >= 0

    import models
    model = models.from_pretrained(str(target[0]))
    prompts = dr.selection_prompts(traces[0], 2, 24)
    for name, folder in found.items():
        meta = json.loads((folder / "draft_config.json").read_text())
        history = meta["acceptance_history"]
        assert [s for s, _ in history] == ([4, 8] if name == "dflash-tv" else [4, 8, 12]), name
        best = max(history, key=lambda h: h[1])
        assert meta["selected_step"] == best[0] and meta["selected_acceptance_length"] == best[1]
        draft = load_draft(folder, model.embed_tokens.weight[...], target_head(model))
        out = speculative_generate(model, draft, prompts, max_new_tokens=8, k=cfg.k,
                                   eos_token_id=json.loads((target[0] / "config.json").read_text()).get("eos_token_id"))
        assert out.mean_acceptance_length == pytest.approx(best[1], abs=1e-3), name


def test_mtp_candidate_fine_tunes_the_targets_own_head_and_export_installs_it(target, tmp_path):
    """A DeepSeek-V3 target with one MTP layer: the `mtp` candidate trains only that layer on the target's
    traces (selected by measured τ), exports it under the checkpoint's own names, decodes losslessly as a
    draft, and `install_mtp` writes it into a copy of the checkpoint without touching any other tensor.
    A target without MTP layers is refused by name."""
    import shutil

    from flax import nnx
    from safetensors.numpy import load_file

    import models
    from models.deepseek_v3 import DeepseekV3, DeepseekV3Config
    from models.generate import generate
    from models.mtp_finetune import mtp_state_dict
    from models.speculative import speculative_generate
    from tasks.configs import DraftCandidate
    from tasks.evaluate import mtp_draft
    from tasks.export import install_mtp
    from tasks.finetune import save_model_dir

    _, data = target
    special = json.loads((data / "special_tokens.json").read_text())
    cfg = DeepseekV3Config.tiny(512, num_hidden_layers=3, num_nextn_predict_layers=1, bos_token_id=special["bos"],
                                eos_token_id=special["eos"], pad_token_id=special["pad"])
    model_dir = tmp_path / "ds" / "model"
    save_model_dir(DeepseekV3(cfg, rngs=nnx.Rngs(0)), model_dir, data)
    traces = tmp_path / "traces"
    tr.traces(TRACES.model_copy(update={"num_prompts": 8, "shard_prompts": 8}), model_dir, data, traces)

    draft_cfg = DRAFT.model_copy(update={"candidates": [DraftCandidate(kind="mtp", num_depths=2)], "select_every": 6,
                                         "select_prompts": 2, "select_prompt_len": 24, "select_max_new_tokens": 8})
    metrics = dr.train_draft(draft_cfg, model_dir, traces, tmp_path / "out")
    folder = draft_candidates(tmp_path / "out")["mtp"]
    meta = json.loads((folder / "draft_config.json").read_text())
    assert meta["method"] == "mtp" and [s for s, _ in meta["acceptance_history"]] == [6, 12]
    assert metrics["valid_loss_after"] < metrics["valid_loss_before"]
    tensors = load_file(str(folder / "mtp" / "model.safetensors"))
    original = models.from_pretrained(str(model_dir))
    want = mtp_state_dict(original, "float32", include_shared=False)
    assert sorted(tensors) == sorted(want) and all(n.startswith("model.layers.3.") for n in tensors)
    assert any(not np.array_equal(tensors[n], want[n]) for n in tensors)  # the head moved

    draft = mtp_draft(model_dir, folder)
    prompts = dr.selection_prompts(traces, 2, 24)
    out = speculative_generate(original, draft, prompts, max_new_tokens=8, k=3)
    plain = generate(original, prompts, max_new_tokens=8)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(plain.tokens))

    bundle = tmp_path / "bundle" / "model"
    shutil.copytree(model_dir, bundle)
    install_mtp(bundle, folder / "mtp" / "model.safetensors")
    before, after = load_file(str(model_dir / "model.safetensors")), load_file(str(bundle / "model.safetensors"))
    assert sorted(before) == sorted(after)
    for name in before:
        np.testing.assert_array_equal(after[name], tensors[name] if name in tensors else before[name], err_msg=name)

    with pytest.raises(ValueError, match=r"draft.candidates\[mtp\]: kind mtp fine-tunes the target's own MTP layers"):
        dr.train_draft(draft_cfg, target[0], traces, tmp_path / "refused")
