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
from tests.conftest import SMOKE, SMOKE_MOE

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
    assert report["waivers"] == [{"gate": "evaluate.gates.min_acceptance_length", "from": 3.0, "to": 1.5,
                                  "source": "--set", "reason": None}]
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


# -- gates a recipe lowers below the built-in defaults: refused without a reason, recorded with one ------------

LOWERED = {  # a gate set weaker than its built-in default -> the waivers recorded for it (tiny ships two schemes)
    "min_acceptance_length: 0.5": ["evaluate.gates.min_acceptance_length"],
    "max_quant_ppl_increase: 10": ["evaluate.gates.max_quant_ppl_increase[int8]",
                                   "evaluate.gates.max_quant_ppl_increase[w4a16-gptq-g64]"],
    "finetune_improves: false": ["evaluate.gates.finetune_improves"],
    "max_quant_flip_rate: {int8: 0.5, w4a16: 0.1}": ["evaluate.gates.max_quant_flip_rate[int8]"],  # w4a16's: default
}


def _recipe(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("stated", list(LOWERED))
def test_a_recipe_lowering_a_gate_without_a_reason_is_refused(tmp_path, stated):
    key = stated.split(":")[0]
    recipe = _recipe(tmp_path / "lowers.yaml", f"extends: tiny\nevaluate:\n  gates: {{{stated}}}\n")
    with pytest.raises(ConfigError) as e:
        load_recipe(recipe)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"recipe lowers.yaml: {LOWERED[stated][0]}: "), message
    assert "is weaker than the built-in default" in message and f"evaluate.gates.reasons.{key}" in message
    with pytest.raises(ConfigError, match=re.escape(LOWERED[stated][0])):
        load_release(recipe, allow_weaker_gates=True)  # the flag is for the command line, not for a recipe
    # a reason for another gate does not cover it; the file that extends this one is refused naming this one
    _recipe(tmp_path / "lowers.yaml", f"extends: tiny\nevaluate:\n  gates: {{{stated}, reasons: "
                                      f"{{speculative_lossless: because}}}}\n")
    child = _recipe(tmp_path / "child.yaml", "extends: lowers.yaml\nname: child\n")
    with pytest.raises(ConfigError, match=r"^recipe lowers\.yaml: " + re.escape(LOWERED[stated][0])):
        load_recipe(child)


@pytest.mark.parametrize("stated", list(LOWERED))
def test_a_reasoned_lowering_is_a_recorded_waiver(tmp_path, stated):
    key = stated.split(":")[0]
    why = f"the reason {key} is lowered here"
    recipe = _recipe(tmp_path / "lowers.yaml", f"extends: tiny\nevaluate:\n  gates:\n    {stated}\n"
                                              f"    reasons: {{{key}: {why}}}\n")
    cfg = load_release(recipe)
    assert [w["gate"] for w in cfg.waivers] == LOWERED[stated]
    default = Gates()
    for w in cfg.waivers:
        gate = w["gate"].removeprefix("evaluate.gates.")
        name, scheme = (gate[:-1].split("[") + [None])[:2] if "[" in gate else (gate, None)
        was = default.quant_limit(scheme, name) if scheme else getattr(default, name)
        now = cfg.evaluate.gates.quant_limit(scheme, name) if scheme else getattr(cfg.evaluate.gates, name)
        assert w == {"gate": w["gate"], "from": was, "to": now, "source": "lowers.yaml", "reason": why}
        assert (now > was) if scheme else (now < was)  # weaker: a higher limit, a lower floor, a check off
    assert cfg.evaluate.waivers == cfg.waivers  # the report's copy
    assert cfg.evaluate.declared_gates is None  # nothing loosened on the command line: the recipe's gates are in force
    # a recipe extending this one inherits the waiver with its source; a --set that restores the default drops it
    child = _recipe(tmp_path / "child.yaml", "extends: lowers.yaml\nname: child\n")
    assert [(w["gate"], w["source"]) for w in load_release(child).waivers] == [(g, "lowers.yaml")
                                                                               for g in LOWERED[stated]]
    restore = {"min_acceptance_length": "1.2", "finetune_improves": "true"}.get(key, "0.001")
    assert load_release(recipe, [f"evaluate.gates.{key}={restore}"]).waivers == ()


