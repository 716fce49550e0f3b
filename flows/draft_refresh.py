"""The `draft-refresh` flow (scheduled): fresh prompts -> target traces -> retrained draft -> eval ->
promote by one pointer write, only if the candidate decodes losslessly and its acceptance length is at
least `refresh.min_acceptance_ratio` (as the recipe declares it; a command-line waiver never promotes)
times the current draft's.

The current draft is `pointers/drafts/<name>.json` when a refresh was promoted before, otherwise the
draft of the release `pointers/releases/<name>.json` points at. The candidate warm-starts from the
current draft and trains on the target's answers to prompts the current draft never saw; both are
evaluated in the same run, on the same held-out prompts, against the same target.
"""

from __future__ import annotations

import json

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

import storage
from flows.execution import cancel_stage_runs
from flows.release import DEFAULT_STORE
from flows.stages import Stages
from storage import ArtifactRef, Store
from tasks.configs import DraftCandidate, EvalConfig, Gates
from tasks.evaluate import load_report
from tasks.recipe import load_release


def _release_refs(artifacts: Store, name: str) -> dict[str, ArtifactRef]:
    bundle = artifacts.read_pointer(f"releases/{name}")
    if bundle is None:
        raise ValueError(f"draft-refresh: no release named {name!r} in {artifacts.root} "
                         f"(run `forgeline release` first)")
    lineage = json.loads(storage.read_bytes(bundle.file("lineage.json")))
    # keys, checked to stay inside the store: a bundle's lineage cannot send the refresh elsewhere
    return {k: artifacts.load(artifacts.url(v["key"])) for k, v in lineage["stages"].items()}


def _shipped_candidate(artifacts: Store, current: ArtifactRef, refs: dict[str, ArtifactRef]
                       ) -> tuple[str, DraftCandidate]:
    """The name and training config of the draft the release (or the last promoted refresh) ships: the one
    candidate of a refresh's draft artifact, else the candidate the release's evaluation chose."""
    listing = json.loads(storage.read_bytes(current.file("draft/drafts.json")))["candidates"]
    if len(listing) == 1:
        name = listing[0]
    else:
        report = load_report(lambda n: storage.read_bytes(refs["evaluate"].file(n)))
        name = report["draft"]["name"]
    meta = json.loads(storage.read_bytes(current.file(f"draft/{name}/draft_config.json")))
    return name, DraftCandidate(**meta["candidate"])


@flow(name="draft-refresh", log_prints=True, on_failure=[cancel_stage_runs], on_crashed=[cancel_stage_runs],
      on_cancellation=[cancel_stage_runs])
def draft_refresh(recipe: str = "tiny", overrides: list[str] | None = None, store: str = DEFAULT_STORE,
                  allow_weaker_gates: bool = False) -> dict:
    """Returns {"promoted": bool, "current": acceptance, "candidate": acceptance, "draft": url}."""
    log = get_run_logger()
    cfg = load_release(recipe, overrides or [], allow_weaker_gates=allow_weaker_gates)
    store = storage.normalize_url(store)
    artifacts = Store(store)
    refs = _release_refs(artifacts, cfg.name)
    finetuned = refs["finetune"]
    served = cfg.served_model(finetuned, refs.get("quant"))  # what the release serves
    current = artifacts.read_pointer(f"drafts/{cfg.name}") or refs["draft"]
    name, shipped = _shipped_candidate(artifacts, current, refs)
    refresh = cfg.refresh
    stages = Stages(store, cfg.execution, cfg.resources)
    data = stages.run("data_prep[fresh]", "data_prep", refresh.data, {"tokenizer": finetuned})
    traces = stages.run("traces[fresh]", "traces", refresh.traces.model_copy(update={"target": cfg.serve}),
                        {"model": served, "data": data})
    # the candidate is the shipped draft's kind and objective, warm-started from it (the release's other
    # candidates are not retrained: promotion compares the same drafter before and after fresh data)
    candidate = stages.run("draft[candidate]", "draft",
                           refresh.draft.model_copy(update={"target": cfg.serve, "candidates": [shipped]}),
                           {"target": served, "traces": traces, "init": current})
    # Draft-only evaluation at temperature 0 (the promotion criterion), against the served model, on the
    # fresh data's held-out prompts; no base. Its one gate is losslessness; promotion compares the two
    # drafts' acceptance below (the release's quality gates judged the served model already).
    eval_cfg = EvalConfig(**{**cfg.evaluate.model_dump(), "spec_target": cfg.serve, "spec_temperatures": [0.0],
                           "serve_temperature": 0.0, "spec_tree": False, "declared_gates": None, "waivers": (),
                           "drafts": [name],
                           "gates": Gates(finetune_improves=False, min_acceptance_length=0.0,
                                          max_quant_ppl_increase=1e9, max_quant_kl_p99=1e9,
                                          max_quant_flip_rate=1e9)})
    eval_inputs = {"finetune": finetuned, "data": data} | ({"quant": refs["quant"]} if cfg.serve != "finetuned" else {})
    evals = {name: stages.run(f"evaluate[{name}]", "evaluate", eval_cfg, eval_inputs | {"draft": d})
             for name, d in (("current", current), ("candidate", candidate))}
    evals = {name: stages.result(e) for name, e in evals.items()}
    candidate = stages.result(candidate)
    reports = {k: load_report(lambda name, v=v: storage.read_bytes(v.file(name))) for k, v in evals.items()}
    acceptance = {k: rep["draft"]["acceptance_length"] for k, rep in reports.items()}
    lossless = reports["candidate"]["draft"]["lossless"]
    promote = lossless and candidate != current \
        and acceptance["candidate"] >= cfg.refresh_ratio_declared() * acceptance["current"]
    if promote:
        artifacts.write_pointer(f"drafts/{cfg.name}", candidate, acceptance_length=acceptance["candidate"])
    verdict = "promoted" if promote else "kept the current draft"
    create_markdown_artifact(
        f"# Draft refresh: {verdict}\n\n| draft | acceptance length | speedup |\n|---|---|---|\n"
        + "".join(f"| {k} | {acceptance[k]:.3f} | {reports[k]['draft']['speedup']:.2f}x |\n" for k in acceptance),
        key=f"{cfg.name.lower()}-draft-refresh", description="draft refresh verdict")
    log.info("draft refresh: current %.3f, candidate %.3f -> %s", acceptance["current"], acceptance["candidate"],
             verdict)
    return {"promoted": promote, "current": acceptance["current"], "candidate": acceptance["candidate"],
            "draft": (candidate if promote else current).url}
