"""tasks/draft.py: the EAGLE-3 draft stage trains on traces (offline features == online features), learns
(held-out TTT loss falls), exports both serving layouts, and warm-starts a refresh with the same vocabulary."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tasks import draft as dr
from tasks import traces as tr
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
    sg = json.loads((out / "draft" / "sglang" / "config.json").read_text())
    sp = json.loads((out / "draft" / "speculators" / "config.json").read_text())
    assert sg["architectures"] == ["LlamaForCausalLMEagle3"] and sg["draft_vocab_size"] == 256
    assert sg["vocab_size"] == 512 and sg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert sp["speculators_model_type"] == "eagle3"
    assert sp["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == DRAFT.k
    meta = json.loads((out / "draft" / "draft_config.json").read_text())
    assert meta["method"] == "eagle3" and meta["aux_layer_ids"] == [0, 1, 2]
    assert dr.draft_dir(out) == out / "draft" / "sglang"


def test_warm_start_keeps_the_vocabulary_and_continues_from_the_weights(target, traces, offline_run, tmp_path):
    import models
    from models.eagle3 import load_eagle3

    out, metrics = offline_run
    cfg = DRAFT.model_copy(update={"draft_vocab_size": 128, "train": DRAFT.train.model_copy(update={"steps": 4})})
    warm = dr.train_draft(cfg, target[0], traces[0], tmp_path, init_dir=out)
    assert warm["warm_start"] and warm["draft_vocab_size"] == 256  # the init's vocabulary, not the config's
    embed = models.from_pretrained(str(target[0])).embed_tokens.weight[...]
    before = load_eagle3(str(out / "draft" / "sglang"), embed_tokens=embed)
    after = load_eagle3(str(tmp_path / "draft" / "sglang"), embed_tokens=embed)
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
