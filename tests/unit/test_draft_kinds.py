"""models/draft_format.py + models/draft_base.py: a draft kind added as one record is told apart by its
folder, and its draft is written and read back through the shared base (the steps docs/speculative-decoding.md
"Adding a draft kind" names)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from flax import nnx

from models import draft_base
from models.draft_format import SPECULATORS_DIR, DraftKind, draft_kind, folder_kind, kinds, register, unregister
from models.eagle3 import Eagle3Config, Eagle3Draft, build_draft_vocab

pytestmark = pytest.mark.unit

V, VD = 64, 24


class ToyDraft(Eagle3Draft):
    """A throwaway kind: the EAGLE-3 module under another name (its layer written as `layers.0.*`)."""


def rename(name: str) -> str:
    return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


def save_toy(draft: ToyDraft, folder) -> None:
    folder.mkdir(parents=True)
    config = {**draft_base.speculators_envelope(
        architecture="ToySpeculator", model_type="toy", layer_config=draft.config.transformer_layer_config(),
        draft_vocab_size=draft.config.draft_vocab_size, speculative_tokens=2, target_config={"architectures": ["T"]},
        verifier_name_or_path="org/target", dtype="float32"), "toy_layer_config": draft.config.to_hf("float32")}
    draft_base.write_folder(str(folder), config, draft_base.draft_tensors(draft, "float32", rename=rename))


def load_toy(folder, embed: np.ndarray) -> ToyDraft:
    config = Eagle3Config.from_hf(json.loads((folder / "config.json").read_text())["toy_layer_config"])
    draft = nnx.eval_shape(lambda: ToyDraft(config, rngs=nnx.Rngs(0)))
    draft_base.read_tensors(str(folder), draft, rename=rename)
    draft.load_embedding(embed)
    return draft


@pytest.fixture
def toy_kind():
    kind = register(DraftKind("toy", "the EAGLE-3 layer, renamed", speculators_type="toy",
                              check=lambda c, k: f"num_depths {c.num_depths} != k {k}" if c.num_depths != k else None))
    yield kind
    unregister("toy")


def test_a_registered_kind_round_trips_through_the_shared_base(toy_kind, tmp_path):
    assert "toy" in kinds() and draft_kind("toy") is toy_kind
    assert toy_kind.check(SimpleNamespace(num_depths=3), 2) == "num_depths 3 != k 2"
    assert toy_kind.check(SimpleNamespace(num_depths=2), 2) is None
    with pytest.raises(ValueError, match="already registered"):
        register(DraftKind("toy", "again"))

    rng = np.random.default_rng(0)
    config = Eagle3Config.tiny(V, VD, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                               num_key_value_heads=None, head_dim=None, aux_layer_ids=(0, 1, 2))
    assert (config.num_key_value_heads, config.head_dim, config.target_hidden_size) == (4, 8, 32)  # shared defaults
    draft = ToyDraft(config, rngs=nnx.Rngs(1))
    embed = rng.normal(size=(V, 32)).astype(np.float32)
    draft.load_embedding(embed)
    draft.set_vocab(*build_draft_vocab(rng.integers(0, 50, size=V), VD)[:2])
    folder = tmp_path / "toy" / SPECULATORS_DIR
    save_toy(draft, folder)
    assert folder_kind(tmp_path / "toy") == "toy"

    back = load_toy(folder, embed)
    assert type(back) is ToyDraft
    written = draft_base.draft_tensors(draft, "float32", rename=rename)
    read = draft_base.draft_tensors(back, "float32", rename=rename)
    assert sorted(written) == sorted(read) and "layers.0.self_attn.q_proj.weight" in written
    for name in written:
        np.testing.assert_array_equal(read[name], written[name], err_msg=name)


def test_the_shared_reader_names_every_mismatch_and_an_unregistered_kind_is_refused(toy_kind, tmp_path):
    config = Eagle3Config.tiny(V, VD, hidden_size=32, intermediate_size=48, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=8, aux_layer_ids=(0, 1, 2))
    with pytest.raises(ValueError, match="head_dim must be even"):
        Eagle3Config.tiny(V, VD, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=7)
    draft = ToyDraft(config, rngs=nnx.Rngs(2))
    folder = tmp_path / "toy" / SPECULATORS_DIR
    save_toy(draft, folder)
    tensors = draft_base.draft_tensors(draft, "float32", rename=rename)
    del tensors["norm.weight"]
    tensors["stray"] = np.zeros(3, np.float32)
    draft_base.write_folder(str(folder), json.loads((folder / "config.json").read_text()), tensors)
    with pytest.raises(ValueError, match=r"do not match the ToyDraft: 1 missing: norm\.weight; 1 unexpected: stray"):
        load_toy(folder, np.zeros((V, 32), np.float32))

    unregister("toy")
    try:
        assert "toy" not in kinds()
        with pytest.raises(ValueError, match="speculators_model_type 'toy' is not one of eagle3, peagle, dflash, mtp"):
            folder_kind(tmp_path / "toy")
    finally:
        register(toy_kind)  # the fixture unregisters it
