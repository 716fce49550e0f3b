"""Where a stage runs: in the flow's process, as a gang of JAX processes, or as its own flow run on a worker.

- `inline` (the default): every stage runs inside the release flow's process, one after the other.
- `workers`: the release flow only orchestrates. Each stage is a flow run of the `stage/<kind>` deployment
  (flows/stages.py: `stage_flow`) on the work pool its `resources.<stage>` names, started with
  `run_deployment` (a child run of the release in the UI) under an idempotency key derived from the stage's
  fingerprint, so a retried orchestrator finds the run it started before instead of starting another.
  The stage's resources become the pool's job variables (`job_variables`). A run that ends Crashed (its
  worker or node died) is started again, `execution.crash_retries` times; it resumes from the stage's
  checkpoints. The artifact itself is read back from the store, never from Prefect's result storage: the
  manifest is the one source of truth in both modes, so a stage committed by one mode is reused by the other.
- `hosts: N > 1` (either mode): the stage's compute runs as one gang of N JAX processes (`tasks/member.py`)
  while the process that holds the stage's lease commits what process 0 wrote: N processes on this machine
  (flows/gang.py), or, when the stage's flow run is on a Kubernetes pool, a JobSet of N pods (flows/jobset.py).

GPU slots: a GPU stage holds `accelerators * hosts` slots of the Prefect global concurrency limit
`gpu-<pool>` while it computes (created by `forgeline deploy --gpu-slots N` or `forgeline stack up`), so a
pool whose workers share N GPUs never runs stages needing more than N at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from flows.gang import run_gang
from storage import ArtifactRef, Store
from tasks.configs import ExecutionConfig, StageResources
from tasks.registry import Runner, Stage, in_process
from tasks.stage import Progress, StageContext, work_root

log = logging.getLogger("forgeline.flows")

STAGE_FLOW = "stage"  # the flow name of flows/stages.py:stage_flow; deployments are `stage/<kind>`


class StageRunFailed(RuntimeError):
    """A stage's flow run on a worker ended without committing its artifact."""


def gpu_limit_name(pool: str) -> str:
    return f"gpu-{pool}"


def deployment_name(kind: str) -> str:
    return f"{STAGE_FLOW}/{kind}"


# -- resources -> a pool's job variables --------------------------------------------------------------

def job_variables(resources: StageResources, pool_type: str, execution: ExecutionConfig | None = None
                  ) -> dict[str, Any]:
    """The recipe's resource hints as the job variables of a pool of type `pool_type`.

    Kubernetes pools (infra/work-pools/kubernetes-gpu.json): `gpu_count` (the container's nvidia.com/gpu),
    `memory`, `cpu`, `node_selector`, `tolerations`, `image`, each only when the recipe sets it, so the
    pool's defaults apply otherwise. A process pool runs on the worker's own machine: nothing to map.
    A multi-host stage's flow run on Kubernetes is a launcher pod with no GPU; its gang is a JobSet rendered
    from the same hints (flows/jobset.py)."""
    if pool_type != "kubernetes":
        return {}
    if resources.hosts > 1:  # the flow run only launches and watches the gang's JobSet (flows/jobset.py)
        account = (execution or ExecutionConfig()).kubernetes.launcher_service_account
        return {"gpu_count": 0, **({"image": resources.image} if resources.image else {}),
                **({"service_account_name": account} if account else {})}
    out: dict[str, Any] = {"gpu_count": resources.accelerators}
    if resources.memory_gib is not None:
        out["memory"] = f"{resources.memory_gib}Gi"
    if resources.cpus is not None:
        out["cpu"] = str(resources.cpus)
    if resources.node_selector:
        out["node_selector"] = dict(resources.node_selector)
    if resources.tolerations:
        out["tolerations"] = [dict(t) for t in resources.tolerations]
    if resources.image:
        out["image"] = resources.image
    return out


