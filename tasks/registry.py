"""Every stage by name, run: the records are declared once in tasks/configs.py (`STAGES`: module, config
schema, inputs, default resources, release section); this module runs them (the flows dispatch on these
records; docs/architecture.md). What a stage runs on is the recipe's `resources.<stage>`.

Importing this module imports no stage (and no JAX): a stage's module is imported when it first runs.
`run_stage(store, kind, config, inputs)` runs a registered stage by name, inside the commit protocol of
tasks/stage.py: skipped when its fingerprint is committed, computed once across processes otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel

from storage import ArtifactRef, Store
from tasks.configs import STAGES, Stage
from tasks.stage import Progress, StageContext, fingerprint_of, run_once


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
