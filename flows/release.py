"""The `release` flow: base checkpoint + corpus -> a release bundle in the store.

    data_prep(base corpus) -> base (pretrain, or import base.url)
    data_prep(corpus, base tokenizer) -> finetune -> quantize
        (method distill: traces[teacher](base, top-k logits) -> finetune: a smaller student of the base)
                                             \\-> traces(served model) -> draft (every candidate:
                                                                               EAGLE-3, P-EAGLE, DFlash)
    evaluate(base, finetuned, quantized, drafts: ships the fastest lossless) --gates--> export
        -> pointers/releases/<name>.json

Each stage is the `stage` task (flows/stages.py): cached on its fingerprint, so re-running a
release resumes after the last committed stage and a finished release re-runs in seconds. With
`execution: workers` the flow only orchestrates: each stage is a flow run on a worker, and stages whose
inputs are committed run at once (flows/execution.py).

Gates: export refuses a release that fails the gates in force. Gates the recipe lowers below their built-in
defaults (each with the recipe's reason) and gates loosened on the command line (`allow_weaker_gates`) are
recorded as waivers in the report, lineage.json and the model card; a release under command-line waivers still
exports, but the release pointer moves only when the gates the recipe declares all pass.
"""

from __future__ import annotations

import base64
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_image_artifact, create_markdown_artifact, create_table_artifact

import storage
from flows.execution import cancel_stage_runs
from flows.stages import Stages
from storage import ArtifactRef, Store
from tasks.configs import ExportConfig
from tasks.evaluate import load_report
from tasks.recipe import ReleaseConfig, load_release

DEFAULT_STORE = "file://./artifacts"


def base_stage(cfg: ReleaseConfig, stages: Stages) -> Any:
    """Import `base.url`, or pretrain a base on the base corpus (the demo default)."""
    if cfg.base.url is not None:
        # The listing (names, sizes, etags/mtimes) joins the fingerprint: a changed checkpoint re-imports.
        return stages.run("base", "base", cfg.base, {}, salt={"listing": storage.listing_signature(cfg.base.url)})
    corpus = stages.run("data_prep[base]", "data_prep", cfg.base.data, {})
    return stages.run("base", "base", cfg.base, {"data": corpus})


def publish_report(cfg: ReleaseConfig, evaluation: ArtifactRef) -> dict[str, Any]:
    """The eval report as a markdown artifact and the headline metrics as a table, in the UI."""
    report = load_report(lambda name: storage.read_bytes(evaluation.file(name)))
    md = storage.read_bytes(evaluation.file("report.md")).decode()
    key = cfg.name.lower().replace("_", "-")
    create_markdown_artifact(md, key=f"{key}-eval", description=f"{cfg.name}: evaluation report")
    rows = [{"metric": f"perplexity/{k}", "value": round(v, 4)} for k, v in report["perplexity"].items()]
    if "preference" in report:  # preference data: held-out pairs, fine-tuned vs base
        p = report["preference"]
        rows += [{"metric": f"preference/{k}", "value": round(p[k], 4)} for k in ("reward_accuracy", "reward_margin")]
        rows += [{"metric": f"preference/{m}/chosen_preferred_per_token",
                  "value": round(p[m]["preference_accuracy_normalized"], 4)} for m in ("base", "finetuned")]
    if "distill" in report:  # teacher vs distilled student vs the same student after plain SFT
        for m, r in report["distill"]["models"].items():
            rows += [{"metric": f"distill/{m}/{k}", "value": round(r[k], 4)}
                     for k in ("data_loss", "teacher_kl", "top1_agreement", "accuracy_t0") if k in r]
    if "rl" in report:  # GRPO: held-out pass@1 at the start of RL (after SFT) and after it
        rl = report["rl"]
        rows += [{"metric": f"rl/{rl['checker']}/{when}/pass@1 T={k[len('accuracy_t'):]}", "value": round(v, 4)}
                 for when in ("accuracy_before", "accuracy_after") for k, v in rl[when].items()]
    for name, t in report.get("tasks", {}).items():  # pass@1 per model and temperature, and the ceiling
        rows += [{"metric": f"task/{name}/{m}/pass@1 T={k[1:]}", "value": round(v, 4)}
                 for m, acc in t["accuracy"].items() for k, v in acc.items()]
        rows.append({"metric": f"task/{name}/reference ({t['split']}, {t['prompts']} prompts)",
                     "value": round(t["reference"], 4)})
    for scheme, q in report["quantization"].items():  # numbers rounded; labels (its KV cache) as they are
        rows += [{"metric": f"{scheme}/{k}", "value": v if isinstance(v, str) else round(v, 5)}
                 for k, v in q.items() if v is not None]
    drafts = {f"draft[{n}]": r for n, r in report.get("drafts", {}).items()}  # every candidate the stage trained
    for name, entry in {**drafts, "mtp": report.get("mtp", {})}.items():  # + a DeepSeek/GLM target's own MTP head
        for run, r in entry.get("runs", {}).items():
            rows += [{"metric": f"{name}/{run}/{k}", "value": round(r[k], 4)}
                     for k in ("acceptance_length", "speedup")]
    if "draft" in report:
        rows.append({"metric": "draft shipped", "value": report["draft"].get("name", "?")})
    rows += [{"metric": f"gate: {g['gate']}", "value": "pass" if g["passed"] else "FAIL"} for g in report["gates"]]
    create_table_artifact(rows, key=f"{key}-metrics", description=f"{cfg.name}: release metrics")
    return report


