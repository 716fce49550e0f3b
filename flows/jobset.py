"""A multi-host stage on Kubernetes: one JobSet rendered from the stage's resources, created, watched, deleted.

On a process pool a stage with `resources.<stage>.hosts = N > 1` runs as N processes on the worker's machine
(flows/gang.py). On a Kubernetes pool the stage's flow run is a small launcher pod, and the gang is a JobSet
(https://jobset.sigs.k8s.io, API `jobset.x-k8s.io/v1alpha2`) of one Indexed Job with N pods, one per host:

- `render` builds it from the same hints the pool's job variables come from (`StageResources`: GPUs per host
  as `nvidia.com/gpu`, memory, CPUs, node selector, tolerations, image) and from `execution.kubernetes`
  (namespace, the store's credentials Secret, the ReadWriteMany claim for checkpoints). Every pod runs
  `python -m tasks.member <spec URL>` with `JAX_COORDINATOR_ADDRESS` = the first pod's stable DNS name
  (`<jobset>-<replicatedJob>-<job index>-<pod index>.<subdomain>`, JobSet's `network.enableDNSHostnames`),
  `JAX_NUM_PROCESSES` = N and `JAX_PROCESS_ID` = the pod's completion index (the annotation Indexed Jobs put
  on every pod). `failurePolicy.maxRestarts: 0`: a JAX runtime cannot lose a process, and a retry is the
  orchestrator's (a new attempt resumes from the last committed checkpoint).
- The member spec (JSON in the store, never a pickle) carries artifact references, not paths: each host
  fetches its own inputs, process 0 uploads the outputs and its metadata to a staging prefix, and the
  launcher (which holds the stage's lease) downloads and commits them like any other stage output.
- `KubeGang.run` creates the JobSet, streams every pod's log lines tagged with its index, and fails the
  stage as soon as a pod fails (naming the process, its exit status and last line), when some pods finished
  and the rest did not follow within `finish_grace`, or at the stage's timeout; whatever happens, the JobSet
  is deleted (foreground: its pods go with it). A leftover gang of the same stage and fingerprint (its
  launcher was SIGKILLed) is deleted before a new one starts: the stage's lease makes this launcher the only
  live one for that fingerprint.

The launcher pod's service account needs create/get/delete on `jobsets` and get/list on `pods` and
`pods/log` in the namespace (infra/k8s/gang-rbac.yaml).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

import storage
from flows.gang import GangFailed
from tasks.configs import KubernetesGangConfig, StageResources
from tasks.registry import Runner, Stage
from tasks.stage import Progress, StageContext

log = logging.getLogger("forgeline.gang")

GROUP, VERSION, PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
REPLICATED_JOB = "hosts"
NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"  # set by the JobSet controller on every pod it creates
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"  # set by the Job controller (Indexed Jobs)
STAGE_LABEL, FINGERPRINT_LABEL = "forgeline.io/stage", "forgeline.io/fingerprint"
SCRATCH, CHECKPOINTS = "/scratch", "/checkpoints"
SERVICE_ACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def jobset_name(kind: str, fingerprint: str, nonce: str) -> str:
    """A DNS-1035 label short enough that the pods' host names (`<name>-hosts-<j>-<i>`) stay within 63."""
    return f"fl-{kind.replace('_', '-')[:12]}-{fingerprint[:10]}-{nonce[:6]}".lower()


def namespace_of(k8s: KubernetesGangConfig) -> str:
    if k8s.namespace:
        return k8s.namespace
    return SERVICE_ACCOUNT_NAMESPACE.read_text().strip() if SERVICE_ACCOUNT_NAMESPACE.exists() else "default"


def coordinator_address(name: str, port: int) -> str:
    """Process 0: the first pod of the first (only) job, by the host name JobSet gives it."""
    return f"{name}-{REPLICATED_JOB}-0-0.{name}:{port}"