def pool_type(pool: str) -> str:
    """The type of work pool `pool` ("process", "kubernetes", ...) on the configured Prefect server."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_work_pool(pool).type


# -- a gang of JAX processes for one stage's compute ---------------------------------------------------

def gang_runner(hosts: int, *, per_process_env: list[dict[str, str]] | None = None,
                timeout: float | None = None) -> Runner:
    """A `Runner` (tasks/registry.py) that computes the stage as `hosts` processes of one JAX job on this
    machine; their lines go to the `forgeline.gang` log tagged `[p<i>]`, process 0's training progress to
    the stage's `progress`."""
    from tasks.member import line_router

    def run(spec: Stage, cfg: BaseModel, ctx: StageContext, progress: Progress | None) -> dict[str, Any]:
        tmp = Path(tempfile.mkdtemp(prefix=f"{spec.name}-gang-", dir=work_root()))
        member = {"kind": spec.name, "config": cfg.model_dump(mode="json"), "fingerprint": ctx.fingerprint,
                  "store": ctx.store.root, "inputs": {k: str(v) for k, v in ctx.inputs.items()},
                  "refs": {k: r.to_dict() for k, r in ctx.refs.items()}, "out": str(ctx.out_dir),
                  "stats": str(tmp / "stats.json")}
        (tmp / "member.json").write_text(json.dumps(member))
        on_line = line_router(progress, logging.getLogger("forgeline.gang"))
        try:
            run_gang([sys.executable, "-m", "tasks.member", str(tmp / "member.json")], hosts, on_line=on_line,
                     per_process_env=per_process_env, timeout=timeout)
            return json.loads((tmp / "stats.json").read_text())
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    return run


def runner_for(resources: StageResources, execution: ExecutionConfig | None = None,
               pool_type: str | None = None) -> Runner:
    """Where the stage computes: in this process (one host), a JobSet (several hosts, a Kubernetes pool), or
    a gang of processes on this machine (several hosts anywhere else)."""
    if resources.hosts == 1:
        return in_process
    if pool_type == "kubernetes":
        from flows.jobset import jobset_runner

        execution = execution or ExecutionConfig()
        return jobset_runner(resources, execution.kubernetes, execution.stage_timeout_s)
    return gang_runner(resources.hosts)


# -- workers: one flow run per stage -----------------------------------------------------------------

