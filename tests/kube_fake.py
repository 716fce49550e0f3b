"""A Kubernetes API server for the JobSet launcher's tests: the few REST calls flows/jobset.py makes, answered
on 127.0.0.1, with every pod of a created JobSet run as a real local process.

No cluster, kind, k3s or kube-apiserver installs through pip, so this plays the parts of the API server, the
JobSet and Job controllers and the kubelet, as far as the launcher sees them:

- `POST/GET/DELETE /apis/jobset.x-k8s.io/v1alpha2/namespaces/{ns}/jobsets[/{name}]` (and DELETE of a
  collection by `labelSelector`); `GET /api/v1/namespaces/{ns}/pods?labelSelector=...` and
  `GET .../pods/{pod}/log?follow=true`, answered in the API's JSON shapes, which kubernetes_asyncio's own
  models deserialize (the launcher reads them through the real client);
- pods: one per completion index of the (single) replicated Indexed Job, named `<jobset>-<job>-0-<i>-<rand>`,
  annotated with `batch.kubernetes.io/job-completion-index`. The container runs as a process on this machine
  in the pod template's `args`, with its `env` (a `fieldRef` to the completion-index annotation resolves to
  the index), `envFrom` Secrets the test registers, and its volumes: each `emptyDir` a folder of the pod's
  own, each `persistentVolumeClaim` a folder shared by every pod that mounts the claim (`/dev/shm` stays);
  mount paths in the env and args are rewritten to those folders, `python` is this interpreter, and the pods'
  DNS names (`<jobset>-<job>-0-<i>.<subdomain>`) resolve to 127.0.0.1 by rewriting, with the coordinator's
  port mapped to a free one. The JobSet becomes Completed when every pod succeeded, Failed when one failed
  (`failurePolicy.maxRestarts: 0`), and deleting it kills its pods' processes.

What it does not check: scheduling, quotas, RBAC, images. Those are the cluster's, and the rendered objects'
fields are checked against the Kubernetes client's models in tests/unit/test_jobset.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

from flows.gang import free_port
from flows.jobset import INDEX_ANNOTATION, NAME_LABEL

ROOT = Path(__file__).resolve().parent.parent


class Pod:
    def __init__(self, name: str, jobset: str, index: int, labels: dict[str, str]):
        self.name, self.jobset, self.index, self.labels = name, jobset, index, labels
        self.lines: list[str] = []
        self.changed = threading.Condition()
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None

    @property
    def phase(self) -> str:
        if self.proc is None:
            return "Pending"
        if self.exit_code is None:
            return "Running"
        return "Succeeded" if self.exit_code == 0 else "Failed"

    def to_json(self, namespace: str) -> dict[str, Any]:
        state = {"running": {}} if self.phase == "Running" else \
            {"terminated": {"exitCode": self.exit_code}} if self.exit_code is not None else {"waiting": {}}
        return {"metadata": {"name": self.name, "namespace": namespace,
                             "labels": {**self.labels, NAME_LABEL: self.jobset},
                             "annotations": {INDEX_ANNOTATION: str(self.index)}},
                "status": {"phase": self.phase,
                           "containerStatuses": [{"name": "stage", "image": "forgeline", "imageID": "",
                                                  "ready": self.phase == "Running", "restartCount": 0,
                                                  "state": state}]}}


class FakeCluster:
    """`with FakeCluster(tmp) as cluster:` serves on 127.0.0.1; `cluster.kubeconfig` points a client at it."""

    def __init__(self, root: Path, secrets: dict[str, dict[str, str]] | None = None):
        self.root, self.secrets = Path(root), secrets or {}
        self.jobsets: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, Pod] = {}
        self.created: list[str] = []  # every JobSet name ever created, in order
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.kubeconfig = self.root / "kubeconfig"

    def __enter__(self) -> FakeCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": url}}],
            "users": [{"name": "fake", "user": {"token": "fake"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "ml"}}]}))
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        for name in list(self.jobsets):
            self.delete(name)
        self.server.shutdown()
        self.server.server_close()

    # -- the controllers and the kubelet ---------------------------------------------------------------

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        with self.lock:
            if name in self.jobsets:
                raise KeyError(name)
            self.jobsets[name] = body
            self.created.append(name)
        job = body["spec"]["replicatedJobs"][0]
        spec = job["template"]["spec"]
        assert spec["completionMode"] == "Indexed" and spec["parallelism"] == spec["completions"]
        template = spec["template"]
        subdomain = body["spec"]["network"]["subdomain"]
        port = free_port()
        claims: dict[str, Path] = {}
        for index in range(spec["completions"]):
            pod = Pod(f"{name}-{job['name']}-0-{index}-{uuid.uuid4().hex[:5]}", name, index,
                      dict(template["metadata"].get("labels", {})))
            with self.lock:
                self.pods[pod.name] = pod
            argv, env = self._container(template["spec"], pod, f"{name}-{job['name']}-0-", subdomain, port, claims)
            pod.proc = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, text=True, process_group=0)
            threading.Thread(target=self._kubelet, args=(pod,), daemon=True).start()
        return body

    def _container(self, pod_spec: dict[str, Any], pod: Pod, host_prefix: str, subdomain: str, port: int,
                   claims: dict[str, Path]) -> tuple[list[str], dict[str, str]]:
        (container,) = pod_spec["containers"]
        volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
        mounts: dict[str, str] = {}
        for m in container.get("volumeMounts", []):
            volume = volumes[m["name"]]
            if m["mountPath"] == "/dev/shm":
                continue
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                if claim not in claims:
                    claims[claim] = Path(tempfile.mkdtemp(prefix=f"claim-{claim}-", dir=self.root))
                mounts[m["mountPath"]] = str(claims[claim])
            else:
                assert "emptyDir" in volume, volume
                mounts[m["mountPath"]] = tempfile.mkdtemp(prefix=f"{pod.name}-{m['name']}-", dir=self.root)

        def local(value: str) -> str:
            for path, folder in mounts.items():
                value = re.sub(rf"(?<![\w/]){re.escape(path)}(?=/|$)", folder, value)
            # cluster DNS: the gang's pods are this machine, the coordinator's port a free one here
            return re.sub(rf"{re.escape(host_prefix)}\d+\.{re.escape(subdomain)}(:\d+)?",
                          f"127.0.0.1:{port}", value)

        env = {k: v for k, v in os.environ.items() if not k.startswith(("KUBECONFIG", "FORGELINE_GANG"))}
        for source in container.get("envFrom", []):
            secret = self.secrets.get(source["secretRef"]["name"])
            if secret is None and not source["secretRef"].get("optional"):
                raise ValueError(f"secret {source['secretRef']['name']} not found")
            env.update(secret or {})
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = local(item["value"])
            else:
                path = item["valueFrom"]["fieldRef"]["fieldPath"]
                assert path == f"metadata.annotations['{INDEX_ANNOTATION}']", path
                env[item["name"]] = str(pod.index)
        argv = [local(a) for a in container.get("command", []) + container["args"]]
        if argv[0] == "python":
            argv[0] = sys.executable
        return argv, env

    def _kubelet(self, pod: Pod) -> None:
        assert pod.proc is not None and pod.proc.stdout is not None
        for line in pod.proc.stdout:
            with pod.changed:
                pod.lines.append(line.rstrip("\n"))
                pod.changed.notify_all()
        code = pod.proc.wait()
        with pod.changed:
            pod.exit_code = code
            pod.changed.notify_all()

    def status(self, name: str) -> dict[str, Any]:
        pods = [p for p in list(self.pods.values()) if p.jobset == name]
        conditions = []
        if any(p.phase == "Failed" for p in pods):
            conditions.append({"type": "Failed", "status": "True", "reason": "FailedJobs",
                               "message": "jobset failed due to reaching max number of restarts"})
        elif pods and all(p.phase == "Succeeded" for p in pods):
            conditions.append({"type": "Completed", "status": "True", "reason": "AllJobsCompleted",
                               "message": "jobset completed successfully"})
        return {**self.jobsets[name], "status": {"conditions": conditions}}

    def delete(self, name: str) -> None:
        with self.lock:
            self.jobsets.pop(name, None)
            pods = [p for p in self.pods.values() if p.jobset == name]
            for p in pods:
                del self.pods[p.name]
        for p in pods:
            if p.proc is not None and p.proc.poll() is None:
                try:
                    os.killpg(p.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.proc.wait()

    def processes_of(self, name: str) -> list[subprocess.Popen]:
        return [p.proc for p in self.pods.values() if p.jobset == name and p.proc is not None]


def _matches(labels: dict[str, str], selector: str) -> bool:
    return all(labels.get(k) == v for k, v in (term.split("=", 1) for term in selector.split(",") if term))


def _handler(cluster: FakeCluster) -> type[BaseHTTPRequestHandler]:
    jobsets = re.compile(r"^/apis/jobset\.x-k8s\.io/v1alpha2/namespaces/([^/]+)/jobsets(?:/([^/]+))?$")
    pods = re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:/([^/]+)/log)?$")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # a streamed log ends when the connection closes

        def log_message(self, *args: Any) -> None:
            pass

        def _json(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _not_found(self, what: str) -> None:
            self._json(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                             "message": f"{what} not found", "code": 404})

        def _query(self) -> dict[str, str]:
            return {k: v[0] for k, v in parse_qs(urlparse(self.path).query).items()}

        def do_POST(self) -> None:
            m = jobsets.match(urlparse(self.path).path)
            if not m or m.group(2):
                return self._not_found(self.path)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            try:
                self._json(201, cluster.create(body))
            except KeyError:
                self._json(409, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                 "reason": "AlreadyExists", "code": 409})

        def do_GET(self) -> None:
            path = urlparse(self.path).path
            if (m := jobsets.match(path)) and m.group(2):
                if m.group(2) not in cluster.jobsets:
                    return self._not_found(f"jobsets {m.group(2)}")
                return self._json(200, cluster.status(m.group(2)))
            if (m := pods.match(path)) and not m.group(2):
                selector = self._query().get("labelSelector", "")
                items = [p.to_json(m.group(1)) for p in list(cluster.pods.values())
                         if _matches({**p.labels, NAME_LABEL: p.jobset}, selector)]
                return self._json(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})
            if (m := pods.match(path)) and m.group(2):
                pod = cluster.pods.get(m.group(2))
                if pod is None:
                    return self._not_found(f"pods {m.group(2)}")
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                sent = 0
                while True:
                    with pod.changed:
                        while sent == len(pod.lines) and pod.exit_code is None and pod.name in cluster.pods:
                            pod.changed.wait(0.5)
                        new, over = pod.lines[sent:], pod.exit_code is not None or pod.name not in cluster.pods
                    for line in new:
                        self.wfile.write((line + "\n").encode())
                    self.wfile.flush()
                    sent += len(new)
                    if over and sent == len(pod.lines):
                        return
                    if self._query().get("follow", "").lower() != "true":
                        return
            return self._not_found(path)

        def do_DELETE(self) -> None:
            m = jobsets.match(urlparse(self.path).path)
            if not m:
                return self._not_found(self.path)
            if m.group(2):
                if m.group(2) not in cluster.jobsets:
                    return self._not_found(f"jobsets {m.group(2)}")
                cluster.delete(m.group(2))
                return self._json(200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})
            selector = self._query().get("labelSelector", "")
            for name, body in list(cluster.jobsets.items()):
                if _matches(body["metadata"].get("labels", {}), selector):
                    cluster.delete(name)
            return self._json(200, {"kind": "JobSetList", "apiVersion": "jobset.x-k8s.io/v1alpha2", "items": []})

    return Handler