def render(name: str, kind: str, fingerprint: str, spec_url: str, resources: StageResources,
           k8s: KubernetesGangConfig, *, timeout_s: int, trains: bool) -> dict[str, Any]:
    """The JobSet that runs stage `kind` as `resources.hosts` JAX processes, one pod per host."""
    hosts = resources.hosts
    if trains and hosts > 1 and not k8s.checkpoint_claim:
        raise ValueError(f"execution.kubernetes.checkpoint_claim: the multi-host {kind} stage checkpoints into "
                         f"one folder shared by its {hosts} hosts (orbax's multi-host layout); name a "
                         f"ReadWriteMany PersistentVolumeClaim")
    labels = {"app.kubernetes.io/part-of": "forgeline", "app.kubernetes.io/component": "multihost-stage",
              STAGE_LABEL: kind.replace("_", "-"), FINGERPRINT_LABEL: fingerprint[:63]}
    quantities: dict[str, Any] = {}
    if resources.accelerators:
        quantities["nvidia.com/gpu"] = str(resources.accelerators)
    if resources.memory_gib is not None:
        quantities["memory"] = f"{resources.memory_gib}Gi"
    if resources.cpus is not None:
        quantities["cpu"] = str(resources.cpus)
    env = [
        {"name": "JAX_COORDINATOR_ADDRESS", "value": coordinator_address(name, k8s.coordinator_port)},
        {"name": "JAX_NUM_PROCESSES", "value": str(hosts)},
        {"name": "JAX_PROCESS_ID",
         "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX_ANNOTATION}']"}}},
        {"name": "FORGELINE_WORKDIR", "value": f"{SCRATCH}/work"},
        {"name": "FORGELINE_CACHE", "value": f"{SCRATCH}/cache"},
    ]
    if resources.accelerators:  # the GPU runtime: overlap collectives with compute, leave XLA headroom
        env += [{"name": "XLA_FLAGS", "value": "--xla_gpu_enable_latency_hiding_scheduler=true"},
                {"name": "XLA_PYTHON_CLIENT_MEM_FRACTION", "value": "0.90"},
                {"name": "NCCL_DEBUG", "value": "WARN"}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "scratch", "mountPath": SCRATCH}]
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{k8s.shm_gib}Gi"}},
        {"name": "scratch", "emptyDir": {"sizeLimit": f"{k8s.scratch_gib}Gi"}},
    ]
    if k8s.checkpoint_claim:
        env.append({"name": "FORGELINE_CHECKPOINT_ROOT", "value": CHECKPOINTS})
        mounts.append({"name": "checkpoints", "mountPath": CHECKPOINTS})
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": k8s.checkpoint_claim}})
    container: dict[str, Any] = {
        "name": "stage",
        "image": resources.image or k8s.image,
        "imagePullPolicy": "IfNotPresent",
        # args, not command: the image's ENTRYPOINT (tini -g) stays, so SIGTERM reaches the whole group
        "args": ["python", "-m", "tasks.member", spec_url],
        "env": env,
        "ports": [{"name": "jax-coordinator", "containerPort": k8s.coordinator_port}],
        "volumeMounts": mounts,
    }
    if k8s.secret:
        container["envFrom"] = [{"secretRef": {"name": k8s.secret, "optional": True}}]
    if quantities:  # requests = limits: Guaranteed QoS, and whole GPUs
        container["resources"] = {"requests": dict(quantities), "limits": dict(quantities)}
    pod: dict[str, Any] = {"restartPolicy": "Never", "containers": [container], "volumes": volumes,
                           # infra/Dockerfile's `forgeline` user; fsGroup makes the claim writable for it
                           "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001,
                                               "fsGroup": 10001}}
    if resources.node_selector:
        pod["nodeSelector"] = dict(resources.node_selector)
    if resources.tolerations:
        pod["tolerations"] = [dict(t) for t in resources.tolerations]
    if k8s.service_account:
        pod["serviceAccountName"] = k8s.service_account
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "JobSet",
        "metadata": {"name": name, "labels": dict(labels)},
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
            "failurePolicy": {"maxRestarts": 0},
            "successPolicy": {"operator": "All"},
            "replicatedJobs": [{
                "name": REPLICATED_JOB,
                "replicas": 1,
                "template": {"spec": {
                    "completionMode": "Indexed",
                    "parallelism": hosts,
                    "completions": hosts,
                    "backoffLimit": 0,
                    "activeDeadlineSeconds": timeout_s,
                    "template": {"metadata": {"labels": dict(labels)}, "spec": pod},
                }},
            }],
        },
    }


def pod_template(jobset: dict[str, Any]) -> dict[str, Any]:
    return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]


# -- the launcher --------------------------------------------------------------------------------------

