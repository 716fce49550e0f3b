"""Prefect tasks around forgeline's stages: one generic task whose cache key is the stage fingerprint.

- cache key = the fingerprint, i.e. the stage's storage address (docs/orchestration.md, cache keys), joined
  with the committed artifact's URL and manifest digest, and only while that manifest exists: if the
  artifact was deleted the key changes and the stage runs again, and a record written for another
  store never answers for this one (the manifest, not Prefect's cache record, is the source of truth);
- results are the artifact references, serialised as JSON (no pickle), never arrays;
- retries with exponential backoff, for storage and network outages only (`transient`) -- a bad config,
  a corrupt input (IntegrityError) or a failed gate fails at once, and is never recomputed over;
- training stages publish a progress artifact to the UI.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prefect import task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.context import TaskRunContext
from prefect.tasks import exponential_backoff

from storage import ArtifactError, ArtifactRef, Store
from tasks import registry

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
               salt: dict[str, Any] | None = None) -> dict[str, Any]:
    """One registered stage (tasks/registry.py) in the commit protocol; returns its reference as JSON.
    The config arrives as JSON (a Prefect parameter) and is validated once, here."""
    t0 = time.perf_counter()
    spec = registry.stage(kind)
    refs = {k: ArtifactRef.from_dict(v) for k, v in inputs.items()}
    computed: list[bool] = []  # set when this process computes the stage (not when it waits for another)
    ref = registry.run_stage(Store(store), kind, spec.parse(config), refs, salt=salt,
                             progress=_progress_reporter(name) if spec.trains else None,
                             on_compute=lambda: computed.append(True))
    _announce(StageEvent(name, kind, ref, bool(computed), time.perf_counter() - t0))
    return ref.to_dict()


def _announce(event: StageEvent) -> None:
    for fn in LISTENERS:
        fn(event)


def submit(name: str, kind: str, config: Any, inputs: Mapping[str, ArtifactRef], store: str,
           salt: Mapping[str, Any] | None = None) -> ArtifactRef:
    """Run stage `kind` as the Prefect task named `name`; a cache hit (the task body never ran) is announced
    as skipped here."""
    cfg = config.model_dump(mode="json") if hasattr(config, "model_dump") else dict(config)
    t0 = time.perf_counter()
    state = stage_task(name, kind, cfg, {k: v.to_dict() for k, v in inputs.items()}, store,
                  dict(salt) if salt else None, return_state=True)
    ref = ArtifactRef.from_dict(state.result())
    if state.name == "Cached":
        _announce(StageEvent(name, kind, ref, False, time.perf_counter() - t0))
    return ref

