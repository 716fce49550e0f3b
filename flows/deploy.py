"""Register the deployments declared in infra/prefect.yaml on the current Prefect server.

The same file works with `prefect deploy --all --prefect-file infra/prefect.yaml`; this module does
it from Python (`forgeline deploy`) so that it also runs against a test server, creates the work
pools when they are missing, moves the `stage/<kind>` deployments to the pools a recipe's
`resources.<stage>` name, sets the GPU concurrency limits, and needs no interactive prompts.
"""

from __future__ import annotations

import json
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
PREFECT_FILE = ROOT / "infra" / "prefect.yaml"
# The stage deployments of infra/prefect.yaml lie between these two lines, written by `stage_deployments`.
BEGIN = "  # -- the stage/<kind> deployments, generated from tasks/configs.py STAGES: python -m flows.deploy --write"
END = "  # -- end of the generated stage deployments"


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


def stage_deployments() -> str:
    """The `stage/<kind>` deployments, one per declared stage (tasks/configs.py `STAGES`), as the YAML that
    infra/prefect.yaml holds between `BEGIN` and `END`: the stage's summary, the generic stage flow, and
    the pool its default resources imply (`execution.cpu_pool` for a CPU stage, `gpu_pool` otherwise)."""
    from tasks.configs import STAGES, ExecutionConfig

    execution = ExecutionConfig()
    blocks = []
    for spec in STAGES.values():
        blocks.append(f"""  - name: {spec.name}
    description: {json.dumps(f"Stage {spec.name}: {spec.summary}")}
    entrypoint: flows/stages.py:stage_flow
    tags: [forgeline, "stage:{spec.name}"]
    work_pool:
      name: {execution.pool(spec.resources)}
      job_variables:
        image: "{{{{ $FORGELINE_IMAGE }}}}"
""")
    return "\n".join(blocks)


def with_stage_deployments(text: str) -> str:
    """`text` (infra/prefect.yaml) with its generated block replaced by what `stage_deployments` writes now."""
    lines = text.splitlines(keepends=True)
    try:
        begin = next(i for i, ln in enumerate(lines) if ln.rstrip("\n") == BEGIN)
        end = next(i for i, ln in enumerate(lines) if ln.rstrip("\n") == END)
    except StopIteration:
        raise ValueError(f"infra/prefect.yaml: the generated block's marker lines are missing ({BEGIN!r} ... "
                         f"{END!r})") from None
    return "".join(lines[:begin + 1]) + stage_deployments() + "".join(lines[end:])


def main(argv: list[str] | None = None) -> None:
    """`python -m flows.deploy --write` rewrites infra/prefect.yaml's stage deployments from `STAGES`;
    `--check` exits 1 when the file is stale (a declared stage without its deployment, or the reverse)."""
    import argparse
    import sys

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true")
    p.add_argument("--check", action="store_true")
    p.add_argument("--file", type=Path, default=PREFECT_FILE)
    a = p.parse_args(argv)
    text = a.file.read_text()
    fresh = with_stage_deployments(text)
    if a.write and fresh != text:
        a.file.write_text(fresh)
    elif a.check and fresh != text:
        print(f"error: {a.file}: the stage deployments differ from tasks/configs.py STAGES "
              "(python -m flows.deploy --write)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
