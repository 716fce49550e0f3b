"""Every stage by name: its config schema and its compute factory (`cfg, progress -> compute(ctx)`).

The flows look stages up here, so a Prefect task needs nothing but a stage name, a config dict and
input references; `run(...)` is the same thing without Prefect (a GPU node runs it directly).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel

from storage import ArtifactRef, Store
from tasks import base_model, data_prep, draft, evaluate, export, finetune, quantize, traces
from tasks.layout import model_dir
from tasks.stage import Compute, StageContext, run_stage, stage_fingerprint
from tasks.training.loop import Progress


def _data_prep(cfg: data_prep.DataPrepConfig, progress: Progress | None = None) -> Compute:
    """Input `tokenizer` (optional): a checkpoint artifact whose tokenizer.json the data must use."""

    def _compute(ctx: StageContext) -> dict[str, Any]:
        tok = ctx.inputs.get("tokenizer")
        tok_json = model_dir(tok) / "tokenizer.json" if tok is not None else None
        return data_prep.run_local(cfg, ctx.out_dir, tokenizer_json=tok_json)

    return _compute


STAGES: dict[str, tuple[type[BaseModel], Callable[..., Compute]]] = {
    "data_prep": (data_prep.DataPrepConfig, _data_prep),
    "base": (base_model.BaseModelConfig, base_model.compute),
    "finetune": (finetune.FinetuneConfig, finetune.compute),
    "traces": (traces.TracesConfig, lambda cfg, progress=None: traces.compute(cfg)),
    "draft": (draft.DraftConfig, lambda cfg, progress=None: draft.compute(
        cfg, progress, init_input="init")),
    "quantize": (quantize.QuantizeConfig, lambda cfg, progress=None: quantize.compute(cfg)),
    "evaluate": (evaluate.EvalConfig, lambda cfg, progress=None: evaluate.compute(cfg)),
    "export": (export.ExportConfig, lambda cfg, progress=None: export.compute(cfg)),
}


def parse_config(kind: str, config: Mapping[str, Any]) -> BaseModel:
    from tasks.recipe import validate

    if kind not in STAGES:
        raise ValueError(f"unknown stage {kind!r} (known: {', '.join(STAGES)})")
    return validate(STAGES[kind][0], dict(config), kind)


def _fp_config(cfg: BaseModel, salt: Mapping[str, Any] | None) -> dict[str, Any]:
    """What is fingerprinted and recorded: the validated config, plus `salt` (e.g. the listing of an
    external input) when given."""
    return {**cfg.model_dump(mode="json"), **({"_salt": dict(salt)} if salt else {})}


def fingerprint(kind: str, config: Mapping[str, Any], inputs: Mapping[str, ArtifactRef],
                salt: Mapping[str, Any] | None = None) -> str:
    return stage_fingerprint(kind, _fp_config(parse_config(kind, config), salt), inputs)


def run(store: Store, kind: str, config: Mapping[str, Any], inputs: Mapping[str, ArtifactRef], *,
        salt: Mapping[str, Any] | None = None, progress: Progress | None = None, force: bool = False,
        on_compute: Callable[[], None] | None = None) -> ArtifactRef:
    """Run one stage by name (skipped when its fingerprint is already committed; `on_compute` is called
    when this process, rather than another one holding the stage's lease, computes it)."""
    cfg = parse_config(kind, config)
    return run_stage(store, kind, _fp_config(cfg, salt), inputs, STAGES[kind][1](cfg, progress), force=force,
                     on_compute=on_compute)
