"""infra/ is declarative, so these tests parse every file in it and check it against the code it points at:
prefect.yaml's entrypoints are real Prefect flows, every placeholder of the GPU pool template is declared,
the JobSet's multi-host wiring agrees with itself, the compose stack binds to 127.0.0.1 and checks its
health, the Dockerfile puts the code where prefect.yaml's pull step looks, and no credentials live in a file.
Nothing here needs docker, a cluster or a Prefect server."""

from __future__ import annotations

import asyncio
import datetime as dt
import importlib
import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"

BUCKET = "forgeline-artifacts"
GPU_POOL = "forgeline-gpu"
LOCAL_POOL = "forgeline-cpu"


# -- helpers --------------------------------------------------------------------------------------------

def _yaml_docs(path: Path) -> list[Any]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _prefect_yaml() -> dict:
    return yaml.safe_load((INFRA / "prefect.yaml").read_text())


def _deployment(name: str) -> dict:
    return next(d for d in _prefect_yaml()["deployments"] if d["name"] == name)


def _pull_directory() -> str:
    steps = _prefect_yaml()["pull"]
    dirs = [s["prefect.deployments.steps.set_working_directory"]["directory"]
            for s in steps if "prefect.deployments.steps.set_working_directory" in s]
    assert len(dirs) == 1, steps
    return dirs[0]


def _compose() -> dict:
    return yaml.safe_load((INFRA / "compose.yaml").read_text())


def _pool_template() -> dict:
    return json.loads((INFRA / "work-pools" / "kubernetes-gpu.json").read_text())


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    logical, buf = [], ""
    for line in (INFRA / "Dockerfile").read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue
        buf += line.rstrip()
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        logical.append(buf.strip())
        buf = ""
    out = []
    for line in logical:
        instr, _, args = line.partition(" ")
        out.append((instr.upper(), " ".join(args.split())))
    return out


def _env_list_to_dict(env: list[dict]) -> dict[str, dict]:
    return {e["name"]: e for e in env}


def _walk_strings(obj: Any):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _walk_strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk_strings(v)


# -- every file parses -------------------------------------------------------------------------------------

def test_every_yaml_and_json_in_infra_parses():
    files = sorted(p for p in INFRA.rglob("*") if p.suffix in {".yaml", ".yml", ".json"})
    names = {p.relative_to(INFRA).as_posix() for p in files}
    assert {"prefect.yaml", "compose.yaml", "fsspec.json", "work-pools/kubernetes-gpu.json",
            "jobset/multihost-train.yaml", "jobset/launcher-rbac.yaml", "jobset/checkpoints-claim.yaml",
            "automations/zombie-flow-runs.yaml"} <= names
    for path in files:
        if path.suffix == ".json":
            assert isinstance(json.loads(path.read_text()), dict), path
        else:
            docs = _yaml_docs(path)
            assert docs and all(isinstance(d, dict) for d in docs), path


def test_readme_points_only_at_files_that_exist():
    text = (INFRA / "README.md").read_text()
    referenced = set(re.findall(r"\binfra/[\w./-]+\.(?:yaml|json|md)\b|\binfra/Dockerfile\b", text))
    assert referenced, "README names no infra files"
    missing = sorted(r for r in referenced if not (ROOT / r).exists())
    assert not missing, missing


# -- prefect.yaml against the code --------------------------------------------------------------------------

@pytest.mark.parametrize(("deployment", "module", "attr"), [
    ("release", "flows.release", "release"),
    ("draft-refresh", "flows.draft_refresh", "draft_refresh"),
])
def test_prefect_yaml_entrypoints_are_prefect_flows(deployment, module, attr):
    from prefect import Flow

    dep = _deployment(deployment)
    path, _, func = dep["entrypoint"].partition(":")
    assert (ROOT / path).is_file(), dep["entrypoint"]
    assert func == attr
    assert path.removesuffix(".py").replace("/", ".") == module
    flow = getattr(importlib.import_module(module), func)
    assert isinstance(flow, Flow), f"{dep['entrypoint']} is {type(flow)}, not a Prefect Flow"
    # The deployment's parameters must be accepted by the flow's signature (as the server enforces).
    params = dep.get("parameters", {})
    assert set(params) <= set(flow.parameters.properties), (set(params), set(flow.parameters.properties))
    flow.validate_parameters(params)
    assert params["store"].startswith(f"s3://{BUCKET}/")


