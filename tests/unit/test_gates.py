"""Gates that mean something: a recipe declares them, the command line may only tighten them unless
`--allow-weaker-gates` (then every loosening is a recorded waiver), no gate at all is an error, and a
release judged under waivers knows whether it also passed the gates as declared."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tasks.evaluate import EvalConfig, Gates, judge, markdown
from tasks.recipe import ConfigError, load_recipe, load_release

pytestmark = pytest.mark.unit


def _report(ft=10.0, q=10.04, lossless=True, acc=3.2):
    return {"perplexity": {"base": 12.0, "finetuned": ft, "int8": q},
            "quantization": {"int8": {"kl_p99": 1e-4, "top1_flip_rate": 0.003}},
            "draft": {"lossless": lossless, "mismatched_rows": 0 if lossless else 1, "acceptance_length": acc,
                      "runs": {}, "name": "eagle3"}}


@pytest.mark.parametrize("override, gate", [
    ("evaluate.gates.min_acceptance_length=0", "evaluate.gates.min_acceptance_length"),
    ("evaluate.gates.min_acceptance_length=2.9", "evaluate.gates.min_acceptance_length"),
    ("evaluate.gates.speculative_lossless=false", "evaluate.gates.speculative_lossless"),
    ("evaluate.gates.finetune_improves=false", "evaluate.gates.finetune_improves"),
    ("evaluate.gates.max_quant_ppl_increase=1e9", "evaluate.gates.max_quant_ppl_increase[int8]"),
    ("evaluate.gates.max_quant_ppl_increase.w4a16=0.05", "evaluate.gates.max_quant_ppl_increase[w4a16-gptq-g64]"),
    ("refresh.min_acceptance_ratio=0.5", "refresh.min_acceptance_ratio"),
])
def test_loosening_a_gate_needs_the_flag_and_is_recorded(override, gate):
    with pytest.raises(ConfigError, match=re.escape(f"--set {gate}: ") + r".* weaker than the recipe's .*"
                                          r"--allow-weaker-gates"):
        load_release("tiny", [override])
    cfg = load_release("tiny", [override], allow_weaker_gates=True)
    assert gate in {w["gate"] for w in cfg.waivers}
    assert cfg.evaluate.declared_gates == load_recipe("tiny").evaluate.gates  # the recipe's own, for the report
    assert cfg.model_dump(mode="json")["waivers"]  # travels into lineage.json with the recipe


@pytest.mark.parametrize("override", [
    "evaluate.gates.min_acceptance_length=3.5", "evaluate.gates.max_quant_ppl_increase=0.001",
    "refresh.min_acceptance_ratio=1.2", "finetune.train.steps=10", "quantize.schemes=[int8]",
])
def test_stricter_gates_and_other_overrides_need_no_flag(override):
    cfg = load_release("tiny", [override])
    assert cfg.waivers == () and cfg.evaluate.declared_gates is None


def test_a_recipe_that_enables_no_gate_is_an_error(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("extends: tiny\nquantize: {schemes: []}\nevaluate:\n  gates: {finetune_improves: false, "
                      "speculative_lossless: false, min_acceptance_length: 0}\n")
    with pytest.raises(ConfigError, match="no gate is enabled"):
        load_recipe(str(recipe))
    with pytest.raises(ValueError, match="no gate applies"):
        judge({"perplexity": {"finetuned": 1.0}, "quantization": {}},
              EvalConfig(gates=Gates(finetune_improves=False, speculative_lossless=False, min_acceptance_length=0)))


@pytest.mark.parametrize("key", ["waivers=[]", "evaluate.declared_gates={}"])
def test_waivers_cannot_be_written_by_hand(key):
    with pytest.raises(ConfigError, match="recorded by forgeline"):
        load_recipe("tiny", [key])


def test_a_release_under_waivers_knows_it_fails_the_declared_gates():
    cfg = load_release("tiny", ["evaluate.gates.min_acceptance_length=1.5"], allow_weaker_gates=True)
    report = _report(acc=2.0)  # passes 1.5 in force, fails the recipe's 3.0
    report |= judge(report, cfg.evaluate)
    assert report["passed"] is True and report["passed_as_declared"] is False
    assert report["waivers"] == [{"gate": "evaluate.gates.min_acceptance_length", "declared": 3.0, "effective": 1.5}]
    assert "fails the gates as declared" in markdown({**report, "quantization": {}})
    report = _report(acc=3.4)  # passes both
    report |= judge(report, cfg.evaluate)
    assert report["passed"] and report["passed_as_declared"] and report["waivers"]
    plain = _report(acc=3.4)
    plain |= judge(plain, load_release("tiny").evaluate)
    assert plain["passed_as_declared"] is True and plain["waivers"] == [] and "declared_gates" not in plain


def test_export_records_waivers_in_lineage_and_model_card(tmp_path):
    from tasks.configs import ExportConfig
    from tasks.export import run as export
    from tasks.stage import StageContext

    cfg = load_release("tiny", ["evaluate.gates.speculative_lossless=false"], allow_weaker_gates=True)
    report = _report(lossless=False)
    report |= judge(report, cfg.evaluate)
    inputs = {}
    for name in ("evaluate", "finetune", "draft", "quant"):
        inputs[name] = tmp_path / name
        inputs[name].mkdir()
    (inputs["evaluate"] / "report.json").write_text(json.dumps(report))
    (inputs["evaluate"] / "report.md").write_text(markdown({**report, "quantization": {}}))
    (inputs["finetune"] / "model").mkdir()
    (inputs["finetune"] / "model" / "config.json").write_text("{}")
    (inputs["draft"] / "draft" / "eagle3" / "sglang").mkdir(parents=True)  # the draft stage's layout, one candidate
    (inputs["draft"] / "draft" / "eagle3" / "sglang" / "config.json").write_text("{}")
    (inputs["draft"] / "draft" / "eagle3" / "draft_config.json").write_text('{"name": "eagle3"}')
    (inputs["draft"] / "draft" / "drafts.json").write_text('{"candidates": ["eagle3"]}')
    refs = {k: type("R", (), {"url": f"file:///s/{k}/fp", "kind": k, "fingerprint": "fp", "digest": "d" * 64})()
            for k in inputs}
    ctx = StageContext("export", "fp", tmp_path / "out", inputs, refs, None)
    meta = export(ExportConfig(name="t", recipe=cfg.model_dump(mode="json")), ctx.inputs, ctx.out_dir, context=ctx)
    lineage = json.loads((tmp_path / "out" / "lineage.json").read_text())
    assert meta["waivers"] == 1 and lineage["gates_passed"] is True and lineage["gates_passed_as_declared"] is False
    assert lineage["waivers"][0]["gate"] == "evaluate.gates.speculative_lossless"
    card = Path(tmp_path / "out" / "README.md").read_text()
    assert "**Waivers:**" in card and "not the promoted release" in card and "## Waivers" in card
    assert (tmp_path / "out" / "draft" / "sglang" / "config.json").exists() and "draft/sglang" in card


def test_quant_limits_take_the_longest_scheme_prefix_with_a_limit():
    g = Gates()
    assert g.quant_limit("int8-w8a8-gptq") == g.quant_limit("int8-w8a8") == 0.01  # not int8's weight-only limit
    assert g.quant_limit("int8") == 0.005 and g.quant_limit("w4a16-asym-gptq-g64") == 0.02
    assert (g.quant_limit("nvfp4-gptq"), g.quant_limit("nvfp4a16-gptq")) == (0.06, 0.03)
    assert g.quant_limit("w4afp8-g64", "max_quant_flip_rate") == 0.1
    with pytest.raises(ValueError, match="no limit for scheme 'w3a16'"):
        Gates(max_quant_ppl_increase={"int8": 0.01}).quant_limit("w3a16")
