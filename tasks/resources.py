"""Where a stage runs: its resources (`resources.<stage>` of a recipe), how a release's stages are executed
(`execution`), and where a multi-host stage's JobSet goes on Kubernetes. None of it is part of any
fingerprint: a stage committed by one mode or pool is reused by the other.

JAX-free, like every schema (tasks/configs.py re-exports these names).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StageResources(BaseModel):
    """What one run of a stage needs, and where it runs (workers execution only: never part of a fingerprint).

    Mapped onto the work pool's job variables by flows/execution.py: on a Kubernetes pool `accelerators` is
    the container's `nvidia.com/gpu`, `memory_gib` its memory, `node_selector`/`tolerations`/`image` the pod's;
    on a process pool (one machine) only `hosts` and the environment apply.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    accelerators: int = Field(0, ge=0, le=64)  # GPUs per host; 0: a CPU node
    hosts: int = Field(1, ge=1, le=4096)  # > 1: the stage runs as one gang of `hosts` JAX processes
    memory_gib: int | None = Field(None, ge=1)
    # memory of one accelerator: the capacity planner checks the fine-tune against it before a release starts
    accelerator_memory_gib: float | None = Field(None, gt=0)
    cpus: int | None = Field(None, ge=1)
    pool: str | None = None  # the work pool; None: execution.gpu_pool or execution.cpu_pool by `accelerators`
    image: str | None = None
    node_selector: dict[str, str] = {}
    tolerations: tuple[dict[str, Any], ...] = ()


CPU, GPU = StageResources(), StageResources(accelerators=1)  # a stage's default resources


class KubernetesGangConfig(BaseModel):
    """Where a multi-host stage's JobSet goes when its pool is a Kubernetes pool (flows/jobset.py)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # None: the launcher pod's own namespace (its service account's), "default" outside a cluster.
    namespace: str | None = None
    # The gang's image when `resources.<stage>.image` is unset: infra/Dockerfile built with JAX_EXTRAS=cuda12.
    image: str = "forgeline:cuda12"
    # A ReadWriteMany volume claim every host mounts for the stage's checkpoints: orbax writes a multi-host
    # checkpoint into one folder shared by all processes. Required for a multi-host training stage.
    checkpoint_claim: str | None = None
    # A Secret with the store's credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL ...),
    # loaded into every host's environment.
    secret: str | None = "forgeline-s3"
    service_account: str | None = None  # the gang's pods' (they need no Kubernetes API access)
    # The launcher's (the stage's flow run pod): creates, watches, deletes the JobSet (infra/jobset/launcher-rbac.yaml)
    launcher_service_account: str | None = "forgeline-launcher"
    coordinator_port: int = Field(8476, ge=1024, le=65535)
    shm_gib: int = Field(64, ge=1)  # /dev/shm (NCCL, data loaders)
    scratch_gib: int = Field(512, ge=1)  # each host's local copy of the inputs and outputs


class ExecutionConfig(BaseModel):
    """How a release's stages are run: `inline` (every stage in the flow's own process, one after the other)
    or `workers` (each stage a flow run of its own deployment on a work pool, independent stages at once)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["inline", "workers"] = "inline"
    gpu_pool: str = "forgeline-gpu"
    cpu_pool: str = "forgeline-cpu"
    # How long the orchestrator waits for one stage's flow run to end (a multi-day training stage needs more).
    stage_timeout_s: int = Field(7 * 24 * 3600, ge=10)
    # A stage run that ends Crashed (its worker died) is launched again this many times; it resumes from its
    # checkpoints. Failed runs (a bad input, a diverged loss) are not retried.
    crash_retries: int = Field(2, ge=0, le=10)
    # Multi-host stages on a Kubernetes pool run as a JobSet (flows/jobset.py).
    kubernetes: KubernetesGangConfig = KubernetesGangConfig()

    def pool(self, resources: StageResources) -> str:
        return resources.pool or (self.gpu_pool if resources.accelerators else self.cpu_pool)