def test_every_stage_has_a_deployment_on_its_default_pool():
    """One `stage/<kind>` deployment per registered stage, on the pool its default resources pick, running
    flows/stages.py:stage_flow with no fixed parameters (each run brings its own)."""
    from prefect import Flow

    from flows.stages import stage_flow
    from tasks.configs import ExecutionConfig, ResourcesConfig
    from tasks.registry import STAGES

    stages = {d["name"]: d for d in _prefect_yaml()["deployments"] if d["entrypoint"] == "flows/stages.py:stage_flow"}
    assert set(stages) == set(STAGES)
    assert isinstance(stage_flow, Flow) and stage_flow.name == "stage"
    execution, resources = ExecutionConfig(), ResourcesConfig()
    for kind, dep in stages.items():
        assert dep["work_pool"]["name"] == execution.pool(resources.of(kind)), kind
        assert not dep.get("parameters") and not dep.get("schedules"), kind
    # the orchestrating flows run on the CPU pool, in workers mode
    for name in ("release", "draft-refresh"):
        dep = _deployment(name)
        assert dep["work_pool"]["name"] == LOCAL_POOL and dep["parameters"]["overrides"] == ["execution=workers"]


def test_the_stage_deployments_are_generated_from_the_stage_declarations(tmp_path):
    """infra/prefect.yaml's `stage/<kind>` block is exactly what `python -m flows.deploy --write` writes from
    tasks/configs.py STAGES; `--check` fails on a file where a declared stage lost its deployment."""
    from flows.deploy import main, with_stage_deployments

    text = (INFRA / "prefect.yaml").read_text()
    assert with_stage_deployments(text) == text, "stale: run python -m flows.deploy --write"
    main(["--check"])  # the committed file passes
    stale = tmp_path / "prefect.yaml"
    block = text[text.index("  - name: quantize"):text.index("  - name: traces")]
    stale.write_text(text.replace(block, ""))
    with pytest.raises(SystemExit) as exit_:
        main(["--check", "--file", str(stale)])
    assert exit_.value.code == 1
    main(["--write", "--file", str(stale)])
    assert stale.read_text() == text


def test_every_deployment_has_the_shape_prefect_deploy_needs():
    spec = _prefect_yaml()
    assert spec["pull"], "pull is the one required section"
    names = [d["name"] for d in spec["deployments"]]
    assert len(names) == len(set(names)) and {"release", "draft-refresh"} <= set(names)
    for dep in spec["deployments"]:
        assert re.fullmatch(r"[\w/.-]+\.py:\w+", dep["entrypoint"]), dep["entrypoint"]
        assert dep["work_pool"]["name"], dep["name"]


def test_draft_refresh_runs_weekly_on_a_valid_cron():
    from prefect.schedules import Cron
    from prefect.server.schemas.schedules import CronSchedule

    (sched,) = _deployment("draft-refresh")["schedules"]
    tz = sched.get("timezone", "UTC")
    Cron(sched["cron"], timezone=tz)                         # raises ValueError on an invalid cron string
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)  # a Thursday
    dates = asyncio.run(CronSchedule(cron=sched["cron"], timezone=tz).get_dates(n=3, start=start))
    assert [d.weekday() for d in dates] == [0, 0, 0]           # Mondays
    assert all((d.hour, d.minute) == (3, 0) for d in dates) and tz == "UTC"
    assert [(b - a).days for a, b in zip(dates, dates[1:], strict=False)] == [7, 7]
    assert sched.get("active", True) is True
    # release is triggered, not scheduled
    assert not _deployment("release").get("schedules")


def test_pull_step_directory_is_where_the_image_keeps_the_code():
    directory = _pull_directory()
    instrs = _dockerfile_instructions()
    assert ("WORKDIR", directory) in instrs
    copies = [a for i, a in instrs if i == "COPY"]
    assert f". {directory}" in copies, copies
    assert any(i == "RUN" and f"pip install {directory}" in a for i, a in instrs)
    # entrypoints resolve relative to that directory, and the image copies the whole repository there
    for dep in _prefect_yaml()["deployments"]:
        assert (ROOT / dep["entrypoint"].partition(":")[0]).is_file()


