"""A multi-host stage on Kubernetes (flows/jobset.py): the JobSet rendered from a stage's resources is made of
fields the Kubernetes API knows, wires JAX's three variables the way JobSet names its pods, and the launcher
watches one through the real Kubernetes client (against tests/kube_fake.py, whose pods are local processes):
a failing pod fails the stage fast naming it, a pod left running is stopped, a leftover gang of the same
stage is removed first, and nothing is left behind."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import jsonschema
import pytest

from flows.execution import job_variables, runner_for
from flows.gang import GangFailed
from flows.jobset import INDEX_ANNOTATION, KubeGang, coordinator_address, jobset_name, pod_template, render
from tasks.configs import KubernetesGangConfig, StageResources
from tests.kube_fake import FakeCluster

pytestmark = pytest.mark.unit

H200 = StageResources(accelerators=8, hosts=4, memory_gib=1600, cpus=96, image="registry.local/forgeline:cuda12",
                      node_selector={"nvidia.com/gpu.product": "NVIDIA-H200"},
                      tolerations=({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},))
K8S = KubernetesGangConfig(namespace="ml", checkpoint_claim="forgeline-ckpt", service_account="forgeline-gang")
FP = "0123456789abcdef" * 4
TEMPLATE = json.loads((Path(__file__).resolve().parents[2] / "infra/work-pools/kubernetes-gpu.json").read_text())


def _roundtrip(data: dict, model: str) -> dict:
    """`data` through the Kubernetes client's model `model` and back: a misspelt or misplaced field is lost."""
    from kubernetes_asyncio.client import ApiClient

    async def through() -> dict:
        async with ApiClient() as api:
            return api.sanitize_for_serialization(api._ApiClient__deserialize(data, model))

    return asyncio.run(through())


def test_the_rendered_jobset_is_made_of_fields_kubernetes_knows():
    js = render(jobset_name("finetune", FP, "a1b2c3"), "finetune", FP, "s3://b/staging/member.json", H200, K8S,
                timeout_s=86400, trains=True)
    job = js["spec"]["replicatedJobs"][0]["template"]
    assert _roundtrip(job, "V1JobTemplateSpec") == job
    assert _roundtrip(js["metadata"], "V1ObjectMeta") == js["metadata"]
    spec = job["spec"]
    assert (spec["completionMode"], spec["parallelism"], spec["completions"], spec["backoffLimit"]) == \
        ("Indexed", 4, 4, 0)
    assert js["spec"]["failurePolicy"] == {"maxRestarts": 0}  # a retry is the orchestrator's, from a checkpoint
    pod = pod_template(js)["spec"]
    (c,) = pod["containers"]
    gpus = {"nvidia.com/gpu": "8", "memory": "1600Gi", "cpu": "96"}
    assert c["resources"] == {"requests": gpus, "limits": gpus}
    assert c["image"] == H200.image and c["args"] == ["python", "-m", "tasks.member", "s3://b/staging/member.json"]
    assert pod["nodeSelector"] == H200.node_selector and pod["tolerations"] == list(H200.tolerations)
    assert pod["serviceAccountName"] == "forgeline-gang"
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "forgeline-ckpt"}} in pod["volumes"]
    assert c["envFrom"] == [{"secretRef": {"name": "forgeline-s3", "optional": True}}]


