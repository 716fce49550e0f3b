"""Register the deployments declared in infra/prefect.yaml on the current Prefect server.

The same file works with `prefect deploy --all --prefect-file infra/prefect.yaml`; this module does
it from Python (`forgeline deploy`) so that it also runs against a test server, creates the work
pools when they are missing, moves the `stage/<kind>` deployments to the pools a recipe's
`resources.<stage>` name, sets the GPU concurrency limits, and needs no interactive prompts.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from prefect import Flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.exceptions import ObjectNotFound
from prefect.schedules import Cron

ROOT = Path(__file__).resolve().parent.parent


def _expand(value: Any) -> Any:
    """`{{ $VAR }}` -> the environment variable (empty when unset), recursively."""
    if isinstance(value, str):
        return re.sub(r"\{\{\s*\$(\w+)\s*\}\}", lambda m: os.environ.get(m.group(1), ""), value)
    if isinstance(value, dict):
        return {k: _expand(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand(v) for v in value]
    return value


def ensure_work_pool(name: str, pool_type: str = "process") -> None:
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=name, type=pool_type))


def ensure_gpu_limit(pool: str, slots: int) -> None:
    """The global concurrency limit `gpu-<pool>` with `slots` slots (created, or resized), which GPU stages
    on `pool` occupy while they compute (flows/execution.py)."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate

    from flows.execution import gpu_limit_name

    name = gpu_limit_name(pool)
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
            client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=slots))
        except ObjectNotFound:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots))


def deploy_all(prefect_file: Path, source: Path = ROOT, *, stage_pools: dict[str, str] | None = None,
               gpu_slots: dict[str, int] | None = None, pool_type: str | None = None) -> list[tuple[str, str]]:
    """Register every deployment of `prefect_file`; `stage_pools` ({kind: pool}, from a recipe) moves stage
    deployments to other pools, `gpu_slots` ({pool: slots}) sets those pools' GPU limits."""
    spec = yaml.safe_load(Path(prefect_file).read_text())
    out = []
    for pool, slots in (gpu_slots or {}).items():
        ensure_gpu_limit(pool, slots)
    for dep in spec["deployments"]:
        pool = dep["work_pool"]["name"]
        if dep["entrypoint"] == "flows/stages.py:stage_flow" and stage_pools and dep["name"] in stage_pools:
            pool = stage_pools[dep["name"]]
        ensure_work_pool(pool, pool_type or os.environ.get("FORGELINE_WORK_POOL_TYPE", "process"))
        flow = Flow.from_source(source=str(source), entrypoint=dep["entrypoint"])
        schedules = [Cron(s["cron"], timezone=s.get("timezone", "UTC"), active=s.get("active", True))
                     for s in dep.get("schedules", [])]
        job_variables = {k: v for k, v in _expand(dep["work_pool"].get("job_variables", {})).items() if v}
        dep_id = flow.deploy(
            name=dep["name"], work_pool_name=pool, parameters=dep.get("parameters", {}), tags=dep.get("tags"),
            description=dep.get("description"), schedules=schedules, job_variables=job_variables,
            build=False, push=False, print_next_steps=False,
        )
        out.append((f"{flow.name}/{dep['name']}", str(dep_id)))
    return out
