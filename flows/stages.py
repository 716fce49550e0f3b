"""Prefect tasks around forgeline's stages: one generic task whose cache key is the stage fingerprint.

- cache key = the fingerprint, i.e. the stage's storage address (docs/orchestration.md, cache keys), joined
  with the committed artifact's URL and manifest digest, and only while that manifest exists: if the
  artifact was deleted the key changes and the stage runs again, and a record written for another
  store never answers for this one (the manifest, not Prefect's cache record, is the source of truth);
- results are the artifact references, serialised as JSON (no pickle), never arrays;
- retries with exponential backoff, for storage and network outages only (`transient`) -- a bad config,
  a corrupt input (IntegrityError) or a failed gate fails at once, and is never recomputed over;
- training stages publish a progress artifact to the UI;
- where the stage computes follows the recipe's `execution` and `resources.<stage>` (flows/execution.py):
  in the task's process, as a gang of JAX processes, or as a flow run of `stage_flow` on a worker.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prefect import flow, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.context import TaskRunContext
from prefect.tasks import exponential_backoff

from flows import execution as ex
from storage import ArtifactError, ArtifactRef, Store
from tasks import registry
from tasks.configs import ExecutionConfig, StageResources

log = logging.getLogger("forgeline.flows")


@dataclass
class StageEvent:
    name: str
    kind: str
    ref: ArtifactRef
    ran: bool
    seconds: float


# Listeners (the CLI's live table) hear about every finished stage in this process.
LISTENERS: list[Callable[[StageEvent], None]] = []


def cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    """`<kind>-<fingerprint>-<hash of (artifact URL, manifest digest)>` while the artifact is committed.

    The fingerprint alone is not enough: the same stage committed to another store, or deleted and
    committed again here (a new manifest digest), must not be answered with the old reference.
    """
    kind, refs = parameters["kind"], {k: ArtifactRef.from_dict(v) for k, v in parameters["inputs"].items()}
    fp = registry.fingerprint(kind, parameters["config"], refs, parameters.get("salt"))
    ref = Store(parameters["store"]).lookup(kind, fp)
    if ref is None:
        return f"{kind}-{fp}-pending-{uuid.uuid4().hex}"  # not committed: never a cache hit
    return f"{kind}-{fp}-{hashlib.sha256(f'{ref.url}@{ref.digest}'.encode()).hexdigest()[:16]}"


def transient(e: BaseException) -> bool:
    """A network or storage outage that a retry may outlive: connection refused or reset, timeouts, an S3
    server's 5xx. Never a bad input, a failed gate or damaged bytes (ArtifactError and IntegrityError say
    the same thing however often they are asked), nor a missing or forbidden object."""
    if isinstance(e, ArtifactError | FileNotFoundError | PermissionError | IsADirectoryError | NotADirectoryError):
        return False
    if isinstance(e, ConnectionError | TimeoutError | OSError):
        return True
    # botocore's and aiohttp's connection errors are not OSErrors; match them by module, not by import
    return any(c.__module__.split(".")[0] in ("botocore", "aiohttp", "aiobotocore", "urllib3")
               and ("Connection" in c.__name__ or "Timeout" in c.__name__ or "Endpoint" in c.__name__)
               for c in type(e).__mro__)


def _retryable(task, task_run, state) -> bool:
    """Retry storage/infrastructure errors only."""
    try:
        state.result()
    except Exception as e:
        return transient(e)
    return False


def _progress_reporter(name: str) -> Callable[[int, int, dict[str, float]], None]:
    """A progress artifact in the UI, created at the first report: only for work that actually happens."""
    artifact_id: list = []
    last = [0.0]

    def report(step: int, total: int, metrics: dict[str, float]) -> None:
        if not artifact_id:
            artifact_id.append(create_progress_artifact(0.0, description=f"{name}: training progress"))
        now = time.monotonic()
        if now - last[0] > 2.0 or step == total:  # a few UI updates per second at most
            parts = [f"loss {metrics['loss']:.3f}"]
            if "learning_rate" in metrics:
                parts.append(f"lr {metrics['learning_rate']:.2e}")
            if "tokens_per_s" in metrics:
                parts.append(f"{metrics['tokens_per_s']:.0f} tok/s")
            if "mfu" in metrics:
                parts.append(f"MFU {metrics['mfu']:.1%}")
            update_progress_artifact(artifact_id[0], 100.0 * step / total,
                                     description=f"{name}: step {step}/{total} " + ", ".join(parts))
            last[0] = now

    return report


@task(
    task_run_name="{name}",
    cache_key_fn=cache_key,
    result_serializer="json",
    persist_result=True,
    cache_result_in_memory=False,
    retries=3,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    retry_jitter_factor=0.5,
    retry_condition_fn=_retryable,
)
def stage_task(name: str, kind: str, config: dict[str, Any], inputs: dict[str, dict], store: str,
               salt: dict[str, Any] | None = None, resources: dict[str, Any] | None = None,
               execution: dict[str, Any] | None = None) -> dict[str, Any]:
    """One registered stage (tasks/registry.py) in the commit protocol; returns its reference as JSON.
    The config arrives as JSON (a Prefect parameter) and is validated once, here. With `execution.mode`
    workers the stage runs as its own flow run on a worker and this task waits for its commit."""
    t0 = time.perf_counter()
    spec = registry.stage(kind)
    refs = {k: ArtifactRef.from_dict(v) for k, v in inputs.items()}
    res = StageResources.model_validate(resources or {})
    mode = ExecutionConfig.model_validate(execution or {})
    if mode.mode == "workers":
        fp = registry.fingerprint(kind, config, refs, salt)
        done = Store(store).lookup(kind, fp)
        ref = done or ex.run_on_worker(name, kind, dict(config), dict(inputs), store, salt, fp, res, mode)
        _announce(StageEvent(name, kind, ref, done is None, time.perf_counter() - t0))
        return ref.to_dict()
    computed: list[bool] = []  # set when this process computes the stage (not when it waits for another)
    ref = registry.run_stage(Store(store), kind, spec.parse(config), refs, salt=salt,
                             progress=_progress_reporter(name) if spec.trains else None,
                             on_compute=lambda: computed.append(True), runner=ex.runner_for(res))
    _announce(StageEvent(name, kind, ref, bool(computed), time.perf_counter() - t0))
    return ref.to_dict()


@contextlib.contextmanager
def routed_logs() -> Iterator[None]:
    """Send the `forgeline` loggers' lines to the current run's logs for the block. Prefect does so for the
    loggers named in PREFECT_LOGGING_EXTRA_LOGGERS when it reads its settings, at its import; in a process
    that imported Prefect before flows/ (a worker running a deployment's entrypoint), copy its handlers for
    the run, and take them off again after it (outside a run they would only warn that there is none)."""
    ours = logging.getLogger("forgeline")
    added = [h for h in logging.getLogger("prefect.extra").handlers if h not in ours.handlers]
    level = ours.level
    for handler in added:
        ours.addHandler(handler)
    if level == logging.NOTSET:
        ours.setLevel(logging.INFO)
    try:
        yield
    finally:
        for handler in added:
            ours.removeHandler(handler)
        ours.setLevel(level)


@flow(name=ex.STAGE_FLOW, flow_run_name="{name}", log_prints=True)
def stage_flow(name: str, kind: str, config: dict[str, Any], inputs: dict[str, dict], store: str,
               salt: dict[str, Any] | None = None, resources: dict[str, Any] | None = None,
               pool: str | None = None, execution: dict[str, Any] | None = None) -> dict[str, Any]:
    """One stage as its own flow run (the `stage/<kind>` deployments a workers-mode release starts): the
    commit protocol in this process, the compute here or in a gang (`resources.hosts`), holding
    `accelerators * hosts` slots of the pool's GPU limit while it computes."""
    from prefect.concurrency.sync import concurrency

    spec = registry.stage(kind)
    res = StageResources.model_validate(resources or {})
    mode = ExecutionConfig.model_validate(execution or {})
    refs = {k: ArtifactRef.from_dict(v) for k, v in inputs.items()}
    slots = res.accelerators * res.hosts
    limit = ex.gpu_limit_name(pool) if pool and slots else None
    runner = ex.runner_for(res, mode, ex.pool_type(pool) if pool and res.hosts > 1 else None)

    def compute() -> ArtifactRef:
        return registry.run_stage(Store(store), kind, spec.parse(config), refs, salt=salt,
                                  progress=_progress_reporter(name) if spec.trains else None, runner=runner)

    with routed_logs():
        if limit is None:
            return compute().to_dict()
        with concurrency(limit, occupy=slots, strict=False, lease_duration=60):  # a dead holder frees it in 60 s
            return compute().to_dict()


def _announce(event: StageEvent) -> None:
    for fn in LISTENERS:
        fn(event)


def submit(name: str, kind: str, config: Any, inputs: Mapping[str, ArtifactRef], store: str,
           salt: Mapping[str, Any] | None = None, resources: StageResources | None = None,
           execution: ExecutionConfig | None = None) -> ArtifactRef:
    """Run stage `kind` as the Prefect task named `name`; a cache hit (the task body never ran) is announced
    as skipped here."""
    t0 = time.perf_counter()
    state = stage_task(name, kind, *_arguments(config, inputs, store, salt, resources, execution), return_state=True)
    ref = ArtifactRef.from_dict(state.result())
    if state.name == "Cached":
        _announce(StageEvent(name, kind, ref, False, time.perf_counter() - t0))
    return ref


def _arguments(config: Any, inputs: Mapping[str, Any], store: str, salt: Mapping[str, Any] | None,
               resources: StageResources | None, execution: ExecutionConfig | None) -> tuple:
    cfg = config.model_dump(mode="json") if hasattr(config, "model_dump") else dict(config)
    refs = {k: v.to_dict() if isinstance(v, ArtifactRef) else v for k, v in inputs.items()}
    return (cfg, refs, store, dict(salt) if salt else None,
            resources.model_dump(mode="json") if resources is not None else None,
            execution.model_dump(mode="json") if execution is not None else None)


class Stages:
    """The release DAG's stages, run the way the recipe's `execution` says.

    `inline`: each `run` computes its stage before returning (an ArtifactRef). `workers`: each `run`
    submits its stage task at once and returns a future; a stage starts as soon as the stages it reads
    have committed, so independent branches (quantize and traces when the fine-tuned model is served)
    run at the same time on different workers. `result(x)` gives the ArtifactRef either way."""

    def __init__(self, store: str, execution: ExecutionConfig, resources: Any):
        self.store, self.execution, self.resources = store, execution, resources
        self._submitted: list[Any] = []  # workers: every future, in submission (= topological) order

    def run(self, name: str, kind: str, config: Any, inputs: Mapping[str, Any],
            salt: Mapping[str, Any] | None = None) -> Any:
        res = self.resources.of(kind)
        if self.execution.mode == "inline":
            return submit(name, kind, config, {k: self.result(v) for k, v in inputs.items()}, self.store, salt,
                          res, self.execution)
        future = stage_task.with_options(task_run_name=name).submit(
            name, kind, *_arguments(config, inputs, self.store, salt, res, self.execution))
        self._submitted.append(future)
        return future

    def result(self, handle: Any) -> ArtifactRef:
        """The artifact; for a stage that never ran because a stage upstream failed, that stage's own error."""
        if isinstance(handle, ArtifactRef):
            return handle
        handle.wait()
        if not handle.state.is_completed():
            for future in self._submitted:  # upstream first: the first failure is the cause
                future.wait()
                if future.state.is_failed() or future.state.is_crashed():
                    future.result()  # raises the stage's exception
        return ArtifactRef.from_dict(handle.result())
