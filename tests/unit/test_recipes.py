"""Recipes state differences from the one set of defaults (tasks/configs.py), section by section."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tasks.configs import DraftConfig, ReleaseConfig
from tasks.recipe import RECIPES, load_recipe


def test_a_partial_section_keeps_its_own_defaults(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("draft:\n  train:\n    batch_size: 8\nrefresh:\n  data:\n    max_documents: 10\n")
    cfg = load_recipe(str(recipe))
    assert cfg.draft.train.batch_size == 8
    assert cfg.draft.train.steps == DraftConfig().train.steps != 200  # the draft's default, not TrainConfig's
    assert cfg.draft.train.checkpoint_every == DraftConfig().train.checkpoint_every
    assert cfg.refresh.data.corpus == ReleaseConfig().refresh.data.corpus  # kept beside the stated key
    # --set writes over the recipe in the same way
    cfg = load_recipe(str(recipe), ["draft.train.learning_rate=0.01"])
    assert (cfg.draft.train.learning_rate, cfg.draft.train.batch_size, cfg.draft.train.steps) == \
        (0.01, 8, DraftConfig().train.steps)


def test_a_recipe_states_a_mapping_whole_and_set_changes_one_key(tmp_path):
    recipe = tmp_path / "r.yaml"
    # (int8's limit stricter than the default: a weaker one would need a reason, tests/unit/test_gates.py)
    recipe.write_text("evaluate:\n  gates:\n    max_quant_ppl_increase: {int8: 0.004}\nquantize:\n  schemes: [int8]\n")
    cfg = load_recipe(str(recipe))
    assert dict(cfg.evaluate.gates.max_quant_ppl_increase) == {"int8": 0.004}
    assert cfg.quantize.schemes == ("int8",)
    limits = dict(ReleaseConfig().evaluate.gates.max_quant_ppl_increase)
    cfg = load_recipe(str(recipe), ["evaluate.gates.max_quant_ppl_increase.w4a16=0.05"])
    assert dict(cfg.evaluate.gates.max_quant_ppl_increase) == {"int8": 0.004, "w4a16": 0.05}
    cfg = load_recipe("tiny", ["evaluate.gates.max_quant_ppl_increase.w4a16=0.05"])  # tiny states no limits
    assert dict(cfg.evaluate.gates.max_quant_ppl_increase) == {**limits, "w4a16": 0.05}


def test_the_default_recipe_states_only_differences():
    default = ReleaseConfig().model_dump(mode="json")
    data = yaml.safe_load((RECIPES / "tiny.yaml").read_text())

    def restated(section: dict, defaults: dict, path: str = "") -> list[str]:
        out = []
        for key, value in section.items():
            if isinstance(value, dict) and isinstance(defaults.get(key), dict) and not key.startswith("max_quant_"):
                out += restated(value, defaults[key], f"{path}{key}.")
            elif defaults.get(key) == (list(value) if isinstance(value, tuple) else value):
                out.append(path + key)
        return out

    assert restated(data, default) == ["name"]  # the name is stated for the reader; it is also the default


def test_a_recipe_is_validated_without_jax():
    """The CLI's preflight parses the recipe before any stage, and a scheduler may validate one on a machine
    without accelerators: neither imports JAX for it."""
    code = ("import sys; from tasks.recipe import load_release; "
            "load_release('tiny', ['finetune.train.steps=3', 'quantize.schemes=[int8, w4a16-awq-g64]']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax', 'orbax')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"