def test_the_gang_finds_its_coordinator_by_the_name_jobset_gives_the_first_pod():
    """JobSet names pods' hosts `<jobset>-<replicatedJob>-<job index>-<pod index>` under the subdomain;
    process i is the pod whose completion index is i."""
    name = jobset_name("finetune", FP, "a1b2c3")
    js = render(name, "finetune", FP, "s3://b/m.json", H200, K8S, timeout_s=600, trains=True)
    env = {e["name"]: e for e in pod_template(js)["spec"]["containers"][0]["env"]}
    rj = js["spec"]["replicatedJobs"][0]["name"]
    assert js["spec"]["network"]["subdomain"] == name and js["spec"]["network"]["enableDNSHostnames"] is True
    assert env["JAX_COORDINATOR_ADDRESS"]["value"] == f"{name}-{rj}-0-0.{name}:8476" == coordinator_address(name, 8476)
    assert env["JAX_NUM_PROCESSES"]["value"] == "4"
    assert env["JAX_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{INDEX_ANNOTATION}']"
    assert env["FORGELINE_CHECKPOINT_ROOT"]["value"] == "/checkpoints"  # the shared claim's mount


def test_names_fit_the_host_name_limit_and_a_training_gang_needs_a_shared_checkpoint_volume():
    for kind in ("data_prep", "finetune", "evaluate"):
        name = jobset_name(kind, FP, "ffffff")
        host = f"{name}-hosts-0-4095"
        assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(host) <= 63, host
    with pytest.raises(ValueError, match="execution.kubernetes.checkpoint_claim"):
        render("x", "finetune", FP, "s3://b/m.json", H200, KubernetesGangConfig(), timeout_s=60, trains=True)
    js = render("x", "evaluate", FP, "s3://b/m.json", StageResources(hosts=2), KubernetesGangConfig(secret=None),
                timeout_s=60, trains=False)
    c = pod_template(js)["spec"]["containers"][0]
    assert "resources" not in c and "envFrom" not in c  # nothing asked: the cluster's defaults


def test_a_multi_host_stage_on_kubernetes_launches_from_a_pod_without_gpus():
    launcher = job_variables(H200, "kubernetes")
    assert launcher == {"gpu_count": 0, "image": H200.image, "service_account_name": "forgeline-launcher"}
    jsonschema.validate(launcher, TEMPLATE["variables"])  # the GPU pool's template takes them
    assert job_variables(StageResources(accelerators=8), "kubernetes")["gpu_count"] == 8
    assert runner_for(H200, pool_type="process").__qualname__.startswith("gang_runner")
    assert runner_for(H200, pool_type="kubernetes").__qualname__.startswith("jobset_runner")


def _script_gang(name: str, script: str, hosts: int = 2) -> dict:
    js = render(name, "evaluate", FP, "unused", StageResources(hosts=hosts), KubernetesGangConfig(secret=None),
                timeout_s=600, trains=False)
    pod_template(js)["spec"]["containers"][0]["args"] = ["python", "-c", script]
    return js


def test_a_failing_pod_fails_the_gang_fast_naming_it_and_a_leftover_gang_is_removed(tmp_path, monkeypatch):
    with FakeCluster(tmp_path / "k8s") as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        orphan = _script_gang("fl-evaluate-orphan", "import time; time.sleep(600)")
        cluster.create(orphan)  # the gang of a launcher that was SIGKILLed: same stage, same fingerprint
        (sleeper,) = cluster.processes_of("fl-evaluate-orphan")[:1]
        script = ("import os, sys, time\n"
                  "from tasks.training.distributed import initialize_from_env\n"
                  "if os.environ['JAX_PROCESS_ID'] == '1':\n"
                  "    print('loading shard 1', flush=True)\n"
                  "    print('error: ValueError: shard 1 is unreadable', file=sys.stderr, flush=True)\n"
                  "    sys.exit(3)\n"
                  "initialize_from_env()  # process 0 waits here for process 1, which never joins\n"
                  "time.sleep(600)\n")
        seen: list[tuple[int, str]] = []
        t0 = time.monotonic()
        with pytest.raises(GangFailed) as failure:
            KubeGang("ml", poll=0.2).run(_script_gang("fl-evaluate-failing", script), lambda i, s: seen.append((i, s)),
                                         timeout=120)
        seconds = time.monotonic() - t0
        e = failure.value
        assert seconds < 60, seconds
        assert (e.process, e.returncode) == (1, 3), e
        assert "process 1 of 2" in str(e) and "error: ValueError: shard 1 is unreadable" in str(e)
        assert (1, "loading shard 1") in seen
        assert sleeper.poll() is not None  # the leftover gang was deleted before the new one started
        assert cluster.jobsets == {} and cluster.pods == {}  # and the failed one after it failed
        print(f"jobset: process 1 failed -> stage failed in {seconds:.1f}s: {e}")


def test_a_pod_left_running_after_the_others_finished_is_stopped(tmp_path, monkeypatch):
    with FakeCluster(tmp_path / "k8s") as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        script = ("import os, time\n"
                  "if os.environ['JAX_PROCESS_ID'] == '1':\n"
                  "    print('waiting for the coordinator', flush=True); time.sleep(600)\n")
        with pytest.raises(GangFailed, match="process 1 of 2 was still running 2s after the others") as e:
            KubeGang("ml", poll=0.2, finish_grace=2.0).run(_script_gang("fl-evaluate-hang", script),
                                                           lambda i, s: None, timeout=120)
        assert e.value.last_line == "waiting for the coordinator"
        assert cluster.pods == {}


def test_the_launcher_deletes_its_gang_when_interrupted(tmp_path, monkeypatch):
    """Ctrl-C or Prefect's cancellation reaches the launcher while the pods run: the JobSet goes too."""
    with FakeCluster(tmp_path / "k8s") as cluster:
        monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)

        def interrupt(i: int, line: str) -> None:
            if line == "started":
                raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            KubeGang("ml", poll=0.2).run(_script_gang("fl-evaluate-cancel", "import time; print('started', "
                                                      "flush=True); time.sleep(600)"), interrupt, timeout=120)
        assert cluster.created == ["fl-evaluate-cancel"] and cluster.jobsets == {} and cluster.pods == {}

