"""Workers mode on the local stack: `forgeline stack up` (PostgreSQL, a Prefect server on it, SeaweedFS, process
workers), then the smoke release with `execution: workers`, one of whose GPU workers is SIGKILLed in the middle
of the fine-tune. Checked through the Prefect API and the store: every stage ran as its own flow run of its
`stage/<kind>` deployment on a worker (never in the orchestrator's process); the killed fine-tune was marked
Crashed by the zombie automation, started again on another worker and resumed from its checkpoint; quantize and
traces ran at the same time; and the bundle is the inline run's, byte for byte. And on the same stack: every
server it started (the Prefect API, PostgreSQL, S3) refuses a caller without the stack's generated credentials,
and no command line or log shows them."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from datetime import datetime
from pathlib import Path
from urllib.parse import quote

import asyncpg
import pytest

import storage
from flows.stack import PG_CREDENTIALS, free_port, postgres_dir
from storage import Store
from tests.conftest import ROOT, SMOKE
from tests.s3_server import exported

# two smoke releases (on workers with a worker killed, and inline beside it): past pytest's 900 s default on a slow
# machine
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800)]

# serve=finetuned: the draft learns the fine-tuned model, so traces need not wait for quantize. One draft candidate
# without τ selection: this test is about where stages run; the draft stage's candidates and selection run the same
# in either mode (tests/unit/test_draft.py, test_release_flow.py, test_default_release.py).
# finetune.train.checkpoint_every: the smoke recipe's 10 fine-tune steps ran out within the test's poll once programs
# came from the run's compilation cache, so the worker died after the last checkpoint and the rerun had nothing to
# train. A checkpoint after every step (the same training: a longer fine-tune fails the smoke gates) and a faster
# poll land the kill mid-training, as the test means.
FINETUNE_STEPS = 10  # tests/recipes/smoke.yaml
OVERRIDES = [
    "--set",
    "serve=finetuned",
    "--set",
    "draft.candidates=[{kind: eagle3}]",
    "--set",
    "draft.select_every=0",
    "--set",
    "finetune.train.checkpoint_every=1",
]
STAGE_NAMES = {"data_prep[base]", "base", "data_prep", "finetune", "quantize", "traces", "draft", "evaluate", "export"}


def _clean_env() -> dict[str, str]:
    """This process's environment without a Prefect server or S3 endpoint another fixture exported."""
    drop = ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING", "AWS_")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