# -- Dockerfile --------------------------------------------------------------------------------------------

def test_dockerfile_installs_the_project_as_a_non_root_python_312_image():
    instrs = _dockerfile_instructions()
    args = {a.split("=", 1)[0]: (a.split("=", 1)[1] if "=" in a else None) for i, a in instrs if i == "ARG"}
    (base,) = [a for i, a in instrs if i == "FROM"]
    assert base.replace("${PYTHON_VERSION}", args.get("PYTHON_VERSION") or "") == "python:3.12-slim"
    env = " ".join(a for i, a in instrs if i == "ENV")
    for setting in ("PYTHONUNBUFFERED=1", "PREFECT_SERVER_ANALYTICS_ENABLED=false"):
        assert setting in env, setting
    users = [a for i, a in instrs if i == "USER"]
    assert users and users[-1] not in {"root", "0"}, users
    # JAX: CPU by default, jax[cuda12] when JAX_EXTRAS=cuda12, pinned to the fleet's 0.11
    assert args["JAX_EXTRAS"] in ('""', "''", "")
    assert args["JAX_VERSION"].startswith("0.11")
    spec = next(m.group(0) for i, a in instrs if i == "RUN"
                for m in [re.search(r'"jax\$\{JAX_EXTRAS[^"]*"', a)] if m)
    def render(extras: str) -> str:
        out = subprocess.run(["sh", "-c", f"echo {spec}"], capture_output=True, text=True, check=True,
                             env={"JAX_EXTRAS": extras, "JAX_VERSION": args["JAX_VERSION"]})
        return out.stdout.strip()
    assert render("") == f"jax=={args['JAX_VERSION']}"
    assert render("cuda12") == f"jax[cuda12]=={args['JAX_VERSION']}"
    # Whatever the image copies must be a package the project declares (and the console script exists).
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    from setuptools import find_packages

    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    found = set(find_packages(str(ROOT), include=include))
    # the top-level packages with every subpackage (a wheel once shipped without models.quant, tasks.training)
    assert found >= {"flows", "tasks", "models", "storage", "models.quant", "models.quant.formats", "models.presets",
                     "models.eagle3", "tasks.training", "tasks.data"}, found
    assert not {p for p in found if p.split(".")[0] in {"tests", "benchmarks"}}, found
    assert project["project"]["scripts"]["forgeline"] == "flows.cli:main"
    assert args["PREFECT_VERSION"] == _prefect_yaml()["prefect-version"]


def test_dockerignore_keeps_local_state_out_of_the_build_context():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "artifacts"} <= ignored
    # but never the code the image installs
    assert not ignored & {"flows", "tasks", "models", "storage", "pyproject.toml", "infra", "."}


# -- compose -------------------------------------------------------------------------------------------------

def test_compose_services_bind_to_localhost_and_have_healthchecks():
    services = _compose()["services"]
    assert set(services) >= {"postgres", "prefect-server", "seaweedfs", "worker"}
    published = {}
    for name, svc in services.items():
        hc = svc.get("healthcheck")
        assert hc and hc.get("test") and not hc.get("disable"), f"{name} has no healthcheck"
        for port in svc.get("ports", []):
            assert isinstance(port, str) and port.startswith("127.0.0.1:"), f"{name}: {port!r} not on 127.0.0.1"
            published[name] = published.get(name, []) + [port.rsplit(":", 1)[-1]]
        assert svc.get("network_mode") != "host", name
    assert published["prefect-server"] == ["4200"] and published["seaweedfs"] == ["8333"]
    assert "ports" not in services["worker"]
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert cond == {"condition": "service_healthy"}, (name, dep)


