"""Execution settings (flows/execution.py, tasks/configs.py): where a stage runs never changes what it computes,
and the resource hints become job variables the GPU pool's template and the Kubernetes worker accept."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import jsonschema
import pytest

from flows.execution import gpu_limit_name, idempotency_key, job_variables
from storage import ArtifactRef
from tasks import registry
from tasks.configs import ExecutionConfig, ResourcesConfig, StageResources
from tasks.recipe import ConfigError, load_release

pytestmark = pytest.mark.unit

TEMPLATE = json.loads((Path(__file__).resolve().parents[2] / "infra/work-pools/kubernetes-gpu.json").read_text())

WHERE = ["execution.mode=workers", "resources.finetune.hosts=4", "resources.finetune.accelerators=8",
         "resources.quantize.pool=forgeline-h100", "resources.export.memory_gib=64", "execution.crash_retries=5"]


def test_execution_and_resources_parse_from_a_recipe_and_the_command_line():
    cfg = load_release("tiny", WHERE)
    assert cfg.execution.mode == "workers" and cfg.execution.crash_retries == 5
    assert cfg.resources.finetune == StageResources(accelerators=8, hosts=4)
    assert cfg.execution.pool(cfg.resources.quantize) == "forgeline-h100"
    assert cfg.execution.pool(cfg.resources.export) == "forgeline-cpu"  # no GPU: the CPU pool
    assert cfg.execution.pool(cfg.resources.draft) == "forgeline-gpu"
    assert load_release("tiny", ["execution.mode=workers"]).execution.mode == "workers"
    with pytest.raises(ConfigError, match="execution.mode"):
        load_release("tiny", ["execution=everywhere"])
    with pytest.raises(ConfigError, match="unknown key 'resources.finetune.gpus'"):
        load_release("tiny", ["resources.finetune.gpus=8"])
    with pytest.raises(ConfigError, match="resources.finetune.hosts"):
        load_release("tiny", ["resources.finetune.hosts=0"])


def test_the_execution_shorthand_merges_with_execution_keys(tmp_path):
    """`execution: workers` (a recipe's line or a --set) is `execution.mode`: stated next to other execution
    keys, from the recipe or the command line, both hold."""
    cfg = load_release("tiny", ["execution=workers", "execution.crash_retries=5"])
    assert (cfg.execution.mode, cfg.execution.crash_retries) == ("workers", 5)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("extends: tiny\nexecution: workers\n")
    cfg = load_release(str(recipe), ["execution.gpu_pool=h200"])
    assert (cfg.execution.mode, cfg.execution.gpu_pool) == ("workers", "h200")
    recipe.write_text("extends: tiny\nexecution: {gpu_pool: h200, crash_retries: 4}\n")
    cfg = load_release(str(recipe), ["execution=workers"])
    assert (cfg.execution.mode, cfg.execution.gpu_pool, cfg.execution.crash_retries) == ("workers", "h200", 4)


def test_every_stage_has_resources_and_cpu_stages_ask_for_no_gpu():
    assert set(ResourcesConfig.model_fields) == set(registry.STAGES)
    res = ResourcesConfig()
    assert {k for k in registry.STAGES if res.of(k).accelerators == 0} == {"data_prep", "export"}


def test_where_a_stage_runs_is_not_part_of_what_it_computes():
    """The recorded recipe (export's config) and every stage's fingerprint are the same in both modes, so a
    stage committed by one mode is reused by the other."""
    inline, workers = load_release("tiny"), load_release("tiny", WHERE)
    assert inline.recorded() == workers.recorded()
    assert "execution" not in inline.recorded() and "resources" not in inline.recorded()
    ref = ArtifactRef(url="file:///store/x/0123", kind="x", fingerprint="0123", digest="ab" * 32)
    for kind, section in (("finetune", "finetune"), ("quantize", "quantize"), ("data_prep", "data")):
        inputs = {n: ref for n in registry.stage(kind).inputs}
        assert registry.fingerprint(kind, getattr(inline, section), inputs) == \
            registry.fingerprint(kind, getattr(workers, section), inputs)


def test_idempotency_keys_name_the_stage_its_store_and_the_attempt():
    a = idempotency_key("finetune", "f" * 20, "s3://b/releases", 0)
    assert a == idempotency_key("finetune", "f" * 20, "s3://b/releases", 0)  # a retried orchestrator re-attaches
    assert a != idempotency_key("finetune", "f" * 20, "s3://b/other", 0)
    assert a != idempotency_key("finetune", "f" * 20, "s3://b/releases", 1)  # after a crash: a new run
    assert a.startswith("forgeline-finetune-" + "f" * 20)
    assert gpu_limit_name("forgeline-gpu") == "gpu-forgeline-gpu"


def test_resources_become_job_variables_the_gpu_pool_accepts():
    schema = TEMPLATE["variables"]
    gpu = StageResources(accelerators=8, memory_gib=1600, cpus=96, image="registry.example.com/fl:1",
                         node_selector={"nvidia.com/gpu.product": "NVIDIA-H200"},
                         tolerations=({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},))
    cases = [gpu, StageResources(), StageResources(accelerators=1)]
    for res in cases:
        jv = job_variables(res, "kubernetes")
        assert set(jv) <= set(schema["properties"]), set(jv) - set(schema["properties"])
        jsonschema.validate(jv, schema)
        assert jv["gpu_count"] == res.accelerators
    jv = job_variables(gpu, "kubernetes")
    assert jv == {"gpu_count": 8, "memory": "1600Gi", "cpu": "96", "image": "registry.example.com/fl:1",
                  "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
                  "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}
    assert job_variables(gpu, "process") == {}  # one machine: nothing to request
    assert "memory" not in job_variables(StageResources(accelerators=1), "kubernetes")  # the pool's default stays


def test_the_kubernetes_worker_renders_a_stage_job_from_the_hints():
    """prefect-kubernetes' own job configuration model, on the template with a stage's job variables."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.utilities.templating import apply_values
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    res = StageResources(accelerators=4, memory_gib=512, node_selector={"pool": "h200"}, image="img:2")
    defaults = {k: v["default"] for k, v in TEMPLATE["variables"]["properties"].items() if "default" in v}
    rendered = apply_values(TEMPLATE["job_configuration"], {**defaults, **job_variables(res, "kubernetes")})
    cfg = KubernetesWorkerJobConfiguration(**rendered)
    cfg.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="finetune", flow_id=uuid.uuid4()))
    pod = cfg.job_manifest["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "img:2" and pod["nodeSelector"] == {"pool": "h200"}
    for kind in ("requests", "limits"):
        assert container["resources"][kind]["nvidia.com/gpu"] == 4
        assert container["resources"][kind]["memory"] == "512Gi"
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])  # the pool's default toleration


def test_execution_defaults_are_inline_and_two_crash_retries():
    cfg = ExecutionConfig()
    assert cfg.mode == "inline" and cfg.crash_retries == 2 and cfg.gpu_pool == "forgeline-gpu"


def test_a_config_is_the_same_whatever_order_its_keys_arrived_in():
    """Prefect parameters stored as PostgreSQL JSONB come back with their keys reordered; the typed config, and
    so every file a stage writes from it (export's lineage.json), must not notice."""
    export = registry.stage("export")
    a = export.parse({"name": "r", "recipe": {"base": {"url": None, "data": {"seed": 0, "corpus": "c"}}, "serve": "x"}})
    b = export.parse({"recipe": {"serve": "x", "base": {"data": {"corpus": "c", "seed": 0}, "url": None}}, "name": "r"})
    assert json.dumps(a.model_dump(mode="json")) == json.dumps(b.model_dump(mode="json"))