def test_the_shipped_recipes_record_the_gates_they_lower():
    """Every shipped recipe that lowers a gate says why; the rest lower none."""
    lowered = {name: [(w["gate"], w["source"]) for w in load_release(name).waivers]
               for name in ("tiny", "tiny-lora", "tiny-full", "tiny-dpo", "tiny-distill", "tiny-grpo",
                            SMOKE, SMOKE_MOE)}
    assert lowered == {
        "tiny": [], "tiny-lora": [], "tiny-full": [], "tiny-grpo": [], SMOKE: [],
        "tiny-dpo": [("evaluate.gates.finetune_improves", "tiny-dpo.yaml")],
        "tiny-distill": [("evaluate.gates.finetune_improves", "tiny-distill.yaml")],
        SMOKE_MOE: [("evaluate.gates.min_acceptance_length", "smoke-moe.yaml"),
                    ("evaluate.gates.max_quant_flip_rate[int8]", "smoke-moe.yaml"),
                    ("evaluate.gates.max_quant_flip_rate[w4a16-gptq-g64]", "smoke-moe.yaml")]}
    assert all(len(w["reason"]) > 40 for name in ("tiny-dpo", "tiny-distill", SMOKE_MOE)
               for w in load_release(name).waivers)


def test_reasons_name_gates_and_say_something(tmp_path):
    for reasons, words in (("{min_acceptance_lenght: typo}", "'min_acceptance_lenght' is not a gate (gates: "),
                           ("{min_acceptance_length: ' '}", "min_acceptance_length: empty")):
        recipe = _recipe(tmp_path / "r.yaml", f"extends: tiny\nevaluate:\n  gates: {{reasons: {reasons}}}\n")
        with pytest.raises(ConfigError, match=re.escape(f"recipe r.yaml: evaluate.gates.reasons: {words}")):
            load_recipe(recipe)
    recipe = _recipe(tmp_path / "r.yaml", "extends: tiny\nrefresh: {reasons: {min_acceptance_length: x}}\n")
    with pytest.raises(ConfigError, match="refresh.reasons: 'min_acceptance_length' is not a gate of the refresh"):
        load_recipe(recipe)


def test_recipe_and_command_line_waivers_together(tmp_path):
    """The refresh ratio a recipe lowers is its declared one (a --set waiver's is not); a --set loosening on
    top of a recipe's is a second waiver, from the recipe's value."""
    recipe = _recipe(tmp_path / "r.yaml", "extends: tiny\nrefresh:\n  min_acceptance_ratio: 0.9\n  reasons: "
                                          "{min_acceptance_ratio: a refresh within 10 % is still promoted}\n")
    with pytest.raises(ConfigError, match=r"recipe bare\.yaml: refresh\.min_acceptance_ratio: 0\.8 is weaker"):
        load_recipe(_recipe(tmp_path / "bare.yaml", "extends: tiny\nrefresh: {min_acceptance_ratio: 0.8}\n"))
    cfg = load_release(recipe)
    assert cfg.refresh_ratio_declared() == 0.9
    assert [(w["gate"], w["from"], w["to"], w["source"]) for w in cfg.waivers] == [
        ("refresh.min_acceptance_ratio", 1.0, 0.9, "r.yaml")]
    cfg = load_release(recipe, ["refresh.min_acceptance_ratio=0.5"], allow_weaker_gates=True)
    assert cfg.refresh.min_acceptance_ratio == 0.5 and cfg.refresh_ratio_declared() == 0.9
    assert [(w["from"], w["to"], w["source"], w["reason"]) for w in cfg.waivers] == [
        (1.0, 0.9, "r.yaml", "a refresh within 10 % is still promoted"), (0.9, 0.5, "--set", None)]