def test_compose_prefect_server_runs_on_postgres_with_analytics_off():
    services = _compose()["services"]
    pg = services["postgres"]
    assert pg["image"].split(":")[1].startswith("16")
    assert "pg_isready" in " ".join(pg["healthcheck"]["test"])
    server = services["prefect-server"]
    env = server["environment"]
    url = env["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert url.startswith("postgresql+asyncpg://") and "@postgres:5432/" in url
    assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    assert env["PREFECT_UI_API_URL"] == "http://127.0.0.1:4200/api"
    assert server["image"].startswith("prefecthq/prefect:")
    assert "${PREFECT_VERSION:-" + _prefect_yaml()["prefect-version"] + "}" in server["image"]
    assert server["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert "/api/health" in " ".join(server["healthcheck"]["test"])


def test_compose_seaweedfs_serves_the_artifact_bucket_on_8333():
    sw = _compose()["services"]["seaweedfs"]
    assert sw["image"].startswith("chrislusf/seaweedfs:")
    cmd = sw["command"]
    assert cmd[0] == "mini" and f"-bucket={BUCKET}" in cmd and "-s3.port=8333" in cmd
    assert "-master.telemetry=false" in cmd
    assert "8333" in " ".join(sw["healthcheck"]["test"])


def test_compose_worker_is_built_from_the_dockerfile_and_points_at_the_stack():
    worker = _compose()["services"]["worker"]
    build = worker["build"]
    assert (INFRA / build["context"]).resolve() == ROOT
    assert build["dockerfile"] == "infra/Dockerfile" and (ROOT / build["dockerfile"]).is_file()
    cmd = worker["command"]
    assert cmd[:3] == ["prefect", "worker", "start"]
    pool = cmd[cmd.index("--pool") + 1]
    assert pool in (LOCAL_POOL, "${FORGELINE_WORK_POOL:-" + LOCAL_POOL + "}")
    assert cmd[cmd.index("--type") + 1] == "process"
    env = worker["environment"]
    assert env["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert env["AWS_ENDPOINT_URL"] == "http://seaweedfs:8333"
    assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    assert set(worker["depends_on"]) == {"prefect-server", "seaweedfs"}


def test_compose_keeps_credentials_out_of_the_file():
    services = _compose()["services"]
    secret_vars = {"POSTGRES_PASSWORD", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    seen = 0
    for name, svc in services.items():
        for var, value in (svc.get("environment") or {}).items():
            if var in secret_vars:
                seen += 1
                assert re.fullmatch(r"\$\{\w+(:?\?[^}]*)?\}", str(value)), f"{name}.{var} is hard-coded"
    assert seen == 5  # postgres password, SeaweedFS' and the worker's key pairs
    url = services["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert re.search(r"prefect:\$\{POSTGRES_PASSWORD[^}]*\}@", url)


# -- Kubernetes GPU work-pool template -----------------------------------------------------------------------

def test_pool_template_is_accepted_by_prefect():
    from prefect.server.schemas.actions import WorkPoolCreate

    WorkPoolCreate(name=GPU_POOL, type="kubernetes", base_job_template=_pool_template())


def test_pool_template_placeholders_and_variables_match_one_to_one():
    from prefect.utilities.templating import find_placeholders

    tpl = _pool_template()
    assert set(tpl) == {"job_configuration", "variables"}
    placeholders = find_placeholders(tpl["job_configuration"])
    assert all(p.type.value == "standard" for p in placeholders), placeholders
    used = {p.name for p in placeholders}
    declared = set(tpl["variables"]["properties"])
    assert used <= declared, f"undeclared placeholders: {used - declared}"
    assert declared <= used, f"variables that take no effect: {declared - used}"
    assert {"image", "gpu_count", "node_selector", "tolerations", "active_deadline_seconds",
            "env", "cpu", "memory"} <= declared


def test_pool_template_variables_are_a_valid_schema_with_valid_defaults():
    variables = _pool_template()["variables"]
    jsonschema.Draft7Validator.check_schema(variables)
    for prop in variables["properties"].values():
        if "default" in prop and "$ref" not in json.dumps(prop):
            jsonschema.validate(prop["default"], prop)
    props = variables["properties"]
    assert props["gpu_count"]["type"] == "integer" and props["gpu_count"]["default"] >= 1
    assert props["active_deadline_seconds"]["type"] == "integer"
    assert props["node_selector"]["type"] == "object" and props["tolerations"]["type"] == "array"
    assert any(t.get("key") == "nvidia.com/gpu" for t in props["tolerations"]["default"])


def _render(values: dict) -> dict:
    """What a worker does first: the variables' defaults overlaid with job variables, applied to the
    template (prefect.workers.base.BaseJobConfiguration.from_template_and_values, minus block lookups)."""
    from prefect.utilities.templating import apply_values

    tpl = _pool_template()
    defaults = {k: v["default"] for k, v in tpl["variables"]["properties"].items() if "default" in v}
    return apply_values(tpl["job_configuration"], {**defaults, **values})


def test_pool_template_renders_a_gpu_job():
    cfg = _render({"gpu_count": 8, "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
                   "image": "registry.example.com/forgeline:cuda12", "active_deadline_seconds": 3600})
    job = cfg["job_manifest"]
    assert job["apiVersion"] == "batch/v1" and job["kind"] == "Job"
    assert job["spec"]["activeDeadlineSeconds"] == 3600
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["image"] == "registry.example.com/forgeline:cuda12"
    for kind in ("limits", "requests"):
        res = container["resources"][kind]
        assert res["nvidia.com/gpu"] == 8 and isinstance(res["nvidia.com/gpu"], int)
        assert res["cpu"] == "16" and res["memory"] == "128Gi"
    assert isinstance(cfg["env"], dict) and cfg["env"]["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/dev/shm", "/scratch"} <= mounts
    assert pod["securityContext"]["runAsNonRoot"] is True
    # nothing left unrendered
    assert not [s for s in _walk_strings(cfg) if "{{" in s]


def test_deployments_job_variables_fit_the_gpu_pool_schema():
    schema = _pool_template()["variables"]
    for dep in _prefect_yaml()["deployments"]:
        if dep["work_pool"]["name"] != GPU_POOL:
            continue
        jv = dep["work_pool"].get("job_variables", {})
        jv = json.loads(re.sub(r"\{\{\s*\$FORGELINE_IMAGE\s*\}\}", "registry.example.com/forgeline:cuda12",
                               json.dumps(jv)))
        assert set(jv) <= set(schema["properties"]), set(jv) - set(schema["properties"])
        jsonschema.validate(jv, schema)
        assert not [s for s in _walk_strings(jv) if "{{" in s], dep["name"]


def test_pool_template_with_the_real_kubernetes_worker():
    """prefect-kubernetes (in the test extra, as on a Kubernetes worker's image): the worker's own
    rendering, env merge and validation of the manifest."""
    import uuid

    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    # from_template_and_values minus its block/variable resolution (which needs a server; the template has
    # neither): defaults' env merged with the job variables' env, as the worker does.
    defaults_env = _pool_template()["variables"]["properties"]["env"]["default"]
    rendered = _render({"image": "forgeline:cuda12", "gpu_count": 2})
    rendered["env"] = {**defaults_env, "EXTRA": "1"}
    cfg = KubernetesWorkerJobConfiguration(**rendered)
    cfg.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="t", flow_id=uuid.uuid4()))
    (container,) = cfg.job_manifest["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["EXTRA"] == "1" and env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "60"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2


# -- JobSet ------------------------------------------------------------------------------------------------------

def _header_command(path: Path) -> list[str]:
    """The `forgeline jobset ...` command a rendered example's header says produced it, as argv."""
    lines = [ln[1:].strip() for ln in path.read_text().splitlines() if ln.startswith("#")]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("forgeline jobset"))
    command = []
    for ln in lines[start:]:
        command.append(ln.rstrip("\\").strip())
        if not ln.endswith("\\"):
            break
    return shlex.split(" ".join(command))[2:]


def test_the_jobset_example_is_what_forgeline_renders_for_its_command():
    """infra/jobset/multihost-train.yaml is the output of the command in its header, so it cannot drift
    from what a release creates."""
    from typer.testing import CliRunner

    from flows.cli import app

    path = INFRA / "jobset" / "multihost-train.yaml"
    result = CliRunner().invoke(app, ["jobset", *_header_command(path)])
    assert result.exit_code == 0, result.output
    assert _yaml_docs(path) == [yaml.safe_load(result.output)]
    (js,) = _yaml_docs(path)
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][:3] == ["python", "-m", "tasks.member"]
    assert callable(importlib.import_module("tasks.member").main)
    env = _env_list_to_dict(container["env"])
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & set(env)  # credentials come from a Secret
    assert container["envFrom"][0]["secretRef"]["name"] == "forgeline-s3"


def test_the_jobset_checkpoints_into_the_shared_claim_infra_declares():
    (js,) = _yaml_docs(INFRA / "jobset" / "multihost-train.yaml")
    (claim,) = _yaml_docs(INFRA / "jobset" / "checkpoints-claim.yaml")
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (container,) = pod["containers"]
    root = _env_list_to_dict(container["env"])["FORGELINE_CHECKPOINT_ROOT"]["value"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == root]
    assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert "ReadWriteMany" in claim["spec"]["accessModes"]


def test_the_launcher_account_may_do_what_the_launcher_does_and_no_more():
    """The calls flows/jobset.py makes, read from its source, against the Role in launcher-rbac.yaml."""
    import inspect

    from flows import jobset
    from tasks.configs import KubernetesGangConfig

    docs = {d["kind"]: d for d in _yaml_docs(INFRA / "jobset" / "launcher-rbac.yaml")}
    assert docs["ServiceAccount"]["metadata"]["name"] == KubernetesGangConfig().launcher_service_account
    assert docs["RoleBinding"]["subjects"][0]["name"] == docs["ServiceAccount"]["metadata"]["name"]
    granted = {(g, r, v) for rule in docs["Role"]["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    source = inspect.getsource(jobset.KubeGang)
    verbs = {"create_namespaced_custom_object": ("jobset.x-k8s.io", "jobsets", "create"),
             "get_namespaced_custom_object": ("jobset.x-k8s.io", "jobsets", "get"),
             "delete_namespaced_custom_object": ("jobset.x-k8s.io", "jobsets", "delete"),
             "delete_collection_namespaced_custom_object": ("jobset.x-k8s.io", "jobsets", "deletecollection"),
             "list_namespaced_pod": ("", "pods", "list"),
             "read_namespaced_pod_log": ("", "pods/log", "get")}
    used = {need for call, need in verbs.items() if re.search(rf"\.{call}\(", source)}
    calls = set(re.findall(r"(?:custom|core)\.(\w+)\(", source))
    assert calls <= set(verbs), calls - set(verbs)  # a new call needs its line above, and a rule
    assert used == granted, (used ^ granted)


# -- fsspec config ---------------------------------------------------------------------------------------------

def test_fsspec_config_sets_the_local_s3_endpoint_and_no_credentials():
    import fsspec.config
    import s3fs

    conf = json.loads((INFRA / "fsspec.json").read_text())
    assert set(conf) == {"s3"}
    assert conf["s3"]["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:8333"
    forbidden = re.compile(r"key|secret|token|password|credential", re.I)

    def keys(obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield k
                yield from keys(v)
    assert not [k for k in keys(conf) if forbidden.search(k)]
    # fsspec loads every *.json / *.ini in FSSPEC_CONFIG_DIR: infra/ must hold no other config file
    assert [p.name for p in INFRA.iterdir() if p.suffix in {".json", ".ini"}] == ["fsspec.json"]
    loaded: dict = {}
    fsspec.config.set_conf_files(str(INFRA), loaded)
    kwargs = fsspec.config.apply_config(s3fs.S3FileSystem, {}, conf_dict=loaded)
    assert kwargs["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:8333"
    # the same port the compose stack publishes
    assert "127.0.0.1:8333:8333" in _compose()["services"]["seaweedfs"]["ports"]


# -- automations -----------------------------------------------------------------------------------------------

def test_zombie_automation_is_valid_and_outlasts_the_heartbeat():
    from prefect.events.schemas.automations import AutomationCore

    (auto,) = yaml.safe_load((INFRA / "automations" / "zombie-flow-runs.yaml").read_text())["automations"]
    model = AutomationCore.model_validate(auto)
    trig = model.trigger
    assert trig.posture.value == "Proactive"
    assert trig.after == {"prefect.flow-run.heartbeat"}
    assert {"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
            "prefect.flow-run.Crashed", "prefect.flow-run.Cancelled"} <= trig.expect
    assert [a.type for a in model.actions] == ["change-flow-run-state"]
    assert model.actions[0].state.value == "CRASHED"
    # the window must span several heartbeats of every process that runs flows
    worker_freq = int(_compose()["services"]["worker"]["environment"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"])
    pool_freq = int(_pool_template()["variables"]["properties"]["env"]["default"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"])
    assert trig.within.total_seconds() >= 3 * max(worker_freq, pool_freq)
