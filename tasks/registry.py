"""Every stage by name: one record each, naming its module, its config schema, its inputs and whether it
trains (the flows dispatch on these records; docs/architecture.md). What a stage runs on is the recipe's
`resources.<stage>` (tasks/configs.py: ResourcesConfig).

Importing this module imports no stage (and no JAX): a stage's module is imported when it first runs.
`run_stage(store, kind, config, inputs)` runs a registered stage by name, inside the commit protocol of
tasks/stage.py: skipped when its fingerprint is committed, computed once across processes otherwise.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from pydantic import BaseModel

from storage import ArtifactRef, Store
from tasks.configs import (
    BaseModelConfig,
    DataPrepConfig,
    DraftConfig,
    EvalConfig,
    ExportConfig,
    FinetuneConfig,
    QuantizeConfig,
    TracesConfig,
)
from tasks.recipe import validate
from tasks.stage import Progress, StageContext, fingerprint_of, run_once


@dataclass(frozen=True)
class Stage:
    """A stage: `tasks/<module>.py` exposes `run(config, inputs, output, *, progress, context)`."""

    name: str  # the stage kind: the store folder `<store>/<name>/<fingerprint>/`
    module: str
    config: type[BaseModel]
    inputs: tuple[str, ...]  # required input artifacts, by the name `run` receives them under
    optional: tuple[str, ...] = ()
    trains: bool = False  # shows training progress; resumes from checkpoints

    def load(self) -> ModuleType:
        return importlib.import_module(f"tasks.{self.module}")

    def parse(self, config: BaseModel | Mapping[str, Any]) -> BaseModel:
        """The typed config: validated once (a dict from a Prefect parameter), or passed through. Mappings
        are read in sorted key order, so a config that travelled through a server that reorders keys (a
        Prefect parameter stored as PostgreSQL JSONB) is the same object, and writes the same files
        (export's lineage.json), as the one that never left the process."""
        if isinstance(config, self.config):
            return config
        data = config.model_dump(mode="json") if isinstance(config, BaseModel) else dict(config)
        return validate(self.config, _sorted(data), self.name)

    def check_inputs(self, inputs: Mapping[str, Any]) -> None:
        missing = [n for n in self.inputs if n not in inputs]
        unknown = [n for n in inputs if n not in self.inputs + self.optional]
        if missing or unknown:
            raise ValueError(f"stage {self.name}: inputs {sorted(inputs)} (missing {missing}, unknown {unknown}; "
                             f"takes {list(self.inputs)} and optionally {list(self.optional)})")


def _sorted(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _sorted(value[k]) for k in sorted(value)}
    if isinstance(value, list | tuple):
        return [_sorted(v) for v in value]
    return value


STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("data_prep", "data_prep", DataPrepConfig, (), optional=("tokenizer",)),
    Stage("base", "base_model", BaseModelConfig, (), optional=("data",), trains=True),
    Stage("finetune", "finetune", FinetuneConfig, ("base", "data"), optional=("traces",), trains=True),
    Stage("quantize", "quantize", QuantizeConfig, ("model", "data")),
    Stage("traces", "traces", TracesConfig, ("model", "data")),
    Stage("draft", "draft", DraftConfig, ("target", "traces"), optional=("init",), trains=True),
    Stage("evaluate", "evaluate", EvalConfig, ("finetune", "data"), optional=("base", "draft", "quant")),
    Stage("export", "export", ExportConfig, ("base", "data", "finetune", "traces", "draft", "quant", "evaluate")),
)}


def stage(kind: str) -> Stage:
    if kind not in STAGES:
        raise ValueError(f"unknown stage {kind!r} (known: {', '.join(STAGES)})")
    return STAGES[kind]


def fingerprint(kind: str, config: BaseModel | Mapping[str, Any], inputs: Mapping[str, ArtifactRef],
                salt: Mapping[str, Any] | None = None) -> str:
    """A registered stage's address: its kind, validated config (+ `salt`, e.g. the listing of an external
    input), input digests, and the version of the code it runs (tasks/code.py)."""
    spec = stage(kind)
    return fingerprint_of(kind, _recorded(spec.parse(config), salt), inputs, f"tasks.{spec.module}")


def _recorded(cfg: BaseModel, salt: Mapping[str, Any] | None) -> dict[str, Any]:
    """What is fingerprinted and recorded in the manifest: the config, plus `salt` when given."""
    return {**cfg.model_dump(mode="json"), **({"_salt": dict(salt)} if salt else {})}


# How a stage's compute runs once the commit protocol has its lease and its inputs on local disk: in this
# process (`in_process`), or as N processes of one JAX job (flows/gang.py), which write into `ctx.out_dir` too.
Runner = Callable[[Stage, BaseModel, StageContext, Progress | None], dict[str, Any]]


def in_process(spec: Stage, cfg: BaseModel, ctx: StageContext, progress: Progress | None) -> dict[str, Any]:
    return spec.load().run(cfg, ctx.inputs, ctx.out_dir, progress=progress, context=ctx)


def run_stage(store: Store, kind: str, config: BaseModel | Mapping[str, Any], inputs: Mapping[str, ArtifactRef], *,
              salt: Mapping[str, Any] | None = None, progress: Progress | None = None, force: bool = False,
              on_compute: Callable[[], None] | None = None, runner: Runner = in_process) -> ArtifactRef:
    """Run one registered stage (skipped when its fingerprint is already committed; `on_compute` is called
    when this process, rather than another one holding the stage's lease, computes it). `runner` decides
    where the compute happens; it is not part of the fingerprint."""
    spec = stage(kind)
    spec.check_inputs(inputs)
    cfg = spec.parse(config)
    inputs = {name: inputs[name] for name in sorted(inputs)}  # the same order however they travelled (see parse)

    def work(ctx: StageContext) -> dict[str, Any]:
        return runner(spec, cfg, ctx, progress)

    return run_once(store, kind, _recorded(cfg, salt), inputs, work, code=f"tasks.{spec.module}", force=force,
                    on_compute=on_compute)