def test_verify_prints_the_waivers_a_bundle_records(tmp_path):
    """A recipe's reasoned waiver and a command-line one travel report -> lineage.json -> `forgeline verify`,
    on a bundle committed to a real (file://) store whose lineage resolves."""
    from typer.testing import CliRunner

    from flows.cli import app
    from flows.verify import report as verify_report
    from storage import Store, fingerprint
    from tasks.configs import ExportConfig
    from tasks.export import run as export
    from tasks.stage import StageContext

    why = "a draft for this model accepts 0.6 tokens a step | measured"
    recipe = _recipe(tmp_path / "lowers.yaml", f"extends: tiny\nevaluate:\n  gates:\n    min_acceptance_length: 0.5\n"
                                               f"    reasons: {{min_acceptance_length: '{why}'}}\n")
    cfg = load_release(recipe, ["evaluate.gates.speculative_lossless=false"], allow_weaker_gates=True)
    report = _report(acc=0.7)
    report |= judge(report, cfg.evaluate)
    assert report["passed"] and report["passed_as_declared"]  # 0.7 passes the recipe's own 0.5
    md = markdown({**report, "quantization": {}})
    assert f"| evaluate.gates.min_acceptance_length | 1.2 | 0.5 | lowers.yaml | {why.replace('|', chr(92) + '|')} |" \
        in md, md
    assert "| evaluate.gates.speculative_lossless | true | false | --set | (none: command line) |" in md, md
    store = Store(f"file://{tmp_path}/store", cache_dir=tmp_path / "cache")
    inputs, refs = {}, {}
    for name in ("evaluate", "finetune", "draft", "quant"):
        inputs[name] = tmp_path / name
        inputs[name].mkdir()
    (inputs["evaluate"] / "report.json").write_text(json.dumps(report))
    (inputs["evaluate"] / "report.md").write_text(md)
    (inputs["finetune"] / "model").mkdir()
    (inputs["finetune"] / "model" / "weights.txt").write_text("not a checkpoint")  # no config.json: not checked
    (inputs["draft"] / "draft" / "eagle3" / "sglang").mkdir(parents=True)
    (inputs["draft"] / "draft" / "eagle3" / "sglang" / "config.json").write_text("{}")  # not a checkpoint verify checks
    (inputs["draft"] / "draft" / "eagle3" / "draft_config.json").write_text('{"name": "eagle3"}')
    (inputs["draft"] / "draft" / "drafts.json").write_text('{"candidates": ["eagle3"]}')
    (inputs["quant"] / "none.txt").write_text("no scheme")
    for name, folder in inputs.items():
        refs[name] = store.commit(folder, name, fingerprint(name, {}, []), config={})
    out = tmp_path / "out"
    fp = fingerprint("export", {"w": 1}, refs.values())
    ctx = StageContext("export", fp, out, inputs, refs, store)
    export(ExportConfig(name="t", recipe=cfg.recorded()), ctx.inputs, ctx.out_dir, context=ctx)
    lineage = json.loads((out / "lineage.json").read_text())
    assert [(w["gate"], w["source"], w["reason"]) for w in lineage["waivers"]] == [
        ("evaluate.gates.min_acceptance_length", "lowers.yaml", why),
        ("evaluate.gates.speculative_lossless", "--set", None)]
    card = (out / "README.md").read_text()
    assert "the recipe holds gates below forgeline's defaults (`evaluate.gates.min_acceptance_length` 1.2 → 0.5 " \
           f"(lowers.yaml: {why}))" in card, card
    bundle = store.commit(out, "export", fp, config={})
    expected = [f"waiver: evaluate.gates.min_acceptance_length 1.2 -> 0.5 (lowers.yaml: {why})",
                "waiver: evaluate.gates.speculative_lossless true -> false (--set: no reason: loosened on the command "
                "line)"]
    code, lines = verify_report(bundle.url)
    assert code == 0 and lines[0].startswith(f"ok: {bundle.url}: export artifact") and "4 lineage entries" in lines[0]
    assert lines[1:] == expected, lines
    printed = CliRunner().invoke(app, ["verify", bundle.url])
    assert printed.exit_code == 0 and printed.stdout.splitlines()[1:] == expected, printed.output
    # a damaged bundle still lists them, before its error line
    (tmp_path / "store" / "export" / fp / "README.md").write_text("edited")
    code, lines = verify_report(bundle.url)
    assert code == 1 and lines[-3:-1] == expected and lines[-1].startswith("error: "), lines