def publish_curves(cfg: ReleaseConfig, finetuned: ArtifactRef) -> None:
    """The fine-tune's curves (finetune/curves.png: loss, DPO rewards, GRPO reward / KL / held-out accuracy) as
    an image artifact in the UI. The PNG travels inside the artifact as a data URL (a few tens of kB), so the
    UI shows it without reaching the store."""
    url = finetuned.file("curves.png")
    if not storage.exists(url):  # an artifact from before curves were written
        return
    png = base64.b64encode(storage.read_bytes(url)).decode("ascii")
    key = cfg.name.lower().replace("_", "-")
    try:  # a picture for people: never the reason a release fails
        create_image_artifact(f"data:image/png;base64,{png}", key=f"{key}-curves",
                              description=f"{cfg.name}: fine-tuning curves ({cfg.finetune.method}, "
                                          f"{cfg.finetune.mode})")
    except Exception as e:  # noqa: BLE001
        get_run_logger().warning("release %s: the curves artifact was not created: %s", cfg.name, e)


@flow(name="release", log_prints=True, on_failure=[cancel_stage_runs], on_crashed=[cancel_stage_runs],
      on_cancellation=[cancel_stage_runs])
def release(recipe: str = "tiny", overrides: list[str] | None = None, store: str = DEFAULT_STORE,
            allow_weaker_gates: bool = False) -> str:
    """Run the whole release; returns the bundle URL."""
    log = get_run_logger()
    cfg = load_release(recipe, overrides or [], allow_weaker_gates=allow_weaker_gates)
    store = storage.normalize_url(store)
    artifacts = Store(store)
    stages = Stages(store, cfg.execution, cfg.resources)
    base = base_stage(cfg, stages)
    data = stages.run("data_prep", "data_prep", cfg.data, {"tokenizer": base})
    inputs = {"base": base, "data": data}
    if cfg.finetune.method == "distill":  # the teacher (the base) answers the prompts, with its top-k logits
        inputs["traces"] = stages.run("traces[teacher]", "traces", cfg.finetune.distill.traces,
                                      {"model": base, "data": data})
    finetuned = stages.run("finetune", "finetune", cfg.finetune, inputs)
    publish_curves(cfg, stages.result(finetuned))
    quantized = stages.run("quantize", "quantize", cfg.quantize, {"model": finetuned, "data": data})
    served = cfg.served_model(finetuned, quantized)  # the draft learns the model that will actually serve
    traces = stages.run("traces", "traces", cfg.served("traces"), {"model": served, "data": data})
    draft = stages.run("draft", "draft", cfg.served("draft"), {"target": served, "traces": traces})
    evaluation = stages.run("evaluate", "evaluate", cfg.served("evaluate"),
                            {"base": base, "finetune": finetuned, "data": data, "draft": draft, "quant": quantized})
    report = publish_report(cfg, stages.result(evaluation))
    export_cfg = ExportConfig(name=cfg.name, recipe=cfg.recorded())
    bundle = stages.result(stages.run(
        "export", "export", export_cfg, {"base": base, "data": data, "finetune": finetuned, "traces": traces,
                                         "draft": draft, "quant": quantized, "evaluate": evaluation}))
    if report["passed_as_declared"]:
        artifacts.write_pointer(f"releases/{cfg.name}", bundle)
    else:
        waived = ", ".join(f"{w['gate']} {w['from']} -> {w['to']}" for w in report["waivers"]
                           if w["source"] == "--set")
        log.warning("release %s: exported under waivers (%s) but the declared gates fail; pointers/releases/%s "
                    "was not moved", cfg.name, waived, cfg.name)
    log.info("release %s: bundle at %s", cfg.name, bundle.url)
    return bundle.url