def check_workers(execution: ExecutionConfig, resources: Any, kinds: list[str]) -> None:
    """Before a workers-mode run: a Prefect server is configured and answers, and every stage the run needs
    has its deployment on the pool its resources name. Raises StageRunFailed naming what is missing."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise StageRunFailed("execution: workers needs a Prefect server with workers: set PREFECT_API_URL "
                             "(`forgeline stack up` starts one on this machine)")
    with get_client(sync_client=True) as client:
        try:
            client.api_healthcheck()
            client.read_work_pools()
        except Exception as e:
            raise StageRunFailed(f"execution: workers: the Prefect server at {url} does not answer "
                                 f"({type(e).__name__})") from None
        for kind in kinds:
            pool = execution.pool(resources.of(kind))
            try:
                deployment = client.read_deployment_by_name(deployment_name(kind))
            except ObjectNotFound:
                raise StageRunFailed(f"execution: workers: no deployment {deployment_name(kind)} on {url} "
                                     f"(`forgeline deploy` registers them)") from None
            if deployment.work_pool_name != pool:
                raise StageRunFailed(f"resources.{kind}.pool: the deployment {deployment_name(kind)} runs on pool "
                                     f"{deployment.work_pool_name!r}, the recipe asks for {pool!r} (`forgeline "
                                     f"deploy --recipe ...` registers the stage deployments on the recipe's pools)")
            res = resources.of(kind)
            if res.hosts > 1 and client.read_work_pool(pool).type == "kubernetes":
                from flows.jobset import render
                from tasks.registry import stage

                try:  # what the launcher will render, now rather than after the stages before it
                    render("preflight", kind, "0" * 64, "s3://preflight/member.json", res, execution.kubernetes,
                           timeout_s=execution.stage_timeout_s, trains=stage(kind).trains)
                except ValueError as e:
                    raise StageRunFailed(str(e)) from None


def idempotency_key(kind: str, fingerprint: str, store: str, attempt: int) -> str:
    """The same stage for the same store gets the same key: a retried orchestrator re-attaches to the run
    it started. `attempt` > 0 after a crashed run, whose key is spent."""
    where = hashlib.sha256(store.encode()).hexdigest()[:12]
    return f"forgeline-{kind}-{fingerprint}-{where}-{attempt}"


def _wait(run: Any, timeout: float, poll: float = 2.0, patience: float = 300.0) -> Any:
    """Poll the flow run until it is final or `timeout` passes; the API failing for less than `patience`
    seconds in a row (a server restart, a database failover) is waited out. Interrupted (Ctrl-C, SIGTERM, the
    orchestrator cancelled), it cancels the stage's run before unwinding: Prefect does not cascade
    cancellation to runs started with run_deployment (PrefectHQ/prefect#12713), and the worker stops a
    cancelled run's process. (When the orchestrator fails instead, its flow hook `cancel_stage_runs` does.)"""
    import time

    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    deadline, failing_since = time.monotonic() + timeout, None
    try:
        with get_client(sync_client=True) as client:
            while True:
                try:
                    run, failing_since = client.read_flow_run(run.id), None
                except Exception as e:
                    failing_since = failing_since or time.monotonic()
                    if time.monotonic() - failing_since > patience:
                        raise
                    log.warning("%s: cannot read its flow run (%s); retrying", run.name, type(e).__name__)
                if run.state is not None and run.state.is_final() or time.monotonic() > deadline:
                    return run
                time.sleep(poll)
    except BaseException as e:
        if isinstance(e, Exception):
            raise
        try:
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(run.id, Cancelling(message="the release that started it was stopped"))
            log.warning("%s: cancelled its flow run %s", run.name, run.id)
        except Exception as e2:  # the server is gone too: the zombie automation will mark it
            log.warning("%s: could not cancel flow run %s (%s)", run.name, run.id, type(e2).__name__)
        raise


def cancel_stage_runs(flow: Any, flow_run: Any, state: Any) -> None:
    """A flow hook (release, draft refresh): when the orchestrating run fails, crashes or is cancelled, cancel
    the stage runs it started that are still going, so that no GPU keeps working for a release that is gone."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.states import Cancelling

    with get_client(sync_client=True) as client:
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[flow_run.id])), limit=200)
        for child in children:
            if child.state is not None and not child.state.is_final() and not child.state.is_cancelling():
                client.set_flow_run_state(child.id, Cancelling(message=f"{flow_run.name} ended {state.name}"))
                log.warning("cancelled stage run %s (%s ended %s)", child.name, flow_run.name, state.name)


def run_on_worker(name: str, kind: str, config: dict[str, Any], inputs: dict[str, dict], store: str,
                  salt: dict[str, Any] | None, fingerprint: str, resources: StageResources,
                  execution: ExecutionConfig) -> ArtifactRef:
    """Start stage `kind` as a flow run of its deployment and wait for it; the committed artifact."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    pool = execution.pool(resources)
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(deployment_name(kind))
        if deployment.work_pool_name != pool:
            raise StageRunFailed(f"resources.{kind}.pool: the deployment {deployment_name(kind)} runs on pool "
                                 f"{deployment.work_pool_name!r}, the recipe asks for {pool!r} (run `forgeline "
                                 f"deploy --recipe ...` to register the stage deployments on the recipe's pools)")
        pool_type = client.read_work_pool(pool).type
    params = {"name": name, "kind": kind, "config": config, "inputs": inputs, "store": store, "salt": salt,
              "resources": resources.model_dump(mode="json"), "pool": pool,
              "execution": execution.model_dump(mode="json")}
    artifacts = Store(store)
    for attempt in range(execution.crash_retries + 1):
        run = run_deployment(deployment_name(kind), parameters=params, flow_run_name=name,
                             job_variables=job_variables(resources, pool_type, execution),
                             tags=["forgeline", f"stage:{kind}"],
                             idempotency_key=idempotency_key(kind, fingerprint, store, attempt), timeout=0)
        run = _wait(run, execution.stage_timeout_s)
        state = run.state
        if state is not None and state.is_completed():
            ref = artifacts.lookup(kind, fingerprint)
            if ref is not None:
                log.info("%s: committed by flow run %s on %s", name, run.name, pool)
                return ref
            log.warning("%s: flow run %s completed but %s/%s is not committed (deleted since?); running it again",
                        name, run.name, kind, fingerprint)
            continue
        if state is not None and state.is_crashed() and attempt < execution.crash_retries:
            log.warning("%s: flow run %s crashed (%s); starting it again (attempt %d of %d), it resumes from its "
                        "checkpoints", name, run.name, state.message, attempt + 2, execution.crash_retries + 1)
            continue
        what = "did not finish within execution.stage_timeout_s" if state is None or not state.is_final() \
            else f"ended {state.name}"
        raise StageRunFailed(f"stage {name}: flow run {run.name} {what}: {(state.message if state else '') or ''}"
                             .rstrip(": "))
    raise StageRunFailed(f"stage {name}: no committed artifact after {execution.crash_retries + 1} flow runs")
