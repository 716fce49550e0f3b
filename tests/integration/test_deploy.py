"""`forgeline deploy` registers the flows and the `stage/<kind>` deployments from infra/prefect.yaml on a
Prefect server, the draft refresh with its cron schedule, creating the work pools when they are missing; a
recipe moves stage deployments to its pools, and `--gpu-slots` sizes the GPU concurrency limit."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_deploy_registers_release_and_scheduled_refresh(prefect_harness):
    from prefect.client.orchestration import get_client

    from flows.deploy import ROOT, deploy_all
    from tasks.registry import STAGES

    deployed = dict(deploy_all(ROOT / "infra" / "prefect.yaml", stage_pools={"quantize": "forgeline-h100"},
                               gpu_slots={"forgeline-gpu": 4}))
    assert set(deployed) == {"release/release", "draft-refresh/draft-refresh"} | {f"stage/{k}" for k in STAGES}
    with get_client(sync_client=True) as client:
        refresh = client.read_deployment(deployed["draft-refresh/draft-refresh"])
        release = client.read_deployment(deployed["release/release"])
        assert client.read_work_pool("forgeline-gpu").name == "forgeline-gpu"
        stages = {k: client.read_deployment(deployed[f"stage/{k}"]) for k in STAGES}
        assert client.read_global_concurrency_limit_by_name("gpu-forgeline-gpu").limit == 4
    assert {k: d.work_pool_name for k, d in stages.items()} == {
        "data_prep": "forgeline-cpu", "base": "forgeline-gpu", "finetune": "forgeline-gpu",
        "quantize": "forgeline-h100", "traces": "forgeline-gpu", "draft": "forgeline-gpu",
        "evaluate": "forgeline-gpu", "export": "forgeline-cpu"}
    assert all(d.entrypoint == "flows/stages.py:stage_flow" for d in stages.values())
    assert release.work_pool_name == "forgeline-cpu" and release.parameters["overrides"] == ["execution=workers"]
    assert refresh.entrypoint == "flows/draft_refresh.py:draft_refresh"
    assert [s.schedule.cron for s in refresh.schedules] == ["0 3 * * 1"]
    assert refresh.schedules[0].active
    assert release.schedules == [] and release.parameters["recipe"] == "tiny"
    assert "image" not in (release.job_variables or {})  # an unset $FORGELINE_IMAGE is dropped, not ""


def test_a_failed_release_cancels_the_stage_runs_it_started(prefect_harness):
    """Prefect does not cascade cancellation to runs started with run_deployment: the release flows' hook does.
    A run nobody picked up (no worker here) is cancelled when the orchestrating run fails."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment

    from flows.deploy import ROOT, deploy_all
    from flows.execution import cancel_stage_runs

    deploy_all(ROOT / "infra" / "prefect.yaml")
    started = []

    @flow(name="orchestrator-that-fails", on_failure=[cancel_stage_runs])
    def orchestrator():
        started.append(run_deployment("stage/data_prep", parameters={
            "name": "data_prep", "kind": "data_prep", "config": {}, "inputs": {}, "store": "file:///nowhere"},
            timeout=0))
        raise ValueError("a stage upstream failed")

    state = orchestrator(return_state=True)
    assert state.is_failed()
    (child,) = started
    with get_client(sync_client=True) as client:
        child = client.read_flow_run(child.id)
    assert child.parent_task_run_id is not None
    assert child.state.type.value in ("CANCELLING", "CANCELLED"), child.state


def test_workers_preflight_refuses_a_multi_host_stage_on_kubernetes_without_a_checkpoint_claim(prefect_harness):
    """The launcher would refuse to render the JobSet only when the fine-tune's turn came; the preflight does it
    before the release starts, naming the key. With the claim, the same recipe passes."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from flows.deploy import ROOT, deploy_all
    from flows.execution import StageRunFailed, check_workers
    from tasks.recipe import load_release

    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name="forgeline-k8s", type="kubernetes"), overwrite=True)
    deploy_all(ROOT / "infra" / "prefect.yaml", stage_pools={"finetune": "forgeline-k8s"})
    sets = ["execution=workers", "resources.finetune.pool=forgeline-k8s", "resources.finetune.hosts=2",
            "resources.finetune.accelerators=8"]
    cfg = load_release("tiny", sets)
    with pytest.raises(StageRunFailed, match="execution.kubernetes.checkpoint_claim"):
        check_workers(cfg.execution, cfg.resources, ["data_prep", "finetune"])
    cfg = load_release("tiny", [*sets, "execution.kubernetes.checkpoint_claim=forgeline-checkpoints"])
    check_workers(cfg.execution, cfg.resources, ["data_prep", "finetune"])
    with pytest.raises(StageRunFailed, match="resources.finetune.pool"):  # the deployment is on another pool
        cfg = load_release("tiny", ["execution=workers", "resources.finetune.pool=forgeline-h100"])
        check_workers(cfg.execution, cfg.resources, ["finetune"])