class KubeGang:
    """Create one JobSet, watch it to its end, delete it. Talks to the cluster with kubernetes_asyncio (the
    client prefect-kubernetes uses): in-cluster credentials inside a pod, `$KUBECONFIG` elsewhere."""

    def __init__(self, namespace: str, *, poll: float = 2.0, finish_grace: float = 60.0):
        self.namespace, self.poll, self.finish_grace = namespace, poll, finish_grace

    def run(self, jobset: dict[str, Any], on_line: Callable[[int, str], None], timeout: float) -> None:
        try:
            asyncio.run(self._run(jobset, on_line, timeout))
        except BaseException:  # interrupted (Ctrl-C, Prefect's SIGTERM) wherever it was: the gang goes too
            asyncio.run(self._delete_only(jobset["metadata"]["name"]))
            raise

    async def _delete_only(self, name: str) -> None:
        from kubernetes_asyncio.client import ApiClient, CustomObjectsApi

        await self._configure()
        async with ApiClient() as api:
            await self._delete(CustomObjectsApi(api), name)

    @staticmethod
    async def _configure() -> None:
        from kubernetes_asyncio import config

        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
        else:  # read $KUBECONFIG now: the client reads it once, at its import
            await config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))

    async def _run(self, jobset: dict[str, Any], on_line: Callable[[int, str], None], timeout: float) -> None:
        from kubernetes_asyncio.client import ApiClient, CoreV1Api, CustomObjectsApi

        await self._configure()
        name, ns = jobset["metadata"]["name"], self.namespace
        labels = jobset["metadata"]["labels"]
        async with ApiClient() as api:
            custom, core = CustomObjectsApi(api), CoreV1Api(api)
            # a gang left by a launcher that was killed: this launcher holds the stage's lease now
            same_stage = f"{STAGE_LABEL}={labels[STAGE_LABEL]},{FINGERPRINT_LABEL}={labels[FINGERPRINT_LABEL]}"
            await custom.delete_collection_namespaced_custom_object(GROUP, VERSION, ns, PLURAL,
                                                                    label_selector=same_stage)
            await custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, jobset)
            log.info("JobSet %s/%s created: %d hosts", ns, name,
                     jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"])
            try:
                await self._watch(custom, core, name, on_line, timeout)
            finally:
                await self._delete(custom, name)

    async def _delete(self, custom: Any, name: str) -> None:
        from kubernetes_asyncio.client import V1DeleteOptions
        from kubernetes_asyncio.client.exceptions import ApiException

        try:
            await custom.delete_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name,
                                                         body=V1DeleteOptions(propagation_policy="Foreground"))
            log.info("JobSet %s/%s deleted", self.namespace, name)
        except ApiException as e:
            if e.status != 404:
                log.warning("JobSet %s/%s: could not delete it (%s %s)", self.namespace, name, e.status, e.reason)

    async def _watch(self, custom: Any, core: Any, name: str, on_line: Callable[[int, str], None],
                     timeout: float) -> None:
        hosts_total: int | None = None
        last: dict[int, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=1))
        followers: dict[str, asyncio.Task] = {}
        deadline, finished_since = time.monotonic() + timeout, None

        async def drain() -> None:  # the last lines of pods that ended, before judging them
            if followers:
                await asyncio.wait(list(followers.values()), timeout=10)

        try:
            while True:
                obj = await custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
                hosts_total = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"]
                conditions = {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []
                              if c.get("status") == "True"}
                pods = (await core.list_namespaced_pod(self.namespace,
                                                       label_selector=f"{NAME_LABEL}={name}")).items
                done = []
                for pod in pods:
                    index = int((pod.metadata.annotations or {}).get(INDEX_ANNOTATION, -1))
                    phase = pod.status.phase
                    if phase in ("Running", "Succeeded", "Failed") and pod.metadata.name not in followers:
                        followers[pod.metadata.name] = asyncio.create_task(
                            self._follow(core, pod.metadata.name, index, on_line, last[index]))
                    if phase == "Failed":
                        await drain()
                        code = _exit_code(pod)
                        line = last[index][0] if last[index] else ""
                        raise GangFailed(f"process {index} of {hosts_total} (pod {pod.metadata.name}) exited with "
                                         f"status {code}" + (f"; its last line: {line}" if line else "")
                                         + (f" ({pod.status.reason})" if pod.status.reason else ""),
                                         index, code, line)
                    if phase == "Succeeded":
                        done.append(index)
                if "Completed" in conditions:
                    await drain()
                    return
                if "Failed" in conditions:
                    c = conditions["Failed"]
                    raise GangFailed(f"JobSet {name} failed: {c.get('reason', '')} {c.get('message', '')}".strip())
                if done and len(done) < hosts_total:
                    finished_since = finished_since or time.monotonic()
                    if time.monotonic() - finished_since > self.finish_grace:
                        rest = sorted(set(range(hosts_total)) - set(done))
                        line = last[rest[0]][0] if last[rest[0]] else ""
                        raise GangFailed(f"process {rest[0]} of {hosts_total} was still running "
                                         f"{self.finish_grace:.0f}s after the others finished"
                                         + (f"; its last line: {line}" if line else ""), rest[0], None, line)
                if time.monotonic() > deadline:
                    raise GangFailed(f"JobSet {name} did not finish within {timeout:.0f}s")
                await asyncio.sleep(self.poll)
        finally:
            for task in followers.values():
                task.cancel()

    async def _follow(self, core: Any, pod: str, index: int, on_line: Callable[[int, str], None],
                      last: collections.deque) -> None:
        """Stream one pod's log lines to `on_line(index, line)` until its container ends."""
        from kubernetes_asyncio.client.exceptions import ApiException

        for _ in range(30):  # the container may not accept log reads for a moment after it starts
            try:
                resp = await core.read_namespaced_pod_log(pod, self.namespace, follow=True,
                                                          _preload_content=False)
            except ApiException:
                await asyncio.sleep(1.0)
                continue
            async with resp:
                async for raw in resp.content:
                    line = raw.decode(errors="replace").rstrip("\n")
                    if line:
                        last.append(line)
                        on_line(index, line)
            return