def _cli(*args: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(stack dir, the environment the exports describe, state): `forgeline stack up` with three one-GPU
    workers (one is killed, two remain for quantize and traces) and a 90 s zombie window: three heartbeat
    periods, so that a loaded CI machine delaying a heartbeat does not crash a healthy run."""
    root = tmp_path_factory.mktemp("stack")
    t0 = time.monotonic()
    up = _cli(
        "stack",
        "up",
        "--dir",
        str(root),
        "--gpu-workers",
        "3",
        "--cpu-workers",
        "1",
        "--port",
        str(free_port()),
        "--pg-port",
        str(free_port()),
        "--zombie-after",
        "90",
        env=_clean_env(),
        timeout=400,
    )
    assert up.returncode == 0, up.stderr[-3000:]
    seconds = time.monotonic() - t0
    exports = dict(
        line.removeprefix("export ").split("=", 1) for line in up.stdout.splitlines() if line.startswith("export ")
    )
    assert set(exports) >= {
        "PREFECT_API_URL",
        "PREFECT_API_AUTH_STRING",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_ENDPOINT_URL",
    }
    state = json.loads((root / "stack.json").read_text())
    try:
        yield root, {**_clean_env(), **exports}, state, seconds, up.stdout
    finally:
        down = _cli("stack", "down", "--dir", str(root), "--purge", env=_clean_env(), timeout=180)
        assert down.returncode == 0, down.stderr[-2000:]
        pids = [w["pid"] for w in state["workers"]] + [state["prefect"]["pid"], state["s3"]["pid"]]
        left = [
            p
            for p in pids
            if Path(f"/proc/{p}").exists() and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        ]
        assert not left, f"still running after `stack down`: {left}"
        assert "PostgreSQL" in down.stdout and "data deleted" in down.stdout
        assert not Path(state["postgres"]["pgdata"]).exists()


def _client(env):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    class _Ctx:
        def __enter__(self):
            self.settings = temporary_settings(
                {PREFECT_API_URL: env["PREFECT_API_URL"], PREFECT_API_AUTH_STRING: env["PREFECT_API_AUTH_STRING"]}
            )
            self.settings.__enter__()
            self.client = get_client(sync_client=True)
            return self.client.__enter__()

        def __exit__(self, *exc):
            self.client.__exit__(*exc)
            self.settings.__exit__(*exc)

    return _Ctx()


def _stage_runs(env) -> list:
    """Every flow run of the `stage` flow on the server."""
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with _client(env) as client:
        return client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["stage"])), limit=200)


def _checkpointed(env, store: str) -> bool:
    with exported({k: v for k, v in env.items() if k.startswith("AWS_")}):
        try:
            files = storage.list_files(storage.join(store, "checkpoints/finetune"))
        except FileNotFoundError:
            return False
    return any(u.endswith("latest.json") for u in files)


def _kill_the_finetune_worker(env, state) -> tuple[str, int]:
    """SIGKILL the worker running the fine-tune, and the run's own process with it (the node died)."""
    running = [r for r in _stage_runs(env) if r.name == "finetune" and r.state.is_running()]
    assert running, [(r.name, r.state.name) for r in _stage_runs(env)]
    run = running[0]
    name = run.labels["prefect.worker.name"]
    (worker,) = [w for w in state["workers"] if w["name"] == name]
    os.killpg(worker["pid"], signal.SIGKILL)
    try:
        os.kill(int(str(run.infrastructure_pid).rsplit(":", 1)[-1]), signal.SIGKILL)
    except ProcessLookupError:
        pass  # it was in the worker's process group
    return name, worker["pid"]


def _read(env, url: str) -> bytes:
    with exported({k: v for k, v in env.items() if k.startswith("AWS_")}):
        return storage.read_bytes(url)


def _parent_flow_runs(env, runs) -> list:
    """The flow run each child run's parent task run belongs to (the release's, for every stage)."""
    with _client(env) as client:
        return [client.read_task_run(r.parent_task_run_id).flow_run_id for r in runs]


def _differences(env, a: str, b: str) -> list[str]:
    """Which committed files differ between two stores (the diagnosis when two bundles do)."""
    with exported({k: v for k, v in env.items() if k.startswith("AWS_")}):

        def manifests(root: str) -> dict:
            out = {}
            for kind in ("data_prep", "base", "finetune", "quantize", "traces", "draft", "evaluate", "export"):
                try:
                    fps = {u.rsplit("/", 2)[-2] for u in storage.list_files(storage.join(root, kind))}
                except FileNotFoundError:
                    continue
                for fp in fps:
                    try:
                        m = json.loads(storage.read_bytes(storage.join(root, kind, fp, "manifest.json")))
                    except FileNotFoundError:
                        continue
                    out[(kind, fp)] = {f: v["sha256"] for f, v in m["files"].items()}
            return out

        ma, mb = manifests(a), manifests(b)
    out = [f"only in one store: {k}" for k in sorted(set(ma) ^ set(mb))]
    for k in sorted(set(ma) & set(mb)):
        out += [f"{k[0]}/{k[1]}/{f}" for f in sorted(set(ma[k]) | set(mb[k])) if ma[k].get(f) != mb[k].get(f)]
    if any(d.endswith("lineage.json") for d in out):
        for k in ma:
            if k[0] == "export":
                la = json.loads(_read(env, storage.join(a, "export", k[1], "lineage.json")))
                lb = json.loads(_read(env, storage.join(b, "export", k[1], "lineage.json")))
                out.append(f"lineage equal as JSON: {la == lb}; keys {list(la)} vs {list(lb)}")
    return out


def _bundle(env, url: str):
    with exported({k: v for k, v in env.items() if k.startswith("AWS_")}):
        return Store(url.rsplit("/export/", 1)[0]).load(url)


def _api_status(api_url: str, auth: str | None) -> int:
    """The HTTP status of a read of the flow runs, with `auth` as HTTP basic auth (Prefect's auth string)."""
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    request = urllib.request.Request(f"{api_url}/flow_runs/filter", data=b"{}", headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_every_server_of_the_stack_wants_its_generated_credentials(stack):
    """What the stack started lets in only the holder of its generated credentials, which no command line and
    no log shows: the Prefect API (a flow run created there is a command the workers run as the stack's user),
    PostgreSQL (over 127.0.0.1), the S3 API; the files that hold them are 0600."""
    root, env, state, _, _ = stack
    api = env["PREFECT_API_URL"]
    auth = env["PREFECT_API_AUTH_STRING"]
    assert _api_status(api, None) == 401
    assert _api_status(api, auth.split(":")[0] + ":not-the-password") == 401
    assert _api_status(api, auth) == 200

    password = json.loads((root / PG_CREDENTIALS).read_text())["password"]
    port = state["postgres"]["port"]

    async def pg(secret):
        conn = await asyncpg.connect(
            host="127.0.0.1",
            port=port,
            user="postgres",
            database="prefect",
            password=secret,
            passfile="/nonexistent",
            timeout=20,
        )
        try:
            return await conn.fetchval("SELECT count(*) FROM flow_run")  # Prefect's own table
        finally:
            await conn.close()

    for wrong in ("", "not-the-password"):
        with pytest.raises(asyncpg.InvalidPasswordError):
            asyncio.run(pg(wrong))
    assert asyncio.run(pg(password)) >= 0
    # the Prefect server reaches the database with it, from its environment
    server_env = dict(
        kv.split(b"=", 1)
        for kv in Path(f"/proc/{state['prefect']['pid']}/environ").read_bytes().split(b"\0")
        if b"=" in kv
    )
    db_url = server_env[b"PREFECT_SERVER_DATABASE_CONNECTION_URL"].decode()
    assert db_url.startswith(f"postgresql+asyncpg://postgres:{quote(password, safe='')}@127.0.0.1:{port}/")

    with pytest.raises(urllib.error.HTTPError) as anonymous:
        urllib.request.urlopen(f"{env['AWS_ENDPOINT_URL']}/forgeline?list-type=2", timeout=30)
    assert anonymous.value.code == 403

    for name in ("stack.json", "s3-credentials.json", PG_CREDENTIALS, "prefect-credentials.json"):
        assert (root / name).stat().st_mode & 0o777 == 0o600, name

    secrets = {
        "PostgreSQL password": password,
        "Prefect auth string": auth.split(":", 1)[1],
        "S3 secret key": env["AWS_SECRET_ACCESS_KEY"],
    }
    pgdata = Path(state["postgres"]["pgdata"])
    postmaster = int((pgdata / "postmaster.pid").read_text().split()[0])
    started = [w["pid"] for w in state["workers"]] + [state["prefect"]["pid"], state["s3"]["pid"], postmaster]
    cmdlines = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdlines[int(proc.name)] = proc.joinpath("cmdline").read_bytes()
            except OSError:
                pass  # exited meanwhile
    assert all(pid in cmdlines for pid in started), started
    shown = [
        (what, pid) for pid, line in cmdlines.items() for what, secret in secrets.items() if secret.encode() in line
    ]
    assert not shown, shown
    logs = [p for p in (*root.rglob("*.log"), *postgres_dir(root).rglob("*.log")) if p.is_file()]
    assert any(p.name == "prefect-server.log" for p in logs) and any(p.name == "postgres.log" for p in logs)
    leaked = [(what, str(p)) for p in logs for what, secret in secrets.items() if secret.encode() in p.read_bytes()]
    assert not leaked, leaked


def test_release_on_workers_survives_a_killed_worker_and_equals_inline(stack, measured, tmp_path):
    root, env, state, up_seconds, up_out = stack
    run_id = uuid.uuid4().hex[:8]

    # the reference: the same recipe, inline (every stage in one process, an ephemeral Prefect server), started
    # once the fine-tune's worker is killed: it computes while the workers-mode release waits for the zombie
    # automation (90 s without a heartbeat), which leaves this test's CPU idle
    inline_env = {k: v for k, v in env.items() if k not in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING")}
    inline_out, inline_err = (tmp_path / "inline.out").open("w"), (tmp_path / "inline.err").open("w")
    inline = None

    store = f"s3://forgeline/workers-{run_id}"
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "release",
            "--recipe",
            SMOKE,
            *OVERRIDES,
            "--set",
            "execution=workers",
            "--store",
            store,
        ],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    killed, kill_at = None, None
    try:
        deadline = time.monotonic() + 1500
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the workers-mode release did not finish"
            if killed is None and _checkpointed(env, store):
                killed = _kill_the_finetune_worker(env, state)
                kill_at = datetime.now().astimezone()
                inline_t0 = time.monotonic()
                inline = subprocess.Popen(
                    [sys.executable, "-m", "flows.cli", "release", "--recipe", SMOKE, *OVERRIDES, "--store",
                     f"s3://forgeline/inline-{run_id}"],
                    cwd=ROOT, env=inline_env, text=True, stdout=inline_out, stderr=inline_err)
            time.sleep(0.2 if killed is None else 1.0)
        out, err = proc.communicate()
        seconds = time.monotonic() - t0
        assert killed is not None, "the fine-tune committed before a checkpoint was seen"
        inline.wait(timeout=900)
        inline_seconds = time.monotonic() - inline_t0
    finally:
        for p in (proc, inline):
            if p is not None and p.poll() is None:
                p.kill()
        inline_out.close(), inline_err.close()
    assert proc.returncode == 0, err[-3000:]
    assert inline.returncode == 0, (tmp_path / "inline.err").read_text()[-3000:]
    inline_bundle = _bundle(env, (tmp_path / "inline.out").read_text().strip().splitlines()[-1])
    bundle = _bundle(env, out.strip().splitlines()[-1])
    # weights, adapter, draft, quantized files, report: all equal
    assert bundle.digest == inline_bundle.digest, _differences(env, f"s3://forgeline/inline-{run_id}", store)

    runs = [r for r in _stage_runs(env) if r.start_time]  # this server ran nothing else
    with _client(env) as client:
        deployments = {d.id: d.name for d in client.read_deployments()}
    done = {r.name: r for r in runs if r.state.is_completed()}
    assert set(done) == STAGE_NAMES, sorted(done)
    for name, r in done.items():
        assert deployments[r.deployment_id] == name.split("[")[0], (name, deployments[r.deployment_id])
        assert r.parent_task_run_id is not None  # a child run of the release
        assert r.labels.get("prefect.worker.type") == "process" and r.labels.get("prefect.worker.name")
        assert int(str(r.infrastructure_pid).rsplit(":", 1)[-1]) != proc.pid
    pools = {name: r.work_pool_name for name, r in done.items()}
    assert pools["data_prep"] == pools["export"] == "forgeline-cpu" and pools["finetune"] == "forgeline-gpu"

    # the killed fine-tune: Crashed by the zombie automation, then run again elsewhere, resuming
    finetunes = sorted((r for r in runs if r.name == "finetune"), key=lambda r: r.start_time)
    assert [r.state.name for r in finetunes] == ["Crashed", "Completed"], [r.state.name for r in finetunes]
    assert finetunes[1].labels["prefect.worker.name"] != killed[0]
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with _client(env) as client:
        logs = [
            entry.message
            for entry in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[finetunes[1].id])), limit=200)
        ]
    resumed = [
        int(m.split("resumed from checkpoint at step")[1].split()[0])
        for m in logs
        if "resumed from checkpoint at step" in m
    ]
    assert resumed and resumed[0] < FINETUNE_STEPS, logs[-20:]  # it resumed with training left to do
    crashed_after = (finetunes[0].end_time - kill_at).total_seconds()

    # what the UI shows: the release run holds the eval report and the metrics; each training stage's run its
    # own progress bar, at 100 %
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowFilter, FlowFilterName

    with _client(env) as client:
        (release_run,) = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["release"])))
        artifacts = {
            name: client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[r.id]))
            )
            for name, r in [("release", release_run), *done.items()]
        }
    assert release_run.state.is_completed()
    assert set(_parent_flow_runs(env, done.values())) == {release_run.id}  # every stage a child of the release
    by_key = {a.key: a for a in artifacts["release"] if a.key}
    report = json.loads(_read(env, bundle.file("eval/report.json")))
    assert "| finetuned |" in by_key["forgeline-tiny-eval"].data  # the report's markdown
    table = by_key["forgeline-tiny-metrics"].data
    values = {row["metric"]: row["value"] for row in (json.loads(table) if isinstance(table, str) else table)}
    assert values["perplexity/finetuned"] == round(report["perplexity"]["finetuned"], 4)
    for name in ("base", "finetune", "draft"):
        progress = [a for a in artifacts[name] if a.type == "progress"]
        assert progress and progress[-1].data == 100.0, (name, [(a.type, a.data) for a in artifacts[name]])

    q, t = done["quantize"], done["traces"]
    overlap = (min(q.end_time, t.end_time) - max(q.start_time, t.start_time)).total_seconds()
    assert overlap > 0, (q.start_time, q.end_time, t.start_time, t.end_time)

    start = min(r.start_time for r in runs)
    measured(
        f"workers: `forgeline stack up` (PostgreSQL, Prefect server, SeaweedFS, 3 GPU + 1 CPU process "
        f"workers) in {up_seconds:.0f}s; inline release {inline_seconds:.0f}s (during the workers release), "
        f"workers release {seconds:.0f}s, "
        f"bundle digest equal ({bundle.digest[:16]})"
    )
    measured(
        f"  worker {killed[0]} SIGKILLed during finetune: run marked Crashed {crashed_after:.0f}s later, "
        f"rerun on {finetunes[1].labels['prefect.worker.name']} resumed from its checkpoint"
    )
    for r in sorted(runs, key=lambda r: r.start_time):
        a = (r.start_time - start).total_seconds()
        b = (r.end_time - start).total_seconds() if r.end_time else float("nan")
        measured(
            f"  {r.name:<16} {r.state.name:<9} {r.labels.get('prefect.worker.name', '?'):<6} {a:6.0f}s -> {b:6.0f}s"
        )
    measured(f"  quantize and traces overlapped for {overlap:.0f}s")
