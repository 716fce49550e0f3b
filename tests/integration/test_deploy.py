"""`forgeline deploy` registers both flows from infra/prefect.yaml on a Prefect server, the draft
refresh with its cron schedule, creating the work pool when it is missing."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_deploy_registers_release_and_scheduled_refresh(prefect_harness):
    from prefect.client.orchestration import get_client

    from flows.deploy import ROOT, deploy_all

    deployed = dict(deploy_all(ROOT / "infra" / "prefect.yaml"))
    assert set(deployed) == {"release/release", "draft-refresh/draft-refresh"}
    with get_client(sync_client=True) as client:
        refresh = client.read_deployment(deployed["draft-refresh/draft-refresh"])
        release = client.read_deployment(deployed["release/release"])
        assert client.read_work_pool("forgeline-gpu").name == "forgeline-gpu"
    assert refresh.entrypoint == "flows/draft_refresh.py:draft_refresh"
    assert [s.schedule.cron for s in refresh.schedules] == ["0 3 * * 1"]
    assert refresh.schedules[0].active
    assert release.schedules == [] and release.parameters["recipe"] == "tiny"
    assert "image" not in (release.job_variables or {})  # an unset $FORGELINE_IMAGE is dropped, not ""