def _exit_code(pod: Any) -> int | None:
    for status in pod.status.container_statuses or []:
        terminated = status.state.terminated if status.state else None
        if terminated is not None:
            return terminated.exit_code
    return None


def jobset_runner(resources: StageResources, k8s: KubernetesGangConfig, timeout_s: int, *,
                  finish_grace: float = 60.0, poll: float = 2.0) -> Runner:
    """A `Runner` (tasks/registry.py) that computes the stage as a JobSet of `resources.hosts` pods."""
    from tasks.member import line_router

    def run(spec: Stage, cfg: BaseModel, ctx: StageContext, progress: Progress | None) -> dict[str, Any]:
        name = jobset_name(spec.name, ctx.fingerprint, uuid.uuid4().hex)
        staging = ctx.store.url(f"staging/gang/{name}")
        member = {"kind": spec.name, "config": cfg.model_dump(mode="json"), "fingerprint": ctx.fingerprint,
                  "store": ctx.store.root, "refs": {k: r.to_dict() for k, r in ctx.refs.items()},
                  "out_url": storage.join(staging, "out"), "stats": storage.join(staging, "stats.json")}
        spec_url = storage.join(staging, "member.json")
        storage.write_bytes(spec_url, json.dumps(member).encode())
        body = render(name, spec.name, ctx.fingerprint, spec_url, resources, k8s, timeout_s=timeout_s,
                      trains=spec.trains)

        on_line = line_router(progress, log)
        try:
            KubeGang(namespace_of(k8s), poll=poll, finish_grace=finish_grace).run(body, on_line, timeout_s)
            shutil.rmtree(ctx.out_dir, ignore_errors=True)
            storage.download_dir(member["out_url"], ctx.out_dir)
            return json.loads(storage.read_bytes(member["stats"]))
        finally:
            storage.rm(staging)

    return run


def preview(cfg: Any, kind: str, store: str) -> dict[str, Any]:
    """The JobSet a release with recipe `cfg` would create for stage `kind` (`forgeline jobset`), for review or
    `kubectl apply --dry-run=server`: the real one differs only in its name's fingerprint and nonce."""
    from tasks import registry

    resources = cfg.resources.of(kind)
    if resources.hosts < 2:
        raise ValueError(f"resources.{kind}.hosts: {resources.hosts}: a one-host stage runs in its flow run's own "
                         f"pod, not as a JobSet")
    name = jobset_name(kind, "f" * 64, "000000")
    spec_url = storage.join(store, f"staging/gang/{name}/member.json")
    return render(name, kind, "f" * 64, spec_url, resources, cfg.execution.kubernetes,
                  timeout_s=cfg.execution.stage_timeout_s, trains=registry.stage(kind).trains)
